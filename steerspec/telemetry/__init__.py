"""Prometheus-format metrics for SteerSpec services (see metrics.py)."""

from steerspec.telemetry.metrics import SteerSpecMetrics, start_metrics_server

__all__ = ["SteerSpecMetrics", "start_metrics_server"]

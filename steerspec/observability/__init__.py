"""Seeing a deployment work: OpenTelemetry tracing and trace summaries, Prometheus metrics of the loop and the
services, and the record a benchmark's JSON carries."""

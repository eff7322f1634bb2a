"""Prometheus metrics of the round-trip loop, on a per-instance registry (no import-time globals).

Usage in the coordinator::

    metrics = SteerSpecMetrics()                  # own CollectorRegistry
    server = start_metrics_server(args.metrics_port, metrics.registry)
    ...
    metrics.observe_block(drafted=k, accepted=a, stages=BlockStages(...), bytes_up=.., bytes_down=..)

Names: ``steerspec_drafts_total``, ``steerspec_draft_tokens_total``,
``steerspec_accepted_tokens_total{position}`` (1-based draft position), histograms
``steerspec_round_trip_ms`` and ``steerspec_stage_ms{stage}`` (draft, network, queue, verify,
overhead), ``steerspec_bytes_up`` / ``steerspec_bytes_down`` per block, plus generations and
generated tokens.
"""

from __future__ import annotations

import threading
from typing import Any, Optional, Tuple

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, start_http_server

from steerspec.tracing import STAGES, BlockStages

# Milliseconds: sub-ms overheads up to multi-second verifier stalls.
MS_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
BYTE_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536, 262144)


class SteerSpecMetrics:
    """The coordinator's counters and histograms, registered on ``self.registry``."""

    def __init__(self, registry: Optional[CollectorRegistry] = None, service: str = "coordinator") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.service = service
        labels = ("service",)
        self.drafts = Counter("steerspec_drafts", "Draft blocks verified", labels, registry=self.registry)
        self.draft_tokens = Counter("steerspec_draft_tokens", "Draft tokens proposed", labels, registry=self.registry)
        self.accepted_tokens = Counter(
            "steerspec_accepted_tokens", "Accepted draft tokens by 1-based draft position",
            labels + ("position",), registry=self.registry,
        )
        self.generations = Counter("steerspec_generations", "Finished generations", labels + ("finish_reason",),
                                   registry=self.registry)
        self.generated_tokens = Counter("steerspec_generated_tokens", "Tokens committed", labels, registry=self.registry)
        self.round_trip = Histogram("steerspec_round_trip_ms", "Round trip per block (ms)", labels,
                                    buckets=MS_BUCKETS, registry=self.registry)
        self.stage = Histogram("steerspec_stage_ms", "Round-trip stage time per block (ms)", labels + ("stage",),
                               buckets=MS_BUCKETS, registry=self.registry)
        self.bytes_up = Histogram("steerspec_bytes_up", "Bytes sent to the verifier per block", labels,
                                  buckets=BYTE_BUCKETS, registry=self.registry)
        self.bytes_down = Histogram("steerspec_bytes_down", "Bytes received from the verifier per block", labels,
                                    buckets=BYTE_BUCKETS, registry=self.registry)
        self.lossy_sessions = Counter("steerspec_lossy_sessions", "Sessions served with lossy verification",
                                      labels + ("verification",), registry=self.registry)
        self._lock = threading.Lock()

    def observe_block(
        self,
        drafted: int,
        accepted: int,
        stages: Optional[BlockStages] = None,
        bytes_up: Optional[float] = None,
        bytes_down: Optional[float] = None,
        committed: Optional[int] = None,
    ) -> None:
        """Record one verified block: ``accepted`` of ``drafted`` draft tokens.

        ``committed`` is how many tokens the block added to the output (default ``accepted + 1``;
        less on a block truncated at max_new_tokens or EOS).
        """
        s = self.service
        with self._lock:
            if drafted > 0:
                self.drafts.labels(s).inc()
                self.draft_tokens.labels(s).inc(drafted)
            for position in range(1, accepted + 1):
                self.accepted_tokens.labels(s, str(position)).inc()
            self.generated_tokens.labels(s).inc(accepted + 1 if committed is None else committed)
            if stages is not None:
                self.round_trip.labels(s).observe(stages.rtt_ms)
                for name, value in zip(STAGES, (stages.draft_ms, stages.network_ms, stages.queue_ms,
                                                stages.verify_ms, stages.overhead_ms)):
                    self.stage.labels(s, name).observe(value)
            if bytes_up is not None:
                self.bytes_up.labels(s).observe(bytes_up)
            if bytes_down is not None:
                self.bytes_down.labels(s).observe(bytes_down)

    def observe_generation(self, finish_reason: str = "length") -> None:
        self.generations.labels(self.service, finish_reason).inc()

    def observe_lossy_session(self, verification: str = "sprinter") -> None:
        """steerspec_lossy_sessions_total{verification}: a session started whose output is not exact."""
        self.lossy_sessions.labels(self.service, verification).inc()

    def exposition(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)


def start_metrics_server(port: int, registry: CollectorRegistry, addr: str = "127.0.0.1") -> Tuple[Any, int]:
    """Serve ``/metrics`` for ``registry`` on addr:port (0 = any free port); returns (server, port).

    Stop with ``server.shutdown()``. Binds loopback unless told otherwise.
    """
    try:
        server, thread = start_http_server(port, addr=addr, registry=registry)
    except (OSError, OverflowError) as exc:
        from steerspec.errors import UsageError

        raise UsageError(f"cannot serve metrics on {addr}:{port} ({getattr(exc, 'strerror', None) or exc}); "
                         "choose another --metrics-port (0 = any free port) or --metrics-host") from None
    del thread  # a daemon thread; it lives as long as the server
    return server, int(server.server_address[1])

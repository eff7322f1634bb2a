"""Prometheus metrics of the round-trip loop, on a per-instance registry (no import-time globals).

Usage in the coordinator::

    metrics = SteerSpecMetrics()                  # own CollectorRegistry
    server = start_metrics_server(args.metrics_port, metrics.registry)
    ...
    metrics.observe_block(stats)                 # a steerspec.decoding.rounds.BlockStats, one per block

Names: ``steerspec_drafts_total``, ``steerspec_draft_tokens_total``,
``steerspec_accepted_tokens_total{position}`` (1-based draft position), histograms
``steerspec_round_trip_ms`` (the block's whole cycle, BlockStats.cycle_ms) and
``steerspec_stage_ms{stage}`` (draft, network, queue, verify, overhead), ``steerspec_bytes_up`` / ``steerspec_bytes_down`` per block, plus generations and
generated tokens.
"""

from __future__ import annotations

import threading
from typing import Any, Optional, Tuple

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, start_http_server

from steerspec.decoding.rounds import BlockStats
from steerspec.errors import UsageError
from steerspec.observability.tracing import STAGES

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

    def observe_block(self, stats: BlockStats) -> None:
        """Record one verified block from its BlockStats: `accepted` of `drafted` draft tokens, the
        `committed` tokens it added, its cycle as the round trip, its stages and its bytes."""
        s = self.service
        with self._lock:
            if stats.drafted > 0:
                self.drafts.labels(s).inc()
                self.draft_tokens.labels(s).inc(stats.drafted)
            for position in range(1, stats.accepted + 1):
                self.accepted_tokens.labels(s, str(position)).inc()
            self.generated_tokens.labels(s).inc(stats.committed)
            self.round_trip.labels(s).observe(stats.cycle_ms)
            for name, value in zip(STAGES, (stats.draft_ms, stats.network_ms, stats.queue_ms,
                                            stats.verify_ms, stats.overhead_ms)):
                self.stage.labels(s, name).observe(value)
            self.bytes_up.labels(s).observe(stats.bytes_up)
            self.bytes_down.labels(s).observe(stats.bytes_down)

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
        raise UsageError(f"cannot serve metrics on {addr}:{port} ({getattr(exc, 'strerror', None) or exc}); "
                         "choose another --metrics-port (0 = any free port) or --metrics-host") from None
    del thread  # a daemon thread; it lives as long as the server
    return server, int(server.server_address[1])

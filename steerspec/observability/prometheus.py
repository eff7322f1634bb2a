"""Prometheus metrics of the round-trip loop, on a per-instance registry (no import-time globals), in the
field's names and units (seconds, bytes); docs/guides/observability.md lists every metric.

Usage in the coordinator::

    metrics = SteerSpecMetrics()                  # own CollectorRegistry
    server = start_metrics_server(args.metrics_port, metrics.registry)
    ...
    metrics.observe_block(stats)                 # a steerspec.decoding.rounds.BlockStats, one per block
    metrics.observe_request("chat", model, ttft_s, tpot_s, duration_s)   # one per request

Names: the speculative-decoding counters as vLLM names them, prefixed ``steerspec_``
(``steerspec_spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total``,
``..._num_accepted_tokens_per_pos_total{position}``, 0-based like vLLM's); the OpenTelemetry GenAI server
metrics (``gen_ai_server_time_to_first_token_seconds``, ``gen_ai_server_time_per_output_token_seconds``,
``gen_ai_server_request_duration_seconds``, with their advisory buckets); the round trip
(``steerspec_round_trip_seconds``, the block's whole cycle) and its stages (``steerspec_stage_seconds{stage}``:
draft, network, queue, verify, overhead); ``steerspec_block_bytes{direction}`` (up, down) per block; generations
and generated tokens.
"""

from __future__ import annotations

import threading
from typing import Any, Optional, Tuple

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, start_http_server

from steerspec.decoding.rounds import BlockStats
from steerspec.errors import UsageError
from steerspec.observability.tracing import STAGES

# Seconds: sub-ms overheads up to multi-second verifier stalls.
SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)
BYTE_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536, 262144)
# the OpenTelemetry GenAI server metrics' advisory buckets (semconv 1.44.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
GENAI_LABELS = ("gen_ai_operation_name", "gen_ai_request_model")


class SpecDecodeCounters:
    """Drafts, draft tokens and accepted tokens (also by draft position) of one service: the coordinator counts
    the blocks it commits, the verifier those it verifies."""

    def __init__(self, registry: CollectorRegistry, service: str) -> None:
        self.service = service
        labels = ("service",)
        self.drafts = Counter("steerspec_spec_decode_num_drafts", "Draft blocks verified (blocks with no draft "
                              "tokens left out)", labels, registry=registry)
        self.draft_tokens = Counter("steerspec_spec_decode_num_draft_tokens", "Draft tokens proposed", labels,
                                    registry=registry)
        self.accepted_tokens = Counter("steerspec_spec_decode_num_accepted_tokens", "Draft tokens accepted", labels,
                                       registry=registry)
        self.accepted_per_pos = Counter("steerspec_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted by 0-based draft position", labels + ("position",),
                                        registry=registry)

    def observe(self, drafted: int, accepted: int) -> None:
        """One verified block: `accepted` of its `drafted` draft tokens (a tree's: along the accepted path)."""
        if drafted <= 0:
            return
        self.drafts.labels(self.service).inc()
        self.draft_tokens.labels(self.service).inc(drafted)
        self.accepted_tokens.labels(self.service).inc(accepted)
        for position in range(accepted):
            self.accepted_per_pos.labels(self.service, str(position)).inc()


class SteerSpecMetrics:
    """The coordinator's counters and histograms, registered on ``self.registry``."""

    def __init__(self, registry: Optional[CollectorRegistry] = None, service: str = "coordinator") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.service = service
        labels = ("service",)
        self.spec_decode = SpecDecodeCounters(self.registry, service)
        self.generations = Counter("steerspec_generations", "Finished generations", labels + ("finish_reason",),
                                   registry=self.registry)
        self.generated_tokens = Counter("steerspec_generated_tokens", "Tokens committed", labels, registry=self.registry)
        self.round_trip = Histogram("steerspec_round_trip_seconds", "Round trip per block: its whole cycle, from "
                                    "asking for the draft to committing the result", labels,
                                    buckets=SECONDS_BUCKETS, registry=self.registry)
        self.stage = Histogram("steerspec_stage_seconds", "Round-trip stage time per block", labels + ("stage",),
                               buckets=SECONDS_BUCKETS, registry=self.registry)
        self.block_bytes = Histogram("steerspec_block_bytes", "Serialized bytes per block, to the verifier (up) and "
                                     "back (down)", labels + ("direction",), buckets=BYTE_BUCKETS,
                                     registry=self.registry)
        self.lossy_sessions = Counter("steerspec_lossy_sessions", "Sessions served with lossy verification",
                                      labels + ("verification",), registry=self.registry)
        self.ttft = Histogram("gen_ai_server_time_to_first_token", "Time from the request's arrival to its first "
                              "output token", labels + GENAI_LABELS, unit="seconds", buckets=TTFT_BUCKETS,
                              registry=self.registry)
        self.tpot = Histogram("gen_ai_server_time_per_output_token", "Time per output token after the first, one "
                              "observation per request", labels + GENAI_LABELS, unit="seconds",
                              buckets=TPOT_BUCKETS, registry=self.registry)
        self.duration = Histogram("gen_ai_server_request_duration", "Time from the request's arrival to its end",
                                  labels + GENAI_LABELS + ("error_type",), unit="seconds",
                                  buckets=DURATION_BUCKETS, registry=self.registry)
        self.ahead_blocks = Counter("steerspec_draft_ahead_blocks", "Blocks that followed a block the drafter "
                                    "drafted ahead for (drafter_service/ahead.py)", labels, registry=self.registry)
        self.ahead_hits = Counter("steerspec_draft_ahead_hits", "Blocks the drafter had prepared ahead for their "
                                  "actual verdict (hit rate = hits / blocks)", labels, registry=self.registry)
        self.ahead_prepared = Counter("steerspec_draft_ahead_prepared", "Verdicts the drafter prepared a next block "
                                      "for (per block: prepared / blocks)", labels, registry=self.registry)
        self.critical_draft = Histogram("steerspec_critical_draft_seconds", "Drafter compute left on the critical "
                                        "path per block (the drafter's own report: after a hit, loading the "
                                        "prepared block)", labels, buckets=SECONDS_BUCKETS, registry=self.registry)
        self._lock = threading.Lock()

    def observe_block(self, stats: BlockStats) -> None:
        """Record one verified block from its BlockStats: `accepted` of `drafted` draft tokens, the
        `committed` tokens it added, its cycle as the round trip, its stages and its bytes."""
        s = self.service
        with self._lock:
            self.spec_decode.observe(stats.drafted, stats.accepted)
            self.generated_tokens.labels(s).inc(stats.committed)
            self.round_trip.labels(s).observe(stats.cycle_ms / 1e3)
            for name, value in zip(STAGES, (stats.draft_ms, stats.network_ms, stats.queue_ms,
                                            stats.verify_ms, stats.overhead_ms)):
                self.stage.labels(s, name).observe(value / 1e3)
            self.block_bytes.labels(s, "up").observe(stats.bytes_up)
            self.block_bytes.labels(s, "down").observe(stats.bytes_down)
            if stats.drafted or stats.ahead:
                self.critical_draft.labels(s).observe(stats.draft_compute_ms / 1e3)
            if stats.ahead:
                self.ahead_blocks.labels(s).inc()
                self.ahead_hits.labels(s).inc(int(stats.ahead_hit))
                self.ahead_prepared.labels(s).inc(stats.ahead_prepared)

    def observe_request(self, operation: str, model: str, ttft_s: Optional[float], tpot_s: Optional[float],
                        duration_s: float, error_type: str = "") -> None:
        """One request's GenAI server metrics (TTFT and TPOT only when it produced one, resp. two, tokens)."""
        s = self.service
        if ttft_s is not None:
            self.ttft.labels(s, operation, model).observe(ttft_s)
        if tpot_s is not None:
            self.tpot.labels(s, operation, model).observe(tpot_s)
        self.duration.labels(s, operation, model, error_type).observe(duration_s)

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

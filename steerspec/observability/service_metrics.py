"""Per-call Prometheus metrics for every SteerSpec server (coordinator, verifier, drafter).

    metrics = CallMetrics("verifier")            # own CollectorRegistry
    install(metrics)                             # start_server adds its interceptor from now on
    metrics.gauge("steerspec_sessions_active", "Sessions open on this replica", lambda: len(table))
    start_metrics_server(port, metrics.registry)

Names: ``steerspec_calls_active{service,method}`` (calls in flight: on the coordinator, live
generations), ``steerspec_calls_total{service,method,code}`` (every call by its final status, so
refusals and failures show by code), ``steerspec_call_duration_seconds{service,method}``, and
gauges a service adds (sessions, cache bytes). The coordinator adds ``steerspec_resumes_total``; the verifier
and drafter their batcher's passes (`watch_batcher`: rows and blocks per pass, queue depth, busy seconds), the
verifier its speculative-decoding counters (`spec_decode`, prometheus.SpecDecodeCounters).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import grpc
import grpc.aio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from steerspec.observability.prometheus import SECONDS_BUCKETS, SpecDecodeCounters, start_metrics_server

ROW_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)

_INSTALLED: Optional["CallMetrics"] = None


class CallMetrics:
    """Active calls, calls by final status code and call durations of one server process."""

    def __init__(self, service: str, registry: Optional[CollectorRegistry] = None) -> None:
        self.service = service
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ("service", "method")
        self.active = Gauge("steerspec_calls_active", "gRPC calls in flight", labels, registry=self.registry)
        self.calls = Counter("steerspec_calls", "gRPC calls by final status code", labels + ("code",),
                             registry=self.registry)
        self.duration = Histogram("steerspec_call_duration_seconds", "gRPC call duration", labels,
                                  buckets=SECONDS_BUCKETS, registry=self.registry)
        self.spec_decode: Optional[SpecDecodeCounters] = None  # the verifier's (`count_spec_decode`)
        self.resumes = Counter("steerspec_resumes", "Sessions resumed from a checkpoint or failed over",
                               ("service",), registry=self.registry)

    def gauge(self, name: str, help_text: str, read: Callable[[], float]) -> Gauge:
        """A gauge read at scrape time from `read()` (sessions, cache bytes, queue depth)."""
        gauge = Gauge(name, help_text, ("service",), registry=self.registry)
        gauge.labels(self.service).set_function(lambda: float(read()))
        return gauge

    def watch_table(self, table, cache_bytes: Callable[[], float]) -> None:
        """Gauges of a replica's session table: sessions open and KV-cache bytes."""
        self.gauge("steerspec_sessions_active", "Sessions open on this replica", lambda: len(table))
        self.gauge("steerspec_cache_bytes", "KV-cache bytes held by this replica's sessions", cache_bytes)

    def count_spec_decode(self) -> SpecDecodeCounters:
        """The speculative-decoding counters of this service (the verifier counts the blocks it verifies)."""
        if self.spec_decode is None:
            self.spec_decode = SpecDecodeCounters(self.registry, self.service)
        return self.spec_decode

    def watch_batcher(self, batcher) -> None:
        """A WindowBatcher's passes (steerspec/serving/batching.py): rows and blocks per pass as histograms, its
        queue depth, and its busy seconds (busy fraction = rate)."""
        service = self.service
        rows = Histogram("steerspec_batch_rows", "Rows scored per compute pass (verifier: a block of k drafts is "
                         "k + 1 rows; drafter: blocks)", ("service",), buckets=ROW_BUCKETS, registry=self.registry)
        blocks = Histogram("steerspec_batch_size", "Blocks (sessions) served per compute pass", ("service",),
                           buckets=BATCH_BUCKETS, registry=self.registry)
        self.gauge("steerspec_queue_depth", "Blocks waiting for a compute pass", lambda: batcher.queue_depth)
        self.registry.register(BatcherCollector(service, batcher))

        def on_pass(n_blocks: int, n_rows: int) -> None:
            rows.labels(service).observe(n_rows)
            blocks.labels(service).observe(n_blocks)

        batcher.on_pass = on_pass

    def record(self, method: str, code: grpc.StatusCode, started: float) -> None:
        self.calls.labels(self.service, method, code.name).inc()
        self.duration.labels(self.service, method).observe(time.perf_counter() - started)

    def interceptor(self) -> "CallMetricsInterceptor":
        return CallMetricsInterceptor(self)


class BatcherCollector:
    """A batcher's running totals as counters, read at scrape time: passes, rows, blocks, busy seconds."""

    def __init__(self, service: str, batcher) -> None:
        self.service, self.batcher = service, batcher

    def collect(self):
        b = self.batcher
        for name, help_text, value in (
                ("steerspec_passes", "Compute passes (verifier: batched verify forwards; drafter: draft calls)",
                 b.batches),
                ("steerspec_pass_rows", "Rows the compute passes scored", b.rows),
                ("steerspec_pass_blocks", "Blocks the compute passes served", b.batched_blocks),
                ("steerspec_busy_seconds", "Seconds spent computing, prefills included (rate: busy fraction)",
                 b.busy_s)):
            family = CounterMetricFamily(name, help_text, labels=["service"])
            family.add_metric([self.service], float(value))
            yield family


def _code_of(context, exc: Optional[BaseException]) -> grpc.StatusCode:
    code = None
    try:
        code = context.code()
    except Exception:  # noqa: BLE001 - older grpc without ServicerContext.code()
        code = None
    if isinstance(code, grpc.StatusCode):
        return code
    if exc is None:
        return grpc.StatusCode.OK
    if isinstance(exc, BaseException) and exc.__class__.__name__ == "CancelledError":
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


class CallMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts every call of the services (health and reflection excluded) by method and final code."""

    def __init__(self, metrics: CallMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(("/grpc.health", "/grpc.reflection")):
            return handler
        name = method.rsplit("/", 1)[-1]
        metrics = self.metrics

        def wrap_stream(behavior):
            async def wrapped(request, context):
                started, exc = time.perf_counter(), None
                metrics.active.labels(metrics.service, name).inc()
                try:
                    result = behavior(request, context)
                    if hasattr(result, "__aiter__"):
                        async for item in result:
                            yield item
                    else:
                        await result
                except BaseException as error:
                    exc = error
                    raise
                finally:
                    metrics.active.labels(metrics.service, name).dec()
                    metrics.record(name, _code_of(context, exc), started)
            return wrapped

        def wrap_unary(behavior):
            async def wrapped(request, context):
                started, exc = time.perf_counter(), None
                metrics.active.labels(metrics.service, name).inc()
                try:
                    return await behavior(request, context)
                except BaseException as error:
                    exc = error
                    raise
                finally:
                    metrics.active.labels(metrics.service, name).dec()
                    metrics.record(name, _code_of(context, exc), started)
            return wrapped

        kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(wrap_unary(handler.unary_unary), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(wrap_stream(handler.unary_stream), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(wrap_unary(handler.stream_unary), **kw)
        return grpc.stream_stream_rpc_method_handler(wrap_stream(handler.stream_stream), **kw)


def install(metrics: Optional[CallMetrics]) -> None:
    """Make `start_server` add `metrics`' interceptor to the servers this process starts (None: stop)."""
    global _INSTALLED
    _INSTALLED = metrics


def current() -> Optional[CallMetrics]:
    """The installed CallMetrics (None when this process serves no metrics)."""
    return _INSTALLED


def interceptors() -> list:
    """The interceptors of the installed CallMetrics (empty when none)."""
    return [_INSTALLED.interceptor()] if _INSTALLED is not None else []


def add_arguments(parser) -> None:
    """--metrics-port / --metrics-host for the verifier and drafter (the coordinator has its own)."""
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    parser.add_argument("--metrics-host", default=None,
                        help="address for /metrics (default: --host; 0.0.0.0 lets a Prometheus container scrape it)")


def start(service: str, port: Optional[int], host: str,
          registry: Optional[CollectorRegistry] = None) -> Optional[CallMetrics]:
    """With a port: install CallMetrics for `service` (before its server starts) and serve /metrics;
    prints where. None without a port."""
    if port is None:
        return None

    metrics = CallMetrics(service, registry)
    install(metrics)
    _, bound = start_metrics_server(port, metrics.registry, addr=host)
    print(f"steerspec {service} metrics on http://{host}:{bound}/metrics", flush=True)
    return metrics

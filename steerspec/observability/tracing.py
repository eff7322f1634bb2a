"""OpenTelemetry tracing for SteerSpec: set-up, gRPC instrumentation and span helpers.

One trace per generation::

    steerspec.generate                                   (coordinator; root of the generation)
    ├── /steerspec.v1.VerifierService/Verify   CLIENT    (coordinator; gRPC instrumentation)
    │   └── /steerspec.v1.VerifierService/Verify SERVER  (verifier process; linked by traceparent)
    │       ├── steerspec.verifier.queue                  (one per block: waiting for a batch)
    │       └── steerspec.verifier.forward                (one per block: batched forward + accept)
    ├── /steerspec.v1.DrafterService/Draft     CLIENT    (coordinator)
    │   └── /steerspec.v1.DrafterService/Draft SERVER    (drafter process)
    │       └── steerspec.drafter.draft                   (one per block)
    └── steerspec.block                                   (one per round trip; stage attributes)

Usage (every service process)::

    setup_tracing("steerspec-verifier", trace_file=args.trace_file)
    instrument_grpc()              # before grpc.aio.server(...) / grpc.aio.insecure_channel(...)
    tracer = get_tracer(__name__)

Exporters: OTLP/gRPC when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set, else a JSONL file (one span
per line) when ``trace_file`` is given, else none (spans are still created so trace ids exist,
but nothing is exported).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence

import grpc.aio
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import Span, SpanKind

__all__ = [
    "BLOCK_SPAN",
    "DRAFTER_DRAFT_SPAN",
    "GENERATION_SPAN",
    "VERIFIER_FORWARD_SPAN",
    "VERIFIER_QUEUE_SPAN",
    "JsonlSpanExporter",
    "block_attributes",
    "block_span",
    "flush_tracing",
    "generation_span",
    "get_tracer",
    "instrument_grpc",
    "now_ns",
    "record_span",
    "setup_tracing",
    "shutdown_tracing",
    "span_context",
    "traceparent",
    "context_from_traceparent",
    "uninstrument_grpc",
]

TRACER_NAME = "steerspec"
ATTR_PREFIX = "steerspec."
GENERATION_SPAN = "steerspec.generate"
BLOCK_SPAN = "steerspec.block"
VERIFIER_QUEUE_SPAN = "steerspec.verifier.queue"
VERIFIER_FORWARD_SPAN = "steerspec.verifier.forward"
DRAFTER_DRAFT_SPAN = "steerspec.drafter.draft"
STAGES = ("draft", "network", "queue", "verify", "overhead")


# --------------------------------------------------------------------------- JSONL exporter


def _hex_trace(trace_id: int) -> str:
    return f"{trace_id:032x}"


def _hex_span(span_id: int) -> str:
    return f"{span_id:016x}"


def span_to_dict(span: ReadableSpan, service: str = "") -> Dict[str, Any]:
    """One finished span as the JSON object written to a trace file."""
    ctx = span.context
    parent = span.parent
    resource_service = span.resource.attributes.get("service.name") if span.resource else None
    return {
        "name": span.name,
        "trace_id": _hex_trace(ctx.trace_id),
        "span_id": _hex_span(ctx.span_id),
        "parent_id": _hex_span(parent.span_id) if parent is not None else None,
        "parent_remote": bool(parent.is_remote) if parent is not None else False,
        "kind": span.kind.name if span.kind is not None else "INTERNAL",
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": {k: (list(v) if isinstance(v, tuple) else v) for k, v in (span.attributes or {}).items()},
        "status": span.status.status_code.name if span.status is not None else "UNSET",
        "service": service or resource_service or "",
        "pid": os.getpid(),
    }


class JsonlSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file (several processes may share it).

    Each line is written with a single ``os.write`` on an ``O_APPEND`` descriptor, so lines from
    different processes do not interleave.
    """

    def __init__(self, path: str, service: str = "") -> None:
        self.path = os.path.abspath(path)
        self.service = service
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        self._fd: Optional[int] = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            data = "".join(json.dumps(span_to_dict(s, self.service), separators=(",", ":")) + "\n" for s in spans)
            if data:
                os.write(self._fd, data.encode("utf-8"))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


# --------------------------------------------------------------------------- set-up


class _SwitchProcessor(SpanProcessor):
    """The one processor on the global provider; its delegates can be swapped by setup_tracing.

    OpenTelemetry lets a process set its global TracerProvider only once; routing through this
    processor lets tests (and in-process clusters) point the same provider at a new file.
    """

    def __init__(self) -> None:
        self._delegates: List[SpanProcessor] = []
        self._lock = threading.Lock()

    def replace(self, delegates: List[SpanProcessor]) -> None:
        with self._lock:
            old, self._delegates = self._delegates, list(delegates)
        for processor in old:
            processor.shutdown()

    def on_start(self, span, parent_context=None) -> None:
        for processor in self._delegates:
            processor.on_start(span, parent_context=parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        for processor in self._delegates:
            processor.on_end(span)

    def shutdown(self) -> None:
        self.replace([])

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return all(p.force_flush(timeout_millis) for p in list(self._delegates))


@dataclass
class _TracingState:
    provider: TracerProvider
    switch: _SwitchProcessor
    service_name: str
    trace_file: Optional[str]
    otlp_endpoint: Optional[str]


_STATE_LOCK = threading.Lock()
_STATE: Dict[str, Any] = {}  # "global" -> state; a dict so no module global is rebound


def _make_processors(service_name: str, trace_file: Optional[str]) -> List[SpanProcessor]:
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if endpoint:
        # lazy: OpenTelemetry only when tracing is on
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter,  # lazy: OpenTelemetry only when tracing is on
        )

        return [BatchSpanProcessor(OTLPSpanExporter())]  # reads endpoint/headers/insecure from env
    if trace_file:
        return [SimpleSpanProcessor(JsonlSpanExporter(trace_file, service=service_name))]
    return []


def setup_tracing(service_name: str, trace_file: Optional[str] = None) -> TracerProvider:
    """Install (once per process) an SDK TracerProvider with resource ``service.name``.

    Exporter: OTLP gRPC when OTEL_EXPORTER_OTLP_ENDPOINT is set, else a JSONL file when
    ``trace_file`` is given, else none. Calling it again is cheap and idempotent; with another
    ``trace_file`` it re-points the exporter (the resource keeps the first service name, while the
    JSONL ``service`` field uses the latest one).
    """
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    with _STATE_LOCK:
        state = _STATE.get("global")
        if state is None:
            switch = _SwitchProcessor()
            provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
            provider.add_span_processor(switch)
            current = trace.get_tracer_provider()
            if isinstance(current, TracerProvider):
                # Someone else installed an SDK provider: attach to it instead of fighting it.
                provider = current
                provider.add_span_processor(switch)
            else:
                trace.set_tracer_provider(provider)
            state = _TracingState(provider, switch, service_name, None, None)
            _STATE["global"] = state
            state.switch.replace(_make_processors(service_name, trace_file))
            state.trace_file, state.otlp_endpoint, state.service_name = trace_file, endpoint, service_name
        elif (state.trace_file, state.otlp_endpoint, state.service_name) != (trace_file, endpoint, service_name):
            state.switch.replace(_make_processors(service_name, trace_file))
            state.trace_file, state.otlp_endpoint, state.service_name = trace_file, endpoint, service_name
        return state.provider


def flush_tracing(timeout_millis: int = 10000) -> bool:
    """Export every finished span now (call before reading a trace file)."""
    state = _STATE.get("global")
    return state.switch.force_flush(timeout_millis) if state else True


def shutdown_tracing() -> None:
    """Flush and detach the exporters (the provider stays installed and keeps creating spans)."""
    with _STATE_LOCK:
        state = _STATE.get("global")
        if state is not None:
            state.switch.force_flush()
            state.switch.replace([])
            state.trace_file = state.otlp_endpoint = None


def get_tracer(name: str = TRACER_NAME) -> trace.Tracer:
    """A tracer from the global provider (a no-op one until setup_tracing)."""
    return trace.get_tracer(name)


# --------------------------------------------------------------------------- gRPC instrumentation


def _quiet_filter():
    """Trace SteerSpec's own sessions only: not health checks, reflection, Ray's internal gRPC, nor the
    GetVerifierStats / GetDrafterStats probes (a coordinator asks what a replica serves at start-up)."""
    # lazy: OpenTelemetry only when tracing is on
    from opentelemetry.instrumentation.grpc import filters

    return filters.all_of(filters.service_prefix("steerspec."), filters.negate(filters.method_prefix("Get")))


def _make_server_interceptor():
    """An aio server interceptor that also supports read/write-style (coroutine) stream handlers.

    The stock OpenTelemetry aio interceptor only wraps async-generator handlers; a handler written
    as ``async def Verify(self, request_iterator, context)`` with ``context.write`` would break.
    """
    # lazy: OpenTelemetry only when tracing is on
    from opentelemetry.instrumentation.grpc._aio_server import (
        OpenTelemetryAioServerInterceptor,
        _OpenTelemetryAioServicerContext,
    )  # lazy: OpenTelemetry only when tracing is on

    class SteerSpecAioServerInterceptor(OpenTelemetryAioServerInterceptor):
        def _intercept_aio_server_stream(self, behavior, handler_call_details):
            if inspect.isasyncgenfunction(behavior):
                return super()._intercept_aio_server_stream(behavior, handler_call_details)

            async def _stream_coroutine(request_or_iterator, context):
                with self._set_remote_context(context):
                    with self._start_span(handler_call_details, context, set_status_on_exception=False) as span:
                        wrapped = _OpenTelemetryAioServicerContext(context, span)
                        try:
                            return await behavior(request_or_iterator, wrapped)
                        except Exception as error:
                            if type(error) is not Exception:
                                span.record_exception(error)
                            raise

            return _stream_coroutine

    return SteerSpecAioServerInterceptor(trace.get_tracer("opentelemetry.instrumentation.grpc"), filter_=_quiet_filter())


def instrument_grpc() -> None:
    """Trace every grpc.aio client call and server handler created after this call (idempotent).

    Client side: ``opentelemetry-instrumentation-grpc``'s GrpcAioInstrumentorClient (patches
    ``grpc.aio.insecure_channel``/``secure_channel``; injects ``traceparent`` metadata). Server
    side: ``grpc.aio.server`` is patched to add a server interceptor that extracts it, so server
    spans are children of the caller's client span across processes. Call sites must look up
    ``grpc.aio.server`` / ``grpc.aio.insecure_channel`` at call time (not ``from grpc.aio import``).
    Only ``steerspec.*`` services are traced (no health checks, reflection or Ray internals).
    Synchronous channels are left alone: the stock sync instrumentation replaces a streaming call
    object with a plain generator (no ``cancel()``), which the sync ``steerspec.Client`` relies on;
    its generations are rooted at the coordinator's Generate server span instead.
    """
    # lazy: OpenTelemetry only when tracing is on
    import grpc
    import grpc.aio
    from opentelemetry.instrumentation.grpc import (
        GrpcAioInstrumentorClient,  # lazy: OpenTelemetry only when tracing is on
    )

    with _STATE_LOCK:
        if _STATE.get("grpc_instrumented") is not None:
            return
        client = GrpcAioInstrumentorClient(filter_=_quiet_filter())
        if not client.is_instrumented_by_opentelemetry:
            client.instrument()
        original_server = grpc.aio.server

        def server(*args, **kwargs):
            interceptors = list(kwargs.get("interceptors") or [])
            if not any(type(i).__name__ == "SteerSpecAioServerInterceptor" for i in interceptors):
                interceptors.insert(0, _make_server_interceptor())
            kwargs["interceptors"] = interceptors
            return original_server(*args, **kwargs)

        server.__wrapped__ = original_server  # type: ignore[attr-defined]
        grpc.aio.server = server
        _STATE["grpc_instrumented"] = client  # type: ignore[assignment]


def uninstrument_grpc() -> None:
    """Undo instrument_grpc() (tests use it so later tests get plain gRPC objects)."""
    with _STATE_LOCK:
        client = _STATE.pop("grpc_instrumented", None)
        if client is None:
            return
        client.uninstrument()
        original = getattr(grpc.aio.server, "__wrapped__", None)
        if original is not None:
            grpc.aio.server = original


# --------------------------------------------------------------------------- span helpers


def _attrs(values: Mapping[str, Any]) -> Dict[str, Any]:
    """``{"k": 8}`` -> ``{"steerspec.k": 8}``, dropping Nones."""
    out: Dict[str, Any] = {}
    for key, value in values.items():
        if value is None:
            continue
        name = key if key.startswith(ATTR_PREFIX) else ATTR_PREFIX + key
        if isinstance(value, (list, tuple)):
            value = list(value)
        out[name] = value
    return out


@contextlib.contextmanager
def generation_span(tracer: trace.Tracer, **attributes: Any) -> Iterator[Span]:
    """The root span of one generation; attributes go under ``steerspec.*``.

    Open the verifier and drafter streams *inside* it so their gRPC client spans (and, across
    processes, the server spans) join this trace.
    """
    with tracer.start_as_current_span(GENERATION_SPAN, kind=SpanKind.INTERNAL, attributes=_attrs(attributes)) as span:
        yield span


@contextlib.contextmanager
def block_span(
    tracer: trace.Tracer,
    seq: int,
    k: Optional[int] = None,
    **attributes: Any,
) -> Iterator[Span]:
    """A span around one round trip (draft → verify → commit) of a generation.

    Set the rest when known: ``span.set_attributes(block_attributes(accepted=.., bytes_up=..,
    bytes_down=..))``; the coordinator ends it with its BlockStats (coordinator/results.end_block_span).
    """
    with tracer.start_as_current_span(BLOCK_SPAN, attributes=_attrs({"block": int(seq), "k": k, **attributes})) as span:
        yield span


def block_attributes(**values: Any) -> Dict[str, Any]:
    """``block_attributes(accepted=3, bytes_up=812)`` -> ``{"steerspec.accepted": 3, ...}``."""
    return _attrs(values)


def traceparent(span: Span) -> str:
    """The W3C traceparent of `span`, to parent the remote side's per-block spans under it."""
    # lazy: OpenTelemetry only when tracing is on
    from opentelemetry.trace.propagation.tracecontext import (
        TraceContextTextMapPropagator,  # lazy: OpenTelemetry only when tracing is on
    )

    carrier: Dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def context_from_traceparent(value: str) -> Optional[otel_context.Context]:
    """The context a `traceparent` string names (None when empty: the current context is used)."""
    if not value:
        return None
    # lazy: OpenTelemetry only when tracing is on
    from opentelemetry.trace.propagation.tracecontext import (
        TraceContextTextMapPropagator,  # lazy: OpenTelemetry only when tracing is on
    )

    return TraceContextTextMapPropagator().extract({"traceparent": value})


def span_context() -> otel_context.Context:
    """The current context, to parent spans later from another task (e.g. the verifier batcher).

    Capture it in the stream handler (where the gRPC server span is current) and pass it as
    ``parent`` to record_span from the batching task.
    """
    return otel_context.get_current()


def record_span(
    tracer: trace.Tracer,
    name: str,
    start_ns: int,
    end_ns: int,
    parent: Optional[otel_context.Context] = None,
    **attributes: Any,
) -> None:
    """Create a finished span with explicit times (``time.time_ns()`` clock).

    For work measured elsewhere, e.g. in the verifier's batcher::

        record_span(tracer, VERIFIER_QUEUE_SPAN, enq_ns, batch_start_ns, parent=session_ctx, block=seq)
        record_span(tracer, VERIFIER_FORWARD_SPAN, batch_start_ns, done_ns, parent=session_ctx,
                    block=seq, batch_size=len(batch))
    """
    span = tracer.start_span(name, context=parent, start_time=int(start_ns), attributes=_attrs(attributes))
    span.end(end_time=max(int(end_ns), int(start_ns)))


def now_ns() -> int:
    """The clock record_span expects."""
    return time.time_ns()

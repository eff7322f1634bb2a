"""CoordinatorService.Generate (grpc.aio): tokenise, place, run the session loop, stream chunks, summarise.

Resuming: every Generate stream of a session streams the whole generation from its first token.
When `session_id` names a checkpointed session, the coordinator first replays the committed tokens
as one chunk, then continues from that prefix on whichever replicas are live (or, when the session
had finished, sends the summary). A client that already holds n tokens skips the first n, so a
retry after a lost connection neither loses nor repeats a token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Dict, Iterable, List, Optional, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace as otel_trace
from redis.exceptions import RedisError

from coordinator import counters
from coordinator.admission import Admission
from coordinator.loop import LoopConfig, SessionLoop, SessionRequest
from coordinator.model_check import CoordinatorModel, follow, stats_identity
from coordinator.placement import Placer, registered_identity
from coordinator.quotas import SessionQuota
from coordinator.request_clock import RequestClock
from coordinator.results import Chunk, DistributedResult
from coordinator.stops import StopText, check_stops
from coordinator.streams import Channels, SessionError
from steerspec.decoding.sampling import SamplingParams
from steerspec.errors import UsageError
from steerspec.observability import genai, service_metrics
from steerspec.observability.tracing import GENERATION_SPAN
from steerspec.serving import security
from steerspec.serving.grpc_common import start_server
from steerspec.serving.identity import ModelIdentity, tokenizer_fingerprint
from steerspec.serving.linkemu import NO_LINK, LinkModel
from steerspec.serving.ownership import ClaimError, Ownership
from steerspec.serving.store import InProcessStore, Store, keep_registered
from steerspec.sprinter.spec import VerificationError, parse_verification
from steerspec.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = "steerspec.v1.CoordinatorService"


class TextStream:
    """Incremental detokenisation (the prefix/read-offset scheme of vLLM and TGI).

    Each push returns the text the new tokens add, decoding only a short window; text is held
    back while the window ends inside a multi-byte character.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: List[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        self.ids.extend(int(t) for t in token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return new_text[len(prefix_text):]
        return ""

    @property
    def text(self) -> str:
        return "" if self.tokenizer is None else self._decode(self.ids)


class Coordinator:
    """Registry, placement, channels and the session loop config of one coordinator process."""

    def __init__(self, store: Optional[Store] = None, verifiers: Iterable[str] = (), drafters: Iterable[str] = (),
                 link: LinkModel = NO_LINK, tokenizer=None, eos_ids: Sequence[int] = (), metrics=None,
                 tracer=None, heartbeat_ttl_s: float = 5.0, defaults: Optional[Dict[str, object]] = None,
                 max_length: Optional[int] = None, allow_lossy: bool = False,
                 max_sessions_per_identity: int = 0, model: Optional[ModelIdentity] = None,
                 follow_verifier: bool = False) -> None:
        self.allow_lossy = bool(allow_lossy)  # serve lossy verification modes (SPRINTER) only when asked
        self.store = store if store is not None else InProcessStore()
        drafters = list(drafters)
        self.static = [("verifier", a) for a in verifiers] + [("drafter", a) for a in drafters]
        self.tokenizer = tokenizer
        self.admission = Admission(tokenizer, max_length)
        self.ownership = Ownership(self.store)
        self.quota = SessionQuota(max_sessions_per_identity)
        self.ttl_s = heartbeat_ttl_s
        self.defaults = dict(defaults or {})
        self.channels = Channels()
        if model is None and tokenizer is not None:  # a tokenizer given as an object: its content is its identity
            model = ModelIdentity(name=str(getattr(tokenizer, "name_or_path", "") or "tokenizer"),
                                  tokenizer=tokenizer_fingerprint(tokenizer))
        # no tokenizer yet: take the verifier's model at the first session (coordinator/model_check.py)
        self.follow_verifier = bool(follow_verifier) and tokenizer is None
        self.max_length_flag = max_length  # --max-length as given: checked against the verifier's context
        self._model_lock = asyncio.Lock()
        self.config = LoopConfig(placer=Placer(self.store, pinned={"drafter": drafters}), channels=self.channels,
                                 store=self.store, link=link.validate(), eos_ids=tuple(eos_ids), max_length=max_length,
                                 metrics=metrics, tracer=tracer, model=model)
        self._heartbeats: List[asyncio.Task] = []
        self.http = None  # the OpenAI-compatible HTTP API when served (coordinator.http_api.http_server.RunningHTTP)

    def adopt(self, model: CoordinatorModel) -> None:
        """Tokenise, stop and cap the context with `model` from now on (the verifier's, resolved here)."""
        self.tokenizer = model.tokenizer
        self.admission = Admission(model.tokenizer, model.max_length)
        self.config.model = model.identity
        self.config.eos_ids = tuple(model.eos_ids)
        self.config.max_length = model.max_length
        self.follow_verifier = False

    async def ensure_model(self) -> None:
        """Follow the verifier's model when start-up could not (no verifier answered then): FAILED_PRECONDITION
        when it does not resolve here or does not fit; UNAVAILABLE while no verifier answers."""
        if not self.follow_verifier:
            return
        async with self._model_lock:
            if not self.follow_verifier:
                return
            identity = None
            for endpoint in await self.config.placer.live("verifier"):
                identity = registered_identity(endpoint, self.config.identities) or await stats_identity(
                    self.channels, "verifier", endpoint.address)
                if identity is not None:
                    break
            if identity is None:
                raise SessionError(grpc.StatusCode.UNAVAILABLE,
                                   "no verifier has told this coordinator its model yet (none answers): start one, "
                                   "or start the coordinator with --tokenizer naming the verifier's model")
            try:
                self.adopt(await asyncio.to_thread(follow, identity, None, self.max_length_flag))
            except UsageError as exc:
                raise SessionError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
            log.info("following the verifier's model %s", identity.label())

    async def start(self) -> None:
        """Register the static replicas now and keep them registered while they pass a health check."""
        for kind, address in self.static:
            await self.store.register(kind, address, self.ttl_s)
            probe = self._health_probe(address, kind)
            self._heartbeats.append(asyncio.create_task(
                keep_registered(self.store, kind, address, self.ttl_s, probe=probe)))

    def _health_probe(self, address: str, kind: str):
        """A health check of a static replica that also learns what it serves (placement pairs by it)."""
        async def probe() -> bool:
            stub = health_pb2_grpc.HealthStub(self.channels.get(address))
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            except grpc.aio.AioRpcError:
                return False
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            if serving and address not in self.config.identities:
                identity = await stats_identity(self.channels, kind, address, timeout=1.0)
                if identity is not None:
                    self.config.identities[address] = identity
            return serving
        return probe

    async def stop(self) -> None:
        for task in self._heartbeats:
            task.cancel()
        for task in self._heartbeats:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._heartbeats.clear()
        await self.ownership.close()
        await self.store.close()
        await self.channels.close()

    # -- requests ---------------------------------------------------------------------------
    def session_request(self, request: coordinator_pb2.GenerateRequest,
                        prompt_ids: Optional[List[int]] = None) -> SessionRequest:
        """GenerateRequest -> validated SessionRequest (SessionError INVALID_ARGUMENT when bad);
        `prompt_ids`: the text prompt already tokenised (`Admission.prompt_ids`, off the event loop)."""
        if request.prompt and request.prompt_ids:
            raise SessionError(grpc.StatusCode.INVALID_ARGUMENT, "send either prompt (text) or prompt_ids, not both")
        if prompt_ids is None and request.prompt:
            if self.tokenizer is None:
                raise SessionError(grpc.StatusCode.INVALID_ARGUMENT,
                                   "this coordinator has no tokenizer: send prompt_ids instead of prompt text")
            prompt_ids = list(self.tokenizer(request.prompt, add_special_tokens=False)["input_ids"])
        elif prompt_ids is None:
            prompt_ids = list(request.prompt_ids)
        check_verification(request.verification, self.allow_lossy)
        try:
            stop = check_stops(request.stop)
        except ValueError as exc:
            raise SessionError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if stop and self.tokenizer is None:
            raise SessionError(grpc.StatusCode.INVALID_ARGUMENT,
                               "stop sequences need the coordinator's tokenizer: start it with --tokenizer, or send none")
        d = self.defaults
        s = request.sampling if request.HasField("sampling") else None
        sampling = SamplingParams(temperature=float(s.temperature) if s else 0.0, top_k=int(s.top_k) if s else 0,
                                  top_p=(float(s.top_p) or 1.0) if s else 1.0)
        return SessionRequest(
            prompt_ids=prompt_ids, max_new_tokens=int(request.max_new_tokens or d.get("max_new_tokens", 64)),
            sampling=sampling, seed=int(request.seed), k=int(request.k or d.get("k", 0)),
            draft_top_k=int(request.draft_top_k or d.get("draft_top_k", 64)),
            mode=request.mode or "speculative", policy=request.policy or str(d.get("policy", "")), steering=bool(request.steering),
            session_id=request.session_id, verification=request.verification or "exact", tree=request.tree,
            block_kind=request.block_kind, stop=stop, draft_ahead=request.draft_ahead or str(d.get("draft_ahead", "")),
            ahead_outcomes=int(request.ahead_outcomes or d.get("ahead_outcomes", 0)),
            ahead_budget_ms=float(request.ahead_budget_ms or d.get("ahead_budget_ms", 0.0))).validate()

    async def generate(self, request: SessionRequest, deadline: Optional[float] = None):
        """Async iterator of GenerateResponse for one session (resumes a checkpointed session_id)."""
        store = self.store
        record = await store.get_session(request.session_id) if request.session_id else None
        generated: List[int] = []
        if record is not None:
            if record.params.get("prompt_ids") != list(request.prompt_ids):
                raise SessionError(grpc.StatusCode.ALREADY_EXISTS,
                                   f"session {request.session_id} exists with a different prompt: "
                                   "use a new session_id")
            request = SessionRequest.from_params(request.session_id, record.params)
            generated = list(record.token_ids)
        else:
            await store.create_session(request.session_id, request.params(), {})
            if request.lossy and self.config.metrics is not None:
                self.config.metrics.observe_lossy_session(request.block_mode.verification.mode)
        text = StopText(TextStream(self.tokenizer), request.stop)
        if generated:
            kept, replayed, _ = text.push(generated)
            yield coordinator_pb2.GenerateResponse(chunk=coordinator_pb2.TokenChunk(
                seq=0, token_ids=kept, text=replayed, accepted=0, drafted=0))
        if record is not None and record.status == "done":
            result = DistributedResult(token_ids=generated, session_id=request.session_id,
                                       stop_reason=record.finish_reason or "length", verification=request.verification,
                                       prompt_tokens=len(request.prompt_ids))
            yield coordinator_pb2.GenerateResponse(summary=result.to_summary(_final_text(text)))
            return
        loop = SessionLoop(request, self.config, deadline=deadline, generated=generated,
                           resumes=1 if generated else 0)
        try:
            async with contextlib.aclosing(loop.run()) as chunks:
                async for chunk in chunks:
                    kept, delta, matched = text.push(chunk.token_ids)
                    chunk.token_ids = kept
                    yield coordinator_pb2.GenerateResponse(chunk=_chunk_proto(chunk, delta))
                    if matched:  # closing the loop ends the session on both services
                        break
        except SessionError as exc:
            await self._finish(request.session_id, "failed", exc.code.name)
            raise
        result = loop.result
        tail = "" if text.matched else text.flush()
        if tail:  # text held back (a possible stop's beginning, an unfinished character): the generation ended
            yield coordinator_pb2.GenerateResponse(chunk=coordinator_pb2.TokenChunk(seq=result.rounds, text=tail))
        if text.matched:
            result.stop_reason = "stop"
            del result.token_ids[len(text.stream.ids):]  # the block's tokens after the match are not the output
        await self._finish(request.session_id, "done", result.stop_reason)
        if self.config.metrics is not None:
            self.config.metrics.observe_generation(result.stop_reason)
        result.text = _final_text(text)
        yield coordinator_pb2.GenerateResponse(summary=result.to_summary(result.text))

    async def serve_session(self, session: SessionRequest, identity: str, deadline: Optional[float] = None,
                            operation: str = "text_completion"):
        """One caller's generation, as both APIs serve it: its span (GenAI conventions), the session's claim and
        the caller's quota around `generate`; SessionError for every refusal or failure (a claim's, the store's).
        `operation`: the GenAI operation name ("text_completion" | "chat")."""
        tracer = self.config.tracer
        span_cm = contextlib.nullcontext()
        if tracer is not None:
            span_cm = tracer.start_as_current_span(GENERATION_SPAN, attributes={
                "steerspec.session_id": session.session_id, "steerspec.mode": session.mode,
                "steerspec.k": session.k, "steerspec.max_new_tokens": session.max_new_tokens,
                "steerspec.verification": session.verification, "steerspec.lossy": session.lossy,
                **genai.request_attributes(operation, self.model_name, session)})
        with span_cm:
            span = otel_trace.get_current_span()  # ours, or the gRPC server span
            span_context = span.get_span_context()
            trace_id = f"{span_context.trace_id:032x}" if span_context.is_valid else ""
            claim = self.ownership.claim(session.session_id, identity) if session.session_id \
                else contextlib.nullcontext()
            clock = RequestClock(operation, self.model_name)
            try:
                with self.quota.hold(identity):
                    async with claim, contextlib.aclosing(self.generate(session, deadline)) as responses:
                        async for response in responses:
                            clock.tokens(len(response.chunk.token_ids) if response.HasField("chunk") else 0)
                            if response.HasField("summary"):
                                response.summary.trace_id = trace_id
                                _count_resumes(response.summary.resumes)
                                if tracer is not None:
                                    span.set_attributes(genai.response_attributes(response.summary, self.model_name))
                            yield response
            except ClaimError as exc:
                clock.error = exc.code.name
                raise SessionError(exc.code, exc.message) from None
            except RedisError as exc:
                log.warning("session %s: the store failed: %s", session.session_id, exc)
                clock.error = grpc.StatusCode.UNAVAILABLE.name
                raise SessionError(grpc.StatusCode.UNAVAILABLE,
                                   f"the session store (Redis) failed: {(str(exc).splitlines() or [''])[0]}; "
                                   "retry once it is back (the SDK retries UNAVAILABLE)") from None
            except SessionError as exc:
                clock.error = exc.code.name
                raise
            except BaseException:  # cancelled: the caller went away
                clock.error = clock.error or grpc.StatusCode.CANCELLED.name
                raise
            finally:
                if self.config.metrics is not None:
                    clock.observe(self.config.metrics)

    @property
    def model_name(self) -> str:
        """The served model's name (the verifier's, as its identity names it; "" until known)."""
        model = self.config.model
        return model.name if model is not None else ""

    async def _finish(self, session_id: str, status: str, reason: str) -> None:
        """Record the session's end; a session that went on without checkpoints is logged and counted."""
        try:
            written = await self.store.finish_session(session_id, status, reason)
        except RedisError as exc:
            log.warning("session %s: the store failed at its end: %s", session_id, (str(exc).splitlines() or [""])[0])
            written = False
        if not written:
            log.warning("session %s ended (%s) without complete checkpoints: the store (Redis) failed during it; "
                        "a resume starts from its last stored prefix", session_id, status)
            counters.count("steerspec_sessions_uncheckpointed")


def check_verification(spec: str, allow_lossy: bool) -> None:
    """GenerateRequest.verification: exact passes; a bad spec is INVALID_ARGUMENT; a lossy mode is
    FAILED_PRECONDITION unless this coordinator allows lossy output."""
    try:
        verification = parse_verification(spec)
    except VerificationError as exc:
        raise SessionError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
    if not verification.lossy:
        return
    if not allow_lossy:
        raise SessionError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"verification '{spec}' is lossy (its output is not the verifier's distribution) and "
                           "this coordinator serves exact decoding only: start it with `steerspec serve "
                           "coordinator --allow-lossy` to accept lossy requests, or send verification 'exact'")


def _final_text(text: StopText) -> str:
    """A generation's whole text: up to its stop sequence, else all its tokens decoded."""
    return text.text if text.matched else text.stream.text


def _chunk_proto(chunk: Chunk, text: str) -> coordinator_pb2.TokenChunk:
    return coordinator_pb2.TokenChunk(seq=chunk.seq, token_ids=chunk.token_ids, text=text,
                                      accepted=chunk.accepted, drafted=chunk.drafted)


def _count_resumes(resumes: int) -> None:
    """steerspec_resumes_total: failovers and checkpoint resumes of finished sessions."""
    metrics = service_metrics.current()
    if metrics is not None and resumes:
        metrics.resumes.labels(metrics.service).inc(resumes)


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """The public API over one `Coordinator`."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    async def Generate(self, request, context):
        try:
            await self.coordinator.ensure_model()
            session = self.coordinator.session_request(request, await self.coordinator.admission.prompt_ids(request))
        except SessionError as exc:
            await context.abort(exc.code, exc.message)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        try:
            async with contextlib.aclosing(self.coordinator.serve_session(
                    session, security.identity_of(context), deadline)) as responses:
                async for response in responses:
                    yield response
        except SessionError as exc:
            await context.abort(exc.code, exc.message)


async def serve(coordinator: Coordinator, host: str = "127.0.0.1", port: int = 0, http_port: Optional[int] = None,
                http_host: Optional[str] = None):
    """Start the coordinator's gRPC server (health + reflection), and with `http_port` its OpenAI-compatible HTTP
    API beside it (`coordinator.http`, stopped first on shutdown); returns the gRPC RunningServer."""
    await coordinator.start()
    running = await start_server(
        [(coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server, CoordinatorService(coordinator))],
        [SERVICE_NAME], host=host, port=port)
    running.on_stop.append(coordinator.stop)
    if http_port is not None:
        # lazy: FastAPI and uvicorn load only where the HTTP API is served
        from coordinator.http_api.http_server import start_http

        try:
            coordinator.http = await start_http(coordinator, host=http_host or host, port=http_port)
        except BaseException:
            await running.stop(grace=0)
            raise
        running.on_drain.append(coordinator.http.stop)
    return running

"""The round-trip loop of one session: drafter block → verifier → result → commit → stream → feedback.

    open Verify stream (VerifyOpen: prompt, sampling)      → VerifyReady (steering for block 1)
    open Draft stream  (DraftOpen: prompt, steering)       → DraftBlock
    repeat:  DraftBlock ─(emulated uplink)→ verifier       → VerifyResult ─(emulated downlink)→
             commit d_1..d_a + next token (checkpoint, fire-and-forget), feed the result back to the
             drafter (want_block=False on the last block), stream a chunk to the caller.

Autoregressive mode (and a session that lost its last drafter) sends 0-length blocks: one verifier
round trip per token over the same link; the verifier's next token of an empty block is its own
sampled token.

Failover: a replica that fails (UNAVAILABLE, or its stream ends without a status) is dropped from
the registry; a full one (RESOURCE_EXHAUSTED, at the open or in-stream) stays registered, as it is
alive, and only this session avoids it. The session is re-placed and both streams are reopened from
the committed prefix (prompt + generated so far), so caches agree and nothing is lost or repeated.
A lost drafter is replaced by another, or by verifier-only decoding when none is left.

When the store (Redis) fails under a running session, the session goes on without checkpoints
(placement from the registry's last listing, see coordinator.placement; the store stops writing
its tokens); the coordinator logs and counts it when the session ends.

Per block it records rtt_ms (verifier send → result, emulated link included), draft_ms (asking
the drafter → its block arriving: the local hop both ways (the feedback or open going out, the
block coming back) plus drafter compute and queueing; draft_compute_ms is the drafter's own compute
report), network_ms (emulated delay actually spent), queue_ms and verify_ms (the verifier's own
report), overhead_ms (the rest of the block's cycle, which runs from asking for the draft to the
result being committed: the verifier hop's gRPC and protobuf cost and the coordinator's own work)
and bytes_up / bytes_down (serialized sizes of the block and the result).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Dict, List, Optional, Sequence, Tuple

import grpc
from redis.exceptions import RedisError

from coordinator.placement import Placer, registered_identity
from coordinator.results import BlockStats, Chunk, DistributedResult, end_block_span
from coordinator.streams import Channels, ReplicaLost, SessionError, Stream, status_from_code
from steerspec.blocks.block_kind import BlockKind
from steerspec.blocks.block_mode import BlockMode, ModeError, default_fields, parse_mode
from steerspec.blocks.kinds import kind_of
from steerspec.decoding import rounds
from steerspec.decoding.sampling import SamplingParams
from steerspec.observability.tracing import BLOCK_SPAN, traceparent
from steerspec.policies.base import MAX_K
from steerspec.policies.registry import PolicyError
from steerspec.serving import wire
from steerspec.serving.identity import ModelIdentity, compatible, drafter_fix, mismatch_message, pair_differences
from steerspec.serving.linkemu import NO_LINK, LinkModel
from steerspec.serving.store import Endpoint, InProcessStore, Store
from steerspec.v1 import common_pb2, drafter_pb2, verifier_pb2

log = logging.getLogger(__name__)

MODES = ("speculative", "autoregressive")
MAX_NEW_TOKENS = 1 << 16
AHEAD_SETTINGS = ("", "on", "off")  # drafting ahead: "" = the drafter's default
MAX_AHEAD_OUTCOMES = 64


class ContextFull(Exception):
    """A replica has no room for another block (OUT_OF_RANGE): the session ends with "context"."""


def _stream_error(kind: str, address: str, error: common_pb2.StreamError) -> Exception:
    """A StreamError reply as an exception: OUT_OF_RANGE ends the generation at the context limit,
    RESOURCE_EXHAUSTED (the replica's memory is full) moves the session to another replica, anything
    else ends the session with that status code."""
    code = status_from_code(error.code)
    if code == grpc.StatusCode.OUT_OF_RANGE:
        return ContextFull(f"{kind} {address}: {error.message}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ReplicaLost(kind, address, f"full: {error.message}", full=True)
    return SessionError(code, f"{kind} {address}: {error.message}")


DEADLINE_SLACK_S = 0.05  # a replica error this close to the deadline is the deadline's


def deadline_reached(deadline: Optional[float], now: float) -> bool:
    """True at, past or within DEADLINE_SLACK_S of the generation's deadline: a replica's failure then is
    the deadline's (the one rule for session errors and lost replicas alike)."""
    return deadline is not None and now >= deadline - DEADLINE_SLACK_S


def deadline_error(exc: SessionError, deadline: Optional[float], now: float) -> SessionError:
    """`exc`, or DEADLINE_EXCEEDED when a replica's call ended INTERNAL or CANCELLED at the generation's
    deadline (`deadline_reached`): grpc reports a deadline that lands during a stream's write or read as
    "Internal error from Core" on a best-effort basis (grpc/grpc#2685), and the client asked for the deadline."""
    if exc.code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED) or not deadline_reached(deadline, now):
        return exc
    return SessionError(grpc.StatusCode.DEADLINE_EXCEEDED, f"the generation's deadline passed ({exc.message})")


def lost_to_deadline(lost: ReplicaLost, deadline: Optional[float], now: float) -> Optional[SessionError]:
    """DEADLINE_EXCEEDED for a replica lost at the generation's deadline (`deadline_reached`), else None (fail
    over). A stream the deadline broke mid-write can end in grpc core's own INTERNAL, which streams.py counts as
    a lost replica; at the deadline it is the deadline's, and the healthy replica must not be marked failed."""
    if not deadline_reached(deadline, now):
        return None
    return SessionError(grpc.StatusCode.DEADLINE_EXCEEDED, f"the generation's deadline passed ({lost})")


def _invalid(message: str) -> SessionError:
    return SessionError(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass
class SessionRequest:
    """What one generation asks for (the GenerateRequest, tokenised)."""

    prompt_ids: List[int]
    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    seed: int = 0
    k: int = 4
    draft_top_k: int = 64
    mode: str = "speculative"
    policy: str = "fixed"
    steering: bool = False
    session_id: str = ""
    verification: str = "exact"  # "block" (exact), or "sprinter[:...]" (lossy; admitted only with --allow-lossy)
    tree: str = ""  # a static draft tree's rank paths instead of k ("": chains; steerspec/decoding/trees.py)
    block_kind: str = ""  # a block kind registered outside the bundled ones, by name (steerspec/blocks/)
    stop: Tuple[str, ...] = ()  # stop sequences, applied to the text by the coordinator (coordinator/stops.py)
    draft_ahead: str = ""  # "on" | "off" | "" (the drafter's default): drafting ahead (drafter_service/ahead.py)
    ahead_outcomes: int = 0  # verdicts prepared per block (0: the drafter's default)
    ahead_budget_ms: float = 0.0  # drafter time preparing per block (0: the drafter's default; < 0: no limit)

    _mode: Optional[BlockMode] = field(default=None, init=False, repr=False, compare=False)

    @property
    def block_mode(self) -> BlockMode:
        """The request's mode (kind, verification rule, policy, block limit), parsed once from its fields by
        `blocks.block_mode.parse_mode`; SessionError INVALID_ARGUMENT naming the bad field."""
        if self._mode is None:
            try:
                self._mode = parse_mode(speculative=self.mode == "speculative", k=self.k, tree=self.tree,
                                        verification=self.verification, policy=self.policy,
                                        block_kind=self.block_kind)
            except ModeError as exc:
                raise _invalid(str(exc)) from None
        return self._mode

    @property
    def lossy(self) -> bool:
        return self.block_mode.lossy

    @property
    def block_limit(self) -> int:
        """Most draft tokens per block, what both services are opened with (`BlockMode.block_limit`)."""
        return self.block_mode.block_limit

    def validate(self) -> "SessionRequest":
        """Check every field (SessionError INVALID_ARGUMENT naming the bad one), normalise the mode's fields to
        their canonical specs; assign a session id."""
        if not self.prompt_ids:
            raise _invalid("the prompt is empty: send a non-empty prompt or prompt_ids")
        if any(int(t) < 0 for t in self.prompt_ids):
            raise _invalid("prompt_ids must be non-negative token ids")
        if not (1 <= self.max_new_tokens <= MAX_NEW_TOKENS):
            raise _invalid(f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}], got {self.max_new_tokens}")
        if self.mode not in MODES:
            raise _invalid(f"unknown mode '{self.mode}': use one of {', '.join(MODES)}")
        self.tree, self.policy, self.k = default_fields(speculative=self.mode == "speculative", k=self.k,
                                                        tree=self.tree, policy=self.policy,
                                                        verification=self.verification, block_kind=self.block_kind)
        if self.mode == "speculative" and not (1 <= self.k <= MAX_K):
            raise _invalid(f"k must be in [1, {MAX_K}], got {self.k}")
        self.draft_ahead = (self.draft_ahead or "").strip().lower()
        if self.draft_ahead not in AHEAD_SETTINGS:
            raise _invalid(f"draft_ahead must be 'on', 'off' or empty (the drafter's default), got {self.draft_ahead!r}")
        if not 0 <= self.ahead_outcomes <= MAX_AHEAD_OUTCOMES:
            raise _invalid(f"ahead_outcomes must be in [0, {MAX_AHEAD_OUTCOMES}] (0 = the drafter's default), "
                           f"got {self.ahead_outcomes}")
        if self.draft_top_k < 0:
            raise _invalid(f"draft_top_k must be >= 0 (0 = full vocabulary), got {self.draft_top_k}")
        try:
            self.sampling.validate()
        except ValueError as exc:
            raise _invalid(str(exc)) from None
        self._mode = None  # parsed from the fields as they are now
        mode = self.block_mode
        try:
            limit = mode.block_limit
        except PolicyError as exc:
            raise _invalid(str(exc)) from None
        if mode.speculative and not (1 <= limit <= MAX_K):
            raise _invalid(f"policy {self.policy}: a block of up to {limit} draft tokens is outside [1, {MAX_K}]; "
                           "lower its k/max/gmax")
        self.tree, self.verification, self.policy, self.k = mode.tree_spec, mode.verification.spec(), mode.policy, \
            mode.k
        self.block_kind = mode.custom
        if not self.session_id:
            self.session_id = uuid.uuid4().hex
        return self

    def params(self) -> Dict[str, object]:
        """JSON-ready record of the request (the session's checkpointed parameters)."""
        return {"prompt_ids": [int(t) for t in self.prompt_ids], "max_new_tokens": self.max_new_tokens,
                "temperature": self.sampling.temperature, "top_k": self.sampling.top_k,
                "top_p": self.sampling.top_p, "seed": self.seed, "k": self.k, "draft_top_k": self.draft_top_k,
                "mode": self.mode, "policy": self.policy, "steering": self.steering,
                "verification": self.verification, "tree": self.tree, "block_kind": self.block_kind,
                "stop": list(self.stop), "draft_ahead": self.draft_ahead, "ahead_outcomes": self.ahead_outcomes,
                "ahead_budget_ms": self.ahead_budget_ms}

    @classmethod
    def from_params(cls, session_id: str, p: Dict[str, object]) -> "SessionRequest":
        return cls(prompt_ids=list(p["prompt_ids"]), max_new_tokens=int(p["max_new_tokens"]),
                   sampling=SamplingParams(float(p["temperature"]), int(p["top_k"]), float(p["top_p"])),
                   seed=int(p["seed"]), k=int(p["k"]), draft_top_k=int(p["draft_top_k"]), mode=str(p["mode"]),
                   policy=str(p["policy"]), steering=bool(p["steering"]), session_id=session_id,
                   verification=str(p.get("verification", "exact")), tree=str(p.get("tree", "")),
                   block_kind=str(p.get("block_kind", "")), stop=tuple(str(x) for x in p.get("stop", ()) or ()),
                   draft_ahead=str(p.get("draft_ahead", "")), ahead_outcomes=int(p.get("ahead_outcomes", 0)),
                   ahead_budget_ms=float(p.get("ahead_budget_ms", 0.0)))

    def sampling_proto(self) -> common_pb2.SamplingParams:
        s = self.sampling
        return common_pb2.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)


@dataclass
class LoopConfig:
    """What a coordinator gives every session loop."""

    placer: Placer
    channels: Channels
    store: Store = field(default_factory=InProcessStore)
    link: LinkModel = NO_LINK
    eos_ids: Sequence[int] = ()
    max_length: Optional[int] = None  # context limit: prompt + generated never exceeds it (None: the replicas')
    max_resumes: int = 4  # replica failures one session survives
    metrics: object = None  # steerspec.observability.prometheus.SteerSpecMetrics or None
    tracer: object = None  # an OpenTelemetry tracer or None
    model: Optional[ModelIdentity] = None  # the coordinator's tokenizer: verifiers refuse sessions it does not fit
    identities: Dict[str, ModelIdentity] = field(default_factory=dict)  # address -> what it serves (GetStats)


class SessionLoop:
    """Drive one session; iterate `run()` for chunks, then read `result`."""

    def __init__(self, request: SessionRequest, config: LoopConfig, deadline: Optional[float] = None,
                 generated: Sequence[int] = (), resumes: int = 0) -> None:
        self.req = request
        self.cfg = config
        self.deadline = deadline  # time.monotonic() value, or None
        self.prompt = [int(t) for t in request.prompt_ids]
        self.generated: List[int] = [int(t) for t in generated]
        self.result = DistributedResult(token_ids=self.generated, mode=request.mode,
                                        prompt_tokens=len(self.prompt), session_id=request.session_id,
                                        resumes=resumes, restored=len(self.generated),
                                        verification=request.verification)
        self.mode = request.block_mode  # what the session decodes with; the verifier alone once no drafter is left
        self.result.sprinter = self.kind.tally(self.mode)  # SPRINTER: the verifier's labels of every run
        self.link = config.link.link(request.session_id)
        self.verifier: Optional[Stream] = None
        self.drafter: Optional[Stream] = None
        self.steering: Optional[common_pb2.Tensor] = None
        self.verifier_model: Optional[ModelIdentity] = None  # what the open verifier serves (its VerifyReady)
        self.verify_seq = 0  # seq of the next block on the current verifier stream
        self.failed: Dict[str, set] = {"verifier": set(), "drafter": set()}
        self._placed: List[tuple] = []
        self._drafter_ok = False  # the drafter stream is in step with the committed prefix
        self._draft_asked = 0.0  # when the drafter was last asked for a block (open or feedback)
        self._block_span = None  # the span of the block asked for last (tracing on only)
        self.policy_state = ""  # the drafter policy's last reported state (JSON): a reopened drafter resumes it

    # -- helpers ----------------------------------------------------------------------------
    @property
    def kind(self) -> BlockKind:
        """The session's block kind now (steerspec/blocks/): how its blocks are cut, committed and tallied."""
        return kind_of(self.mode)

    @property
    def use_drafter(self) -> bool:
        return self.mode.speculative

    @property
    def committed(self) -> List[int]:
        return self.prompt + self.generated

    @property
    def committed_length(self) -> int:
        return len(self.prompt) + len(self.generated)

    @property
    def remaining(self) -> int:
        return self.req.max_new_tokens - len(self.generated)

    @property
    def room(self) -> int:
        """Tokens the session may still commit: its budget, capped by the context limit."""
        return rounds.room(self.remaining, self.committed_length, self.cfg.max_length)

    def _stream_seed(self) -> int:
        """The seed for (re)opened streams: the request's, or for a resumed session one derived from it
        and the committed length, so random draws after a failover are fresh rather than replayed."""
        seed = int(self.req.seed)
        if self.generated:
            seed = rounds.resumed_seed(seed, self.committed_length)
        if self.req.mode == "autoregressive":
            seed = rounds.autoregressive_stream_seed(seed)  # verifier-only decoding samples with the seed itself
        return seed

    def _timeout(self) -> Optional[float]:
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise SessionError(grpc.StatusCode.DEADLINE_EXCEEDED, "the generation's deadline passed")
        return left

    def _identity(self, endpoint: Endpoint) -> Optional[ModelIdentity]:
        return registered_identity(endpoint, self.cfg.identities)

    def _fits(self, kind: str, endpoint: Endpoint) -> bool:
        """Whether the replica's model pairs with the session's (an unknown one is checked at its open)."""
        if kind == "verifier":
            return compatible(self._identity(endpoint), self.cfg.model, "coordinator")
        return compatible(self.verifier_model, self._identity(endpoint), "drafter", steering=self.req.steering)

    async def _no_fit(self, kind: str) -> Optional[SessionError]:
        """FAILED_PRECONDITION naming both models when live replicas of `kind` exist but none pairs."""
        live = [e for e in await self.cfg.placer.live(kind) if e.address not in self.failed[kind]]
        for endpoint in live:
            other = self._identity(endpoint)
            if kind == "verifier" and other is not None and self.cfg.model is not None:
                return SessionError(grpc.StatusCode.FAILED_PRECONDITION, mismatch_message(
                    other, self.cfg.model, "coordinator", ["no live verifier serves the coordinator's tokenizer"],
                    f"Restart the coordinator without --tokenizer to follow verifier {endpoint.address}"))
            if kind == "drafter" and other is not None and self.verifier_model is not None:
                differences = pair_differences(self.verifier_model, other, steering=self.req.steering)
                message = mismatch_message(self.verifier_model, other, "drafter", differences, drafter_fix(differences))
                return SessionError(grpc.StatusCode.FAILED_PRECONDITION, f"drafter {endpoint.address}: {message}")
        return None

    async def _place(self, kind: str) -> Optional[str]:
        address = await self.cfg.placer.choose(kind, exclude=self.failed[kind],
                                               fits=lambda endpoint: self._fits(kind, endpoint))
        if address is None:
            refused = await self._no_fit(kind)
            if refused is not None:
                raise refused
        if address is not None:
            self.cfg.placer.acquire(kind, address)
            self._placed.append((kind, address))
        return address

    def _unplace(self, kind: str, address: str) -> None:
        if (kind, address) in self._placed:
            self._placed.remove((kind, address))
            self.cfg.placer.release(kind, address)

    async def _replica_lost(self, lost: ReplicaLost) -> None:
        ended = lost_to_deadline(lost, self.deadline, time.monotonic())
        if ended is not None:  # at the deadline, a failure is the deadline's, not the replica's
            raise ended
        log.warning("session %s: lost %s", self.req.session_id, lost)
        self.failed[lost.kind].add(lost.address)  # this session tries it no more
        self._unplace(lost.kind, lost.address)
        if not lost.full:  # a full replica is alive: it stays registered for other sessions
            await self.cfg.placer.mark_failed(lost.kind, lost.address)
        self._count_resume()

    async def _checkpoint_placement(self) -> None:
        """Record where the session runs; when the store fails, the session goes on without checkpoints."""
        store = self.cfg.store
        if store.checkpoint_lost(self.req.session_id):
            return
        placement = {"verifier": self.verifier.address if self.verifier else "",
                     "drafter": self.drafter.address if (self.drafter and self.use_drafter) else ""}
        try:
            await store.set_placement(self.req.session_id, placement)
        except RedisError as exc:
            log.warning("session %s: the store failed (%s): going on without checkpoints", self.req.session_id,
                        (str(exc).splitlines() or [""])[0])
            store.mark_lost(self.req.session_id)

    # -- streams ----------------------------------------------------------------------------
    async def _open_verifier(self) -> None:
        while True:
            address = await self._place("verifier")
            if address is None:
                raise SessionError(grpc.StatusCode.UNAVAILABLE,
                                   "no live verifier replica: start one with `steerspec serve verifier --port ...` "
                                   "and pass it to the coordinator with --verifier HOST:PORT (or start both "
                                   "with the same --redis-url)")
            call = self.cfg.channels.verifier(address).Verify(timeout=self._timeout())
            stream = Stream("verifier", address, call)
            opening = verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(
                session_id=self.req.session_id, prompt_ids=self.committed, sampling=self.req.sampling_proto(),
                seed=self._stream_seed(), max_k=self.mode.block_limit, steering=self.req.steering,
                verification=self.mode.verification.spec(), tree=self.mode.tree_spec, block_kind=self.mode.custom))
            if self.cfg.model is not None:
                opening.open.client_model.CopyFrom(wire.identity_to_proto(self.cfg.model))
            try:
                await self.link.up(opening.ByteSize())  # the open crosses the emulated link too
                await stream.write(opening)
                reply = await stream.read()
                await self.link.down(reply.ByteSize())
            except ReplicaLost as lost:
                stream.abort()
                await self._replica_lost(lost)
                continue
            except BaseException:
                stream.abort()
                raise
            kind = reply.WhichOneof("kind")
            if kind == "error":
                stream.abort()
                raise SessionError(status_from_code(reply.error.code), f"verifier: {reply.error.message}")
            if kind != "ready":
                stream.abort()
                raise SessionError(grpc.StatusCode.INTERNAL, f"verifier {address} answered the open with '{kind}'")
            self.verifier = stream
            self.verifier_model = wire.identity_from_proto(reply.ready.model) if reply.ready.HasField("model") else None
            self.verify_seq = 0
            self.steering = reply.ready.steering if reply.ready.HasField("steering") else None
            return

    async def _open_drafter(self) -> None:
        """(Re)open the drafter from the committed prefix; verifier-only decoding when none is left."""
        if self.drafter is not None:
            self.drafter.abort()
            self._unplace("drafter", self.drafter.address)
            self.drafter = None
        self._drafter_ok = False
        while self.use_drafter:
            address = await self._place("drafter")
            if address is None:
                log.warning("session %s: no drafter left, continuing verifier-only", self.req.session_id)
                self.mode = self.mode.alone()
                if self.verifier is not None:
                    await self._checkpoint_placement()
                return
            call = self.cfg.channels.drafter(address).Draft(timeout=self._timeout())
            stream = Stream("drafter", address, call)
            opening = drafter_pb2.DraftOpen(
                session_id=self.req.session_id, prompt_ids=self.committed, sampling=self.req.sampling_proto(),
                seed=self._stream_seed(), k=self.mode.block_limit, draft_top_k=self.req.draft_top_k,
                policy=self.mode.policy, max_new_tokens=self.remaining, policy_state=self.policy_state,
                traceparent=self._begin_block_span(), verification=self.mode.verification.spec(),
                tree=self.mode.tree_spec, block_kind=self.mode.custom, draft_ahead=self.req.draft_ahead,
                ahead_outcomes=self.req.ahead_outcomes, ahead_budget_ms=self.req.ahead_budget_ms)
            if self.steering is not None:
                opening.steering.CopyFrom(self.steering)
            if self.verifier_model is not None:
                opening.verifier.CopyFrom(wire.identity_to_proto(self.verifier_model))
            try:
                self._draft_asked = time.perf_counter()
                await stream.write(drafter_pb2.DraftRequest(open=opening))
            except ReplicaLost as lost:
                stream.abort()
                await self._replica_lost(lost)
                continue
            self.drafter = stream
            self._drafter_ok = True
            if self.verifier is not None and self.result.resumes:
                await self._checkpoint_placement()  # re-placed after a failure
            return

    async def _next_block(self) -> Tuple[common_pb2.DraftBlock, float]:
        """The next block to verify and when it was asked for: the drafter's (asked when the open or
        the last feedback went out), or a 0-length block (verifier-only; asked now)."""
        while self.use_drafter:
            if not self._drafter_ok:
                await self._open_drafter()
                continue
            try:
                reply = await self.drafter.read()
            except ReplicaLost as lost:
                await self._replica_lost(lost)
                await self._open_drafter()
                continue
            kind = reply.WhichOneof("kind")
            if kind == "error":
                error = _stream_error("drafter", self.drafter.address, reply.error)
                if not isinstance(error, ReplicaLost):
                    raise error
                await self._replica_lost(error)  # a full drafter: draft elsewhere from the committed prefix
                await self._open_drafter()
                continue
            block = reply.block
            if block.policy_state:
                self.policy_state = block.policy_state
                block.ClearField("policy_state")  # the drafter's business: not forwarded to the verifier
            if block.committed_length != self.committed_length:
                raise SessionError(grpc.StatusCode.INTERNAL,
                                   f"drafter {self.drafter.address} drafted from {block.committed_length} committed "
                                   f"tokens, the session has {self.committed_length}")
            return block, self._draft_asked
        return common_pb2.DraftBlock(committed_length=self.committed_length), time.perf_counter()

    async def _verify(self, block: common_pb2.DraftBlock):
        """One round trip on the verifier stream over the emulated link -> (result, timings)."""
        request = verifier_pb2.VerifyRequest(block=block)  # a copy: the drafter's own seq stays on `block`
        request.block.seq = self.verify_seq
        bytes_up = request.ByteSize()
        start = time.perf_counter()
        network = await self.link.up(bytes_up)
        await self.verifier.write(request)
        reply = await self.verifier.read()
        bytes_down = reply.ByteSize()
        network += await self.link.down(bytes_down)
        rtt_ms = (time.perf_counter() - start) * 1000.0
        kind = reply.WhichOneof("kind")
        if kind == "error":
            raise _stream_error("verifier", self.verifier.address, reply.error)
        if kind != "result":
            raise SessionError(grpc.StatusCode.INTERNAL, f"verifier answered a block with '{kind}'")
        result = reply.result
        self.verify_seq += 1
        return result, rtt_ms, network * 1000.0, bytes_up, bytes_down

    def _count_resume(self) -> None:
        self.result.resumes += 1
        if self.result.resumes > self.cfg.max_resumes:
            raise SessionError(grpc.StatusCode.UNAVAILABLE,
                               f"gave up after {self.cfg.max_resumes} replica failures in one session")

    async def _failover_verifier(self, lost: ReplicaLost) -> None:
        if self.verifier is not None:
            self.verifier.abort()
        self.verifier = None
        await self._replica_lost(lost)
        await self._open_verifier()
        if self.use_drafter:
            await self._open_drafter()  # its cache holds uncommitted drafts: start it over from the prefix
        await self._checkpoint_placement()

    # -- the loop ---------------------------------------------------------------------------
    async def run(self) -> AsyncIterator[Chunk]:
        start = time.perf_counter()
        store = self.cfg.store
        try:
            await self._open_verifier()
            if self.use_drafter:
                await self._open_drafter()
            await self._checkpoint_placement()
            finish = "length" if self.remaining <= 0 else ("context" if self.room <= 0 else "")
            while not finish:
                try:
                    block, cycle_start = await self._next_block()
                    span = self._take_block_span()
                    if span is not None:
                        block.traceparent = traceparent(span)  # the verifier's spans become its children
                    kind = self.kind
                    kind.cut(self.mode, block, kind.room(self.mode, self.room))  # at most room tokens committed
                    kept, finish = self._commit_early(block)
                    if kept:  # SPRINTER: the classifier's tokens reach the client before the verifier call
                        yield Chunk(seq=self.result.rounds, token_ids=kept, accepted=len(kept), drafted=len(kept))
                    if finish:  # an EOS among them: no verifier call
                        kind.count(self.result.sprinter, block, None)  # the run counts; its tokens go unlabelled
                        if span is not None:
                            span.end()
                        break
                    draft_wait_ms = (time.perf_counter() - cycle_start) * 1000.0
                    result, rtt_ms, network_ms, bytes_up, bytes_down = await self._verify(block)
                except ReplicaLost as lost:
                    if lost.kind != "verifier":
                        raise
                    await self._failover_verifier(lost)
                    continue
                except ContextFull as full:
                    log.info("session %s: %s", self.req.session_id, full)
                    finish = "context"
                    break
                drafted = len(block.draft_ids)
                accepted = int(result.accepted)
                n_kept = len(kept)
                kind.count(self.result.sprinter, block, result)
                if not n_kept <= accepted <= drafted or \
                        result.committed_length != self.committed_length - n_kept + accepted + 1:
                    raise SessionError(grpc.StatusCode.INTERNAL,
                                       f"verifier result does not match the block (accepted {accepted} of {drafted}, "
                                       f"{n_kept} kept, committed_length {result.committed_length})")
                drafts = self._accepted_drafts(kind, block, result)
                new, stop = rounds.commit_block(drafts[n_kept:], accepted - n_kept, result.next_token,
                                                self.room, self.remaining, self.cfg.eos_ids)
                finish = stop or ""
                self.generated.extend(new)
                if result.HasField("steering"):
                    self.steering = result.steering
                store.append_tokens(self.req.session_id, new)
                committed_at = time.perf_counter()  # the block's cycle ends; asking for the next one starts
                if self.use_drafter and self._drafter_ok:
                    result.seq = block.seq  # hand the drafter back its own numbering
                    self._draft_asked = committed_at
                    try:
                        await self.drafter.write(drafter_pb2.DraftRequest(
                            feedback=drafter_pb2.DraftFeedback(
                                result=result, want_block=not finish, draft_ms=draft_wait_ms, network_ms=network_ms,
                                traceparent="" if finish else self._begin_block_span())))
                    except ReplicaLost as lost:
                        await self._replica_lost(lost)
                        self._drafter_ok = False  # reopened from the committed prefix before the next block
                stats = BlockStats(
                    seq=self.result.rounds, drafted=drafted, accepted=accepted, committed=n_kept + len(new),
                    rtt_ms=rtt_ms,
                    draft_ms=draft_wait_ms, draft_compute_ms=float(block.draft_ms), network_ms=network_ms, queue_ms=float(result.queue_ms),
                    verify_ms=float(result.verify_ms), cycle_ms=(committed_at - cycle_start) * 1000.0,
                    bytes_up=bytes_up, bytes_down=bytes_down, batch_size=int(result.batch_size),
                    verifier=self.verifier.address, ahead=bool(block.ahead), ahead_hit=bool(block.ahead_hit),
                    ahead_prepared=int(block.ahead_prepared), ahead_ms=float(block.ahead_ms))
                self._record(stats, span)
                yield Chunk(seq=stats.seq, token_ids=new, accepted=accepted - n_kept, drafted=drafted - n_kept)
            self.result.stop_reason = finish
        except SessionError as exc:
            mapped = deadline_error(exc, self.deadline, time.monotonic())
            if mapped is exc:
                raise
            raise mapped from exc
        finally:
            self.result.wall_s = time.perf_counter() - start
            await self._close_streams()
            for kind, address in list(self._placed):
                self._unplace(kind, address)

    def _accepted_drafts(self, kind: BlockKind, block: common_pb2.DraftBlock,
                         result: common_pb2.VerifyResult) -> List[int]:
        """The block's drafts in commit order (`BlockKind.accepted_drafts`: a chain's own, a tree's path)."""
        try:
            return kind.accepted_drafts(self.mode, block, result)
        except wire.ProtocolError as exc:
            raise SessionError(grpc.StatusCode.INTERNAL, f"verifier {self.verifier.address}: {exc.message}") from None

    def _commit_early(self, block: common_pb2.DraftBlock) -> Tuple[List[int], str]:
        """Commit the drafts the kind commits before its verifier call (SPRINTER's kept tokens; the run's last
        token is always verified) -> (tokens committed, finish reason or "")."""
        early = self.kind.commit_early(block)
        if not early:
            return [], ""
        new, stop = rounds.commit_tokens(block.draft_ids[:early], self.room, self.remaining, self.cfg.eos_ids)
        self.generated.extend(new)
        self.cfg.store.append_tokens(self.req.session_id, new)
        return new, stop or ""

    def _begin_block_span(self) -> str:
        """Start the span of the block being asked for now; its traceparent for the drafter ("" untraced)."""
        if self.cfg.tracer is None:
            return ""

        self._block_span = self.cfg.tracer.start_span(BLOCK_SPAN)
        return traceparent(self._block_span)

    def _take_block_span(self):
        """The span of the block about to be verified (started now for a verifier-only block)."""
        span, self._block_span = self._block_span, None
        if span is None and self.cfg.tracer is not None:
            self._begin_block_span()
            span, self._block_span = self._block_span, None
        return span

    def _record(self, stats: BlockStats, span=None) -> None:
        rounds.record_block(self.result, stats)
        self.result.blocks.append(stats)
        metrics = self.cfg.metrics
        if metrics is not None:
            metrics.observe_block(stats)
        if span is not None:
            end_block_span(span, stats)

    async def _close_streams(self) -> None:
        """End both streams (cancel when unwinding from an error or a cancellation)."""
        streams = [s for s in (self.drafter, self.verifier) if s is not None]
        self.drafter = self.verifier = None
        failing = asyncio.current_task() is not None and asyncio.current_task().cancelling()
        closes = []
        for stream in streams:
            if failing:
                stream.abort()
            elif stream.kind == "drafter":
                closes.append(stream.close(drafter_pb2.DraftRequest(close=drafter_pb2.DraftClose(reason="done"))))
            else:
                closes.append(stream.close(verifier_pb2.VerifyRequest(close=verifier_pb2.VerifyClose(reason="done"))))
        if closes:
            try:
                await asyncio.gather(*closes)
            except BaseException:
                for stream in streams:
                    stream.abort()
                raise



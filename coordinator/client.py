"""Client SDK for the coordinator's public API (exported as `steerspec.Client`).

    from steerspec import Client

    with Client("127.0.0.1:50051") as client:
        for item in client.generate("def fibonacci(n):", max_new_tokens=64, timeout=30):
            if isinstance(item, Chunk):
                print(item.text, end="", flush=True)
            else:                      # the final Summary
                print(item.block_efficiency, item.tokens_per_s)
        text = client.generate_text("import os", max_new_tokens=32)

    async for item in client.agenerate("class Queue:"): ...

Deadlines: `timeout=` seconds for the whole generation (DEADLINE_EXCEEDED past it); the
coordinator ends the session on every service when the deadline passes or the call is cancelled.

Retries: on UNAVAILABLE (and ABORTED: the session is live in another call) the call is retried with exponential backoff (`retries`, `backoff_s`).
Every call carries a session id (generated when not given); a retry after tokens have arrived
asks the coordinator to resume that session, which streams the generation from its first token
again; the client skips what it already yielded and checks that the replayed prefix matches, so
no token is lost or repeated.

Errors: every call (sync and asyncio, streaming or not) raises a `steerspec.SteerSpecError`
subclass for a failed call (`coordinator.exceptions`: InvalidArgument, FailedPrecondition, Unavailable once
the retries are exhausted, ...), raised from grpc's own error; they are `grpc.RpcError`s with
`code()`/`details()`, so `except grpc.RpcError` keeps working. Arguments rejected here before any call
are plain ValueErrors.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Dict, Iterator, List, Optional, Sequence, Union

import grpc

from coordinator.exceptions import MissingSummary, ResumeMismatch, SteerSpecError, from_rpc_error

if TYPE_CHECKING:
    from steerspec.serving.security import ClientSecurity
from steerspec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)  # ABORTED: the session is live elsewhere


@dataclass
class Chunk:
    """Tokens committed by one verifier round trip."""

    seq: int
    token_ids: List[int]
    text: str
    accepted: int
    drafted: int


@dataclass
class Summary:
    """The final message of a generation: its tokens, text and DESIGN.md metrics."""

    session_id: str
    token_ids: List[int]
    text: str
    rounds: int
    drafted: int
    accepted: int
    block_efficiency: float
    acceptance_rate: float
    accepted_per_position: List[float]
    tokens_per_s: float
    rtt_ms: float
    bytes_up: float
    bytes_down: float
    stage_ms: Dict[str, float]
    wall_s: float
    finish_reason: str
    resumes: int
    trace_id: str
    retries: int = 0  # client-side reconnects of this call
    lossy: bool = False  # lossy verification (sprinter): not the verifier's distribution
    verification: str = "exact"
    draft_compute_ms: float = 0.0  # mean per block: the drafter's own compute
    batch_size: float = 0.0  # mean per block: blocks in the verifier's forward pass
    # lossy sessions: measured eta_tp/eta_fp, Theorem 1's tv_bound beside the measured deviation (tv_measured),
    # mean vs Theorem 2's expected run length
    sprinter: Optional[Dict[str, float]] = None
    block_drafted: List[int] = field(default_factory=list)  # per verified block: draft tokens proposed
    block_accepted: List[int] = field(default_factory=list)  # per verified block: draft tokens accepted
    prompt_tokens: int = 0
    # drafting ahead: blocks after a block drafted ahead for, those prepared for their verdict, and per such block
    # the verdicts prepared and the drafter time that took (draft_compute_ms is then what was left on the critical path)
    ahead_blocks: int = 0
    ahead_hits: int = 0
    ahead_prepared: float = 0.0
    ahead_ms: float = 0.0

    @property
    def ahead_hit_rate(self) -> float:
        return self.ahead_hits / self.ahead_blocks if self.ahead_blocks else 0.0

    @classmethod
    def from_proto(cls, msg: coordinator_pb2.GenerationSummary, retries: int = 0) -> "Summary":
        s = msg.stage_ms
        return cls(session_id=msg.session_id, token_ids=list(msg.token_ids), text=msg.text, rounds=msg.rounds,
                   drafted=msg.drafted, accepted=msg.accepted, block_efficiency=msg.block_efficiency,
                   acceptance_rate=msg.acceptance_rate, accepted_per_position=list(msg.accepted_per_position),
                   tokens_per_s=msg.tokens_per_s, rtt_ms=msg.rtt_ms, bytes_up=msg.bytes_up,
                   bytes_down=msg.bytes_down,
                   stage_ms={"draft": s.draft_ms, "network": s.network_ms, "queue": s.queue_ms,
                             "verify": s.verify_ms, "overhead": s.overhead_ms},
                   wall_s=msg.wall_s, finish_reason=msg.finish_reason, resumes=msg.resumes, trace_id=msg.trace_id,
                   retries=retries, lossy=msg.lossy, verification=msg.verification or "exact",
                   draft_compute_ms=msg.draft_compute_ms, batch_size=msg.batch_size,
                   sprinter=_sprinter_theory(msg), block_drafted=list(msg.block_drafted),
                   block_accepted=list(msg.block_accepted), prompt_tokens=msg.prompt_tokens,
                   ahead_blocks=msg.ahead_blocks, ahead_hits=msg.ahead_hits, ahead_prepared=msg.ahead_prepared,
                   ahead_ms=msg.ahead_ms)


def _sprinter_theory(msg: coordinator_pb2.GenerationSummary) -> Optional[Dict[str, float]]:
    """GenerationSummary.sprinter as in-process SPRINTER's `theory()` dict (None for exact sessions)."""
    if not msg.HasField("sprinter"):
        return None
    t = msg.sprinter
    return {"eta_tp": t.eta_tp, "eta_fp": t.eta_fp, "tv_pq": t.tv_pq, "tv_bound": t.tv_bound,
            "tv_measured": t.tv_measured, "mean_run_length": t.mean_run_length,
            "expected_run_length": t.expected_run_length}


Item = Union[Chunk, Summary]


def _request(prompt, prompt_ids, *, max_new_tokens, temperature, top_k, top_p, seed, k, draft_top_k, mode, policy,
             steering, session_id, verification="exact", tree="", block_kind="", stop=(), draft_ahead="",
             ahead_outcomes=0, ahead_budget_ms=0.0) -> coordinator_pb2.GenerateRequest:
    # lazy: the SDK imports without torch
    from steerspec.decoding.trees import parse_tree
    from steerspec.sprinter.spec import parse_verification

    if (prompt is None) == (prompt_ids is None):
        raise ValueError("pass exactly one of prompt (text) or prompt_ids")
    parse_verification(verification)  # a bad spec is a ValueError here, before any call
    if tree:
        parse_tree(tree)  # likewise
    draft_ahead = ahead_setting(draft_ahead)
    return coordinator_pb2.GenerateRequest(
        prompt=prompt or "", prompt_ids=list(prompt_ids or []), max_new_tokens=max_new_tokens,
        sampling=common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), seed=seed, k=k,
        draft_top_k=draft_top_k, mode=mode, policy=policy, steering=steering,
        session_id=session_id or uuid.uuid4().hex, verification=verification, tree=tree or "",
        block_kind=block_kind or "", stop=[stop] if isinstance(stop, str) else list(stop or ()),
        draft_ahead=draft_ahead, ahead_outcomes=int(ahead_outcomes), ahead_budget_ms=float(ahead_budget_ms))


def ahead_setting(value) -> str:
    """A drafting-ahead setting as the wire sends it: True/"on" -> "on", False/"off" -> "off", None/"" -> ""
    (the deployment's default); ValueError otherwise."""
    if value is None or value == "":
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    text = str(value).strip().lower()
    if text not in ("on", "off"):
        raise ValueError(f"draft_ahead must be 'on', 'off', True, False or None, got {value!r}")
    return text


class _Dedup:
    """Turns possibly-replayed responses into the items the caller has not seen yet.

    Every attempt streams the generation from its first token, so a position counter per attempt
    tells which tokens (and which characters of text) were already delivered.
    """

    def __init__(self) -> None:
        self.delivered: List[int] = []
        self.delivered_chars = 0
        self.position = 0  # tokens seen on the current attempt
        self.char_position = 0  # text characters seen on the current attempt

    def new_attempt(self) -> None:
        self.position = self.char_position = 0

    def feed(self, response: coordinator_pb2.GenerateResponse, retries: int) -> Optional[Item]:
        if response.HasField("summary"):
            return Summary.from_proto(response.summary, retries)
        chunk = response.chunk
        ids = list(chunk.token_ids)
        start, self.position = self.position, self.position + len(ids)
        overlap = max(0, min(len(self.delivered), self.position) - start)
        if overlap and ids[:overlap] != self.delivered[start:start + overlap]:
            raise ResumeMismatch("the resumed session replayed different tokens than were received "
                                 "(it was not checkpointed); retry with a new session")
        text_start, self.char_position = self.char_position, self.char_position + len(chunk.text)
        text = chunk.text[max(0, min(self.delivered_chars, self.char_position) - text_start):]
        fresh = ids[overlap:]
        if not fresh and not (text and not ids):  # a text-only chunk: the tail a stop sequence held back
            return None
        self.delivered.extend(fresh)
        self.delivered_chars += len(text)
        return Chunk(seq=chunk.seq, token_ids=fresh, text=text, accepted=chunk.accepted, drafted=chunk.drafted)


def _security():
    # lazy: the SDK imports without torch
    from steerspec.serving import security

    return security


def default_seed(seed: Optional[int], temperature: float) -> int:
    """`seed`, else 0 for greedy decoding and a fresh random seed at T > 0 (so calls differ)."""
    if seed is not None:
        return int(seed)
    return random.getrandbits(62) if temperature > 0 else 0


class Client:
    """A connection to a coordinator; `generate` (sync), `agenerate` (asyncio), `generate_text`."""

    def __init__(self, target: str, *, retries: int = 10, backoff_s: float = 0.25, max_backoff_s: float = 4.0,
                 options: Optional[Sequence] = None, token: Optional[str] = None, tls_ca: Optional[str] = None,
                 tls_cert: Optional[str] = None, tls_key: Optional[str] = None,
                 security: Optional["ClientSecurity"] = None) -> None:
        """`token`: bearer token; `tls_ca` (PEM path) turns TLS on, `tls_cert`/`tls_key` add a client
        certificate (mTLS); `security` gives all at once (default: $STEERSPEC_TLS_CA / $STEERSPEC_TOKEN).
        The default retry budget (10 jittered backoffs, >= 14 s) outlasts a coordinator restart."""
        # lazy: the SDK imports without torch
        from steerspec.serving import security as sec

        if security is None:
            if token or tls_ca or tls_cert:
                security = sec.client_security(tls_ca, tls_cert, tls_key, token=token)
            else:
                security = sec.current_client()
        self.security = security
        self.target = target
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._options = list(options or [("grpc.max_receive_message_length", 64 << 20)])
        self._channel: Optional[grpc.Channel] = None
        self._achannels: Dict[int, grpc.aio.Channel] = {}

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    async def aclose(self) -> None:
        channels, self._achannels = list(self._achannels.values()), {}
        for channel in channels:
            await channel.close()
        self.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def _stub(self) -> coordinator_pb2_grpc.CoordinatorServiceStub:
        if self._channel is None:
            self._channel = _security().sync_channel(self.target, self._options, self.security)
        return coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)

    def _astub(self) -> coordinator_pb2_grpc.CoordinatorServiceStub:
        loop_id = id(asyncio.get_running_loop())
        channel = self._achannels.get(loop_id)
        if channel is None:
            channel = self._achannels[loop_id] = _security().aio_channel(self.target, self._options,
                                                                              self.security)
        return coordinator_pb2_grpc.CoordinatorServiceStub(channel)

    def _backoff(self, attempt: int) -> float:
        base = min(self.max_backoff_s, self.backoff_s * (2 ** attempt))
        return base * (0.5 + random.random() / 2)

    def _retry_pause(self, code: grpc.StatusCode, attempt: int, deadline: Optional[float]) -> Optional[float]:
        """Seconds to wait before retrying a call that failed with `code`; None: give up (not
        retryable, out of retries, or the pause would pass the deadline)."""
        if code not in RETRYABLE or attempt >= self.retries:
            return None
        pause = self._backoff(attempt)
        if deadline is not None and time.monotonic() + pause >= deadline:
            return None
        return pause

    # -- calls ------------------------------------------------------------------------------
    def generate(self, prompt: Optional[str] = None, *, prompt_ids: Optional[Sequence[int]] = None,
                 max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: Optional[int] = None, k: int = 0, draft_top_k: int = 64, mode: str = "speculative",
                 policy: str = "",
                 steering: bool = False, session_id: Optional[str] = None,
                 timeout: Optional[float] = None, verification: str = "exact", tree: str = "",
                 block_kind: str = "", stop: Union[str, Sequence[str]] = (), draft_ahead=None,
                 ahead_outcomes: int = 0, ahead_budget_ms: float = 0.0) -> Iterator[Item]:
        """Stream `Chunk`s as blocks are verified, then one `Summary` (sync iterator). `tree`: a draft tree's
        rank paths (e.g. "0,1,2,00,10" or "default") instead of k: exact, fixed policy; naming no k, tree or policy
        gets the deployment's load-aware default. `block_kind`: a block kind registered on the services outside the
        bundled ones (steerspec/blocks/), by name. `stop`: stop sequences (the text ends before the first match;
        finish_reason "stop"). `draft_ahead`: True/"on", False/"off" or None (the deployment's default): the drafter
        prepares the next block while one is verified (exact either way); `ahead_outcomes` / `ahead_budget_ms`: its
        budget per block (0: the drafter's defaults)."""
        request = _request(prompt, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                           top_p=top_p, seed=default_seed(seed, temperature), k=k, draft_top_k=draft_top_k,
                           mode=mode, policy=policy,
                           steering=steering, session_id=session_id, verification=verification, tree=tree,
                           block_kind=block_kind, stop=stop, draft_ahead=draft_ahead, ahead_outcomes=ahead_outcomes,
                           ahead_budget_ms=ahead_budget_ms)
        deadline = None if timeout is None else time.monotonic() + timeout
        dedup = _Dedup()
        attempt = 0
        while True:
            dedup.new_attempt()
            left = None if deadline is None else deadline - time.monotonic()
            call = self._stub().Generate(request, timeout=left)
            try:
                for response in call:
                    item = dedup.feed(response, attempt)
                    if item is not None:
                        yield item
                return
            except SteerSpecError:  # raised here (ResumeMismatch): not a call's status
                raise
            except grpc.RpcError as exc:
                pause = self._retry_pause(exc.code(), attempt, deadline)
                if pause is None:
                    raise from_rpc_error(exc) from exc
                attempt += 1
                time.sleep(pause)
            finally:
                call.cancel()

    async def agenerate(self, prompt: Optional[str] = None, *, prompt_ids: Optional[Sequence[int]] = None,
                        max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                        seed: Optional[int] = None, k: int = 0, draft_top_k: int = 64, mode: str = "speculative",
                        policy: str = "", steering: bool = False, session_id: Optional[str] = None,
                        timeout: Optional[float] = None, verification: str = "exact",
                        tree: str = "", block_kind: str = "", stop: Union[str, Sequence[str]] = (),
                        draft_ahead=None, ahead_outcomes: int = 0,
                        ahead_budget_ms: float = 0.0) -> AsyncIterator[Item]:
        """Asyncio version of `generate` (cancelling the consumer cancels the call)."""
        request = _request(prompt, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                           top_p=top_p, seed=default_seed(seed, temperature), k=k, draft_top_k=draft_top_k,
                           mode=mode, policy=policy,
                           steering=steering, session_id=session_id, verification=verification, tree=tree,
                           block_kind=block_kind, stop=stop, draft_ahead=draft_ahead, ahead_outcomes=ahead_outcomes,
                           ahead_budget_ms=ahead_budget_ms)
        deadline = None if timeout is None else time.monotonic() + timeout
        dedup = _Dedup()
        attempt = 0
        while True:
            dedup.new_attempt()
            left = None if deadline is None else deadline - time.monotonic()
            call = self._astub().Generate(request, timeout=left)
            try:
                async for response in call:
                    item = dedup.feed(response, attempt)
                    if item is not None:
                        yield item
                return
            except SteerSpecError:  # raised here (ResumeMismatch): not a call's status
                raise
            except grpc.RpcError as exc:
                pause = self._retry_pause(exc.code(), attempt, deadline)
                if pause is None:
                    raise from_rpc_error(exc) from exc
                attempt += 1
                await asyncio.sleep(pause)
            finally:
                call.cancel()

    def generate_text(self, prompt: Optional[str] = None, **kwargs) -> str:
        """The generated text only (blocks until the generation ends)."""
        return self.complete(prompt, **kwargs).text

    def complete(self, prompt: Optional[str] = None, **kwargs) -> Summary:
        """Run a generation to the end and return its Summary (MissingSummary if the stream ends without one)."""
        summary = None
        for item in self.generate(prompt, **kwargs):
            if isinstance(item, Summary):
                summary = item
        if summary is None:
            raise MissingSummary("the coordinator ended the stream without a summary")
        return summary

    async def acomplete(self, prompt: Optional[str] = None, **kwargs) -> Summary:
        """Asyncio version of `complete`."""
        summary = None
        async for item in self.agenerate(prompt, **kwargs):
            if isinstance(item, Summary):
                summary = item
        if summary is None:
            raise MissingSummary("the coordinator ended the stream without a summary")
        return summary

"""The drafter gRPC service: one bidirectional Draft stream per session.

Stream protocol (proto/steerspec/v1/drafter.proto; decoding protocol: steerspec/decoding/engine.py):
  DraftOpen -> DraftBlock seq 1 (drafted after the prompt, steered by DraftOpen.steering)
  DraftFeedback(result, want_block) -> roll back to the committed length, take the result's
      steering vector, draft the next block (seq + 1); want_block=false only rolls back
  DraftClose / stream end / cancel / deadline -> the session's cache is freed at once.
A bad feedback gets an in-stream StreamError and changes nothing; an invalid open (or a first
message that is not an open) aborts the stream with a status code.
Blocks of sessions that ask at about the same time are drafted together (drafter_service/draft_batcher.py,
--draft-batch-window-ms); `batcher.batches` / `batcher.batched_blocks` count them. A CPU model's passes all run on
one `PriorityWorker` thread (steerspec/serving/priority_worker.py): real drafts urgent, drafting ahead
(drafter_service/ahead.py) in the background, off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Dict, Optional

import grpc
import torch

from drafter_service.ahead import Ahead, AheadConfig, AheadReport
from drafter_service.ahead_args import DEFAULT_BUDGET_MS, DEFAULT_ENABLED, DEFAULT_OUTCOMES
from drafter_service.draft_batcher import DraftBatcher
from drafter_service.draft_sessions import (
    Drafter,
    DrafterSession,
    DrafterSessionTable,
    Proposal,
    load_policy_state,
    policy_state,
    resolve_policy,
)
from steerspec.blocks.block_mode import BlockMode, ModeError, parse_mode
from steerspec.decoding import rounds
from steerspec.decoding.sampling import MAX_DRAFT_TOP_K
from steerspec.models.kv import prepare_weight_copies
from steerspec.observability import tracing
from steerspec.policies.base import MAX_K, BlockFeedback
from steerspec.serving import wire
from steerspec.serving.compute import inline_compute
from steerspec.serving.priority_worker import PriorityWorker
from steerspec.serving.grpc_common import DEFAULT_MAX_MESSAGE_BYTES, start_server
from steerspec.serving.identity import ModelIdentity, describe_model, drafter_fix, mismatch_message, pair_differences
from steerspec.serving.session_stream import SessionStreamServicer, StreamSpec
from steerspec.serving.wire import ProtocolError, code_number
from steerspec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = "steerspec.v1.DrafterService"
DEFAULT_K = 8


@dataclass
class DrafterConfig:
    max_sessions: int = 64
    idle_timeout_s: float = 300.0
    model_name: str = ""
    policy: str = ""  # draft-length policy for sessions that name none ("" = fixed with the session's k)
    batch_window_ms: float = 1.0  # how long a draft request waits for other sessions' (0 = take what is there)
    sprinter_head: Optional[str] = None  # SPRINTER head directory (default: MODEL/sprinter) for lossy sessions
    identity: Optional[ModelIdentity] = None  # what it serves (default: described from the model and its steering)
    draft_ahead: bool = DEFAULT_ENABLED  # sessions that do not say prepare their next block while one is verified (ahead.py)
    ahead_outcomes: int = DEFAULT_OUTCOMES  # verdicts prepared per block by default
    ahead_budget_ms: float = DEFAULT_BUDGET_MS  # drafter time preparing per block by default (0 = no time limit)


def _mode(msg: drafter_pb2.DraftOpen, default_policy: str) -> BlockMode:
    """DraftOpen's mode (`blocks.block_mode.parse_mode`: k, tree, verification, the policy or this drafter's
    default); INVALID_ARGUMENT naming the bad field."""
    try:
        return parse_mode(k=int(msg.k) or DEFAULT_K, tree=msg.tree, verification=msg.verification,
                          policy=msg.policy, default_policy=default_policy, block_kind=msg.block_kind)
    except ModeError as exc:
        raise wire.invalid(str(exc)) from None


def _ahead(msg: drafter_pb2.DraftOpen):
    """DraftOpen's drafting-ahead fields -> (on or None for the drafter's default, verdicts or None, budget ms or
    None; 0 = no time limit); INVALID_ARGUMENT naming a bad value."""
    setting = msg.draft_ahead.strip().lower()
    if setting not in ("", "on", "off"):
        raise wire.invalid(f"draft_ahead {msg.draft_ahead!r} is not 'on', 'off' or empty (the drafter's default)")
    if msg.ahead_outcomes > 64:
        raise wire.invalid(f"ahead_outcomes {msg.ahead_outcomes} exceeds the limit of 64 verdicts per block")
    budget = float(msg.ahead_budget_ms)
    return ({"": None, "on": True, "off": False}[setting], int(msg.ahead_outcomes) or None,
            None if budget == 0 else max(budget, 0.0))


def _error(code: grpc.StatusCode, message: str, seq: int = 0) -> drafter_pb2.DraftResponse:
    return drafter_pb2.DraftResponse(error=common_pb2.StreamError(code=code_number(code), message=message, seq=seq))


class DrafterServicer(SessionStreamServicer, drafter_pb2_grpc.DrafterServiceServicer):
    stream_spec = StreamSpec(stream="Draft", open_message="DraftOpen", request="DraftRequest", work="feedback",
                             open_failure="drafting failed", work_failure="drafting failed",
                             error_reply=_error)

    def __init__(self, model, config: DrafterConfig, hooks=None) -> None:
        self.model = model
        self.config = config
        self.drafter = Drafter(model, hooks, config.sprinter_head, config.model_name)
        self.vocab_size = self.drafter.vocab_size
        self.identity = config.identity or describe_model(
            model, config.model_name, steering=getattr(hooks, "steering", None), role="drafter")
        self.table = DrafterSessionTable(model, config.max_sessions)
        # a CPU model: every pass on one thread that owns it, real drafts before drafting ahead (priority_worker.py)
        self.worker = PriorityWorker("drafter") if inline_compute(model) else None
        self.batcher = DraftBatcher(self.drafter.draft_many, config.batch_window_ms / 1e3, lambda: len(self.table),
                                    max_batch=config.max_sessions, executor=self.worker)
        self.ahead = Ahead(self.drafter, AheadConfig(config.draft_ahead, config.ahead_outcomes,
                                                     config.ahead_budget_ms),
                           busy=lambda: self.batcher.queue_depth > 0, worker=self.worker)
        self._warm: Dict[str, str] = {}  # spec -> latest state of a warm-start policy (its learned pair and link)
        self._tracing = None
        self._tracer = None
        self._tracing, self._tracer = tracing, tracing.get_tracer(__name__)

    async def close(self) -> None:
        for session in list(self.table.sessions.values()):
            self.close_session(session)
        await self.batcher.close()

    def stats(self) -> common_pb2.ServiceStats:
        return common_pb2.ServiceStats(active_sessions=len(self.table), cache_bytes=self.table.cache_bytes(),
                                       max_sessions=self.table.max_sessions, blocks_total=self.table.blocks_total,
                                       model=self.config.model_name, identity=wire.identity_to_proto(self.identity),
                                       passes_total=self.batcher.batches, rows_total=self.batcher.rows,
                                       busy_s=self.batcher.busy_s)

    async def GetDrafterStats(self, request, context):
        return drafter_pb2.GetDrafterStatsResponse(stats=self.stats())

    # ------------------------------------------------------------------ the stream
    async def Draft(self, request_iterator, context):
        await self.serve_session(context)

    @property
    def idle_timeout_s(self) -> float:
        return self.config.idle_timeout_s

    async def open_session(self, msg: drafter_pb2.DraftOpen):
        session = self._open(msg)
        try:
            return session, await self._propose(session, msg.traceparent)
        except BaseException:
            self.table.close(session)
            raise

    def close_session(self, session: DrafterSession) -> None:
        self.ahead.drop(session)
        self.table.close(session)

    def after_reply(self, session: DrafterSession) -> None:
        """The block has left: prepare the next one for its likeliest verdicts, in idle time (ahead.py)."""
        self.ahead.start(session)

    def _steering(self, msg: common_pb2.Tensor, what: str) -> Optional[torch.Tensor]:
        if not wire.has_tensor(msg):
            return None
        dim = self.drafter.steer_dim
        if dim is None:
            raise ProtocolError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{what} carries a steering vector but this drafter has no SD² steering weights; "
                                "serve an SD² drafter checkpoint or open the verifier session with steering=false")
        return wire.tensor_from_proto(msg, size=dim, what=what).reshape(dim)

    def _open(self, msg: drafter_pb2.DraftOpen) -> DrafterSession:
        prompt = wire.ids_array(msg.prompt_ids)
        if prompt.size == 0:
            raise wire.invalid("prompt_ids is empty: a session needs at least one prompt token")
        self._check_verifier(msg)
        wire.check_ids(prompt, self.vocab_size, "prompt_ids")
        if prompt.size >= self.drafter.context:
            raise ProtocolError(grpc.StatusCode.OUT_OF_RANGE,
                                f"prompt has {prompt.size} tokens; the drafter's context is {self.drafter.context}, "
                                "leaving no room to draft")
        params = wire.sampling_from_proto(msg.sampling if msg.HasField("sampling") else None, self.vocab_size)
        k = int(msg.k) or DEFAULT_K
        if k > MAX_K:
            raise wire.invalid(f"k {k} exceeds the limit of {MAX_K} draft tokens per block")
        top_k = int(msg.draft_top_k)
        if top_k > MAX_DRAFT_TOP_K and top_k < self.vocab_size:
            raise wire.invalid(f"draft_top_k {top_k} exceeds the limit {MAX_DRAFT_TOP_K} (0 = full vocabulary)")
        if top_k > self.vocab_size:
            raise wire.invalid(f"draft_top_k {top_k} exceeds the vocabulary size {self.vocab_size}")
        mode = _mode(msg, self.config.policy)
        k = mode.policy_k  # a tree's nodes or a run's max_run, cut near the budget and the context like k
        spec = mode.policy  # `fixed` where the kind's shape sets the length (a tree; SPRINTER's runs)
        policy = resolve_policy(spec, k, self.table.model)
        if msg.policy_state:  # a failover: the session's own state
            load_policy_state(policy, msg.policy_state)
        elif getattr(policy, "warm_start", False) and spec in self._warm:
            load_policy_state(policy, self._warm[spec])  # what earlier sessions learned about this pair and link
            policy.reset()
        steering = self._steering(msg.steering, "DraftOpen.steering")
        ahead = _ahead(msg)
        generator = rounds.generator(rounds.drafter_seed(msg.seed), self.model.device)  # reseeded per block
        ids = prompt.tolist()
        session = self.table.open(msg.session_id, committed=ids, open_length=len(ids), params=params,
                                  generator=generator, k=k, draft_top_k=top_k, policy=policy,
                                  max_new_tokens=int(msg.max_new_tokens), steering=steering, policy_spec=spec,
                                  mode=mode, seed=rounds.drafter_seed(msg.seed), ahead=ahead[0],
                                  ahead_outcomes=ahead[1], ahead_budget_ms=ahead[2])
        try:
            session.kind.open_drafter(self.drafter, session)
        except BaseException:
            self.table.close(session)
            raise
        return session

    def _check_verifier(self, msg: drafter_pb2.DraftOpen) -> None:
        """FAILED_PRECONDITION when this drafter cannot draft for the session's verifier (DraftOpen.verifier):
        another tokenizer or vocabulary, or (a steered session) SD² weights that do not read its head's vectors."""
        verifier = wire.identity_from_proto(msg.verifier) if msg.HasField("verifier") else None
        if verifier is None:
            return
        differences = pair_differences(verifier, self.identity, steering=wire.has_tensor(msg.steering))
        if differences:
            raise ProtocolError(grpc.StatusCode.FAILED_PRECONDITION, mismatch_message(
                verifier, self.identity, "drafter", differences, drafter_fix(differences)))

    async def _propose(self, session: DrafterSession, traceparent: str = "",
                       report: Optional[AheadReport] = None) -> drafter_pb2.DraftResponse:
        """Draft the session's next block (or send the one prepared ahead for the verdict just committed); its span
        is a child of the coordinator's block span."""
        start_ns = time.time_ns()
        out = await self.ahead.use(session) if report is not None and report.hit else None
        if out is None:
            rounds.seed_block(session.generator, session.seed, len(session.committed))  # the seed and the prefix only
            out = await self.batcher.submit(session)
        session.seq += 1
        n = len(session.committed)
        session.proposal = Proposal(seq=session.seq, committed_length=n, draft_ids=out.draft_ids,
                                    draft_ms=out.draft_ms, fed=out.fed, shape=out.shape)
        self.table.blocks_total += 1
        block = wire.encode_block(session.seq, n, out.draft_ids, out.q, out.draft_ms)
        session.kind.encode_block(session, out, block)
        if report is not None and report.on:
            block.ahead, block.ahead_hit = True, report.hit
            block.ahead_prepared, block.ahead_ms = report.prepared, report.ahead_ms
        block.policy_state = policy_state(session.policy)
        if getattr(session.policy, "warm_start", False):
            self._warm[session.policy_spec] = block.policy_state
        if self._tracer is not None:
            self._tracing.record_span(self._tracer, self._tracing.DRAFTER_DRAFT_SPAN, start_ns,
                                      start_ns + int(out.draft_ms * 1e6),
                                      parent=self._tracing.context_from_traceparent(traceparent),
                                      block=session.seq, k=len(out.draft_ids),
                                      bytes=block.ByteSize(), batch_size=out.batch_size,
                                      ahead_hit=bool(block.ahead_hit), ahead_prepared=int(block.ahead_prepared),
                                      ahead_ms=float(block.ahead_ms))
        return drafter_pb2.DraftResponse(block=block)

    def _check_feedback(self, session: DrafterSession, msg: drafter_pb2.DraftFeedback):
        if not msg.HasField("result"):
            raise wire.invalid("DraftFeedback has no result: send the VerifyResult of the last block")
        result = msg.result
        proposal = session.proposal
        if proposal is None or result.seq != proposal.seq:
            if proposal is not None and result.seq < proposal.seq and result.seq >= 1:
                raise ProtocolError(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"feedback for block {result.seq} was already applied; the open block is "
                                    f"{proposal.seq}")
            pending = "no block is awaiting feedback" if proposal is None else f"the open block is {proposal.seq}"
            raise ProtocolError(grpc.StatusCode.NOT_FOUND,
                                f"feedback for block {result.seq}, which this drafter never sent ({pending})")
        k = len(proposal.draft_ids)
        if result.accepted > k:
            raise wire.invalid(f"result accepts {result.accepted} tokens but block {proposal.seq} drafted only {k}")
        if not 0 <= result.next_token < self.vocab_size:
            raise wire.invalid(f"result.next_token {result.next_token} is outside the vocabulary "
                               f"[0, {self.vocab_size})")
        session.kind.check_feedback(session, result)
        expected = proposal.committed_length + result.accepted + 1
        if result.committed_length != expected:
            raise wire.invalid(f"result.committed_length {result.committed_length} does not match the block: "
                               f"{proposal.committed_length} + {result.accepted} accepted + 1 = {expected}")
        if msg.want_block and session.max_new_tokens > 0 and \
                expected - session.open_length >= session.max_new_tokens:
            raise ProtocolError(grpc.StatusCode.OUT_OF_RANGE,
                                f"max_new_tokens {session.max_new_tokens} is reached with this result; "
                                "send it with want_block=false")
        if msg.want_block and expected >= self.drafter.context:
            raise ProtocolError(grpc.StatusCode.OUT_OF_RANGE,
                                f"the sequence reaches the drafter's context ({self.drafter.context} tokens) with "
                                "this result; send it with want_block=false")
        return self._steering(result.steering, "result.steering")

    async def handle(self, session: DrafterSession, msg: drafter_pb2.DraftFeedback):
        """Apply a verify result; draft the next block when asked (a bad feedback gets a StreamError)."""
        try:
            steering = self._check_feedback(session, msg)
        except ProtocolError as exc:
            return _error(exc.code, exc.message, msg.result.seq)
        result = msg.result
        away_ms = (time.perf_counter() - session.proposal.sent_at) * 1e3
        verify_ms, queue_ms, network_ms = float(result.verify_ms), float(result.queue_ms), float(msg.network_ms)
        timing = BlockFeedback(int(result.accepted), len(session.proposal.draft_ids), draft_ms=float(msg.draft_ms),
                               verify_ms=verify_ms, queue_ms=queue_ms, network_ms=network_ms,
                               overhead_ms=rounds.overhead_ms(away_ms, 0.0, network_ms, queue_ms, verify_ms),
                               path=tuple(int(node) for node in result.path), batch_size=int(result.batch_size),
                               draft_compute_ms=float(session.proposal.draft_ms),
                               pass_rows=int(result.pass_rows), blocks_waiting=int(result.blocks_waiting),
                               cost_fixed_ms=float(result.cost_fixed_ms),
                               cost_per_row_ms=float(result.cost_per_row_ms),
                               cost_per_block_ms=float(result.cost_per_block_ms),
                               cost_per_branched_row_ms=float(result.cost_per_branched_row_ms),
                               cost_row_bucket=int(result.cost_row_bucket),
                               cost_block_rows=float(result.cost_block_rows))
        report = await self.ahead.take(session, int(result.accepted), int(result.next_token), list(result.path))
        self.drafter.apply_feedback(session, int(result.accepted), int(result.next_token), steering, timing,
                                    path=list(result.path))
        if not msg.want_block:
            self.ahead.drop(session)
            return None
        return await self._propose(session, msg.traceparent, report)


async def serve(model, config: DrafterConfig, host: str = "127.0.0.1", port: int = 0, hooks=None,
                max_message_bytes: Optional[int] = None):
    """Start a drafter server; returns (RunningServer, servicer)."""
    servicer = DrafterServicer(model, config, hooks)
    if servicer.worker is not None:  # before serving, on the thread that runs the passes (serving/compute.py)
        await asyncio.wrap_future(servicer.worker.submit(prepare_weight_copies, model))
    else:
        prepare_weight_copies(model)
    running = await start_server([(drafter_pb2_grpc.add_DrafterServiceServicer_to_server, servicer)],
                                 [SERVICE_NAME], host=host, port=port,
                                 max_message_bytes=max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES)
    running.on_stop.append(servicer.close)
    return running, servicer

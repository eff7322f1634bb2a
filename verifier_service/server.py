"""The verifier gRPC service: one bidirectional Verify stream per session, blocks batched.

Stream protocol (proto/steerspec/v1/verifier.proto; decoding protocol: steerspec/decoding/engine.py):
  VerifyOpen -> VerifyReady (prefill of prompt[:-1]; steering for block 1 when asked)
  DraftBlock -> VerifyResult, or StreamError (the session is left unchanged; fix and resend)
  VerifyClose / stream end / cancel / deadline -> the session's cache is freed at once.
An invalid open, or a first message that is not an open, aborts the stream with a status code.
Sequence numbers: the first block of a stream may carry any seq (a resumed session continues its
numbering); each later block must carry the previous verified seq + 1.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import grpc
import torch

from steerspec.blocks.block_mode import BlockMode, ModeError, parse_mode
from steerspec.blocks.kinds import kind_of
from steerspec.decoding import rounds
from steerspec.models.kv import prepare_weight_copies
from steerspec.models.loading import context_length
from steerspec.observability import tracing
from steerspec.policies.base import MAX_K
from steerspec.serving import wire
from steerspec.serving.compute import inline_compute
from steerspec.serving.grpc_common import DEFAULT_MAX_MESSAGE_BYTES, start_server
from steerspec.serving.identity import ModelIdentity, describe_model, mismatch_message, tokenizer_differences
from steerspec.serving.session_stream import SessionStreamServicer, StreamSpec
from steerspec.serving.wire import ProtocolError, code_number
from steerspec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from verifier_service.verify_batcher import Batcher, VerifyRunner
from verifier_service.verify_jobs import VerifyJob
from verifier_service.verify_sessions import SessionTable, VerifierSession

log = logging.getLogger(__name__)
SERVICE_NAME = "steerspec.v1.VerifierService"


@dataclass
class VerifierConfig:
    """Limits and knobs of one verifier replica (see `steerspec serve verifier --help`)."""

    max_sessions: int = 64
    max_cache_mb: float = 0.0  # 0 = no limit
    batch_window_ms: float = 2.0
    idle_timeout_s: float = 300.0
    max_batch: int = 64
    replica: str = ""
    model_name: str = ""
    kv_backend: str = "auto"  # sessions' KV caches: auto | fast | hf (verifier_service/verify_sessions.session_lm)
    prefill_chunk: int = 512  # an inline (CPU) replica feeds longer prompts in passes of this many tokens; 0 = one
    identity: Optional[ModelIdentity] = None  # what it serves (default: described from the model and its head)


def _error(code: grpc.StatusCode, message: str, seq: int = 0) -> verifier_pb2.VerifyResponse:
    return verifier_pb2.VerifyResponse(error=common_pb2.StreamError(code=code_number(code), message=message, seq=seq))


class VerifierServicer(SessionStreamServicer, verifier_pb2_grpc.VerifierServiceServicer):
    """Holds the model, the session table and the batcher."""

    stream_spec = StreamSpec(stream="Verify", open_message="VerifyOpen", request="VerifyRequest", work="block",
                             open_failure="prefill failed", work_failure="verification failed",
                             error_reply=_error)

    def __init__(self, model, config: VerifierConfig, steering_head=None) -> None:
        self.model = model
        self.config = config
        self.vocab_size = int(model.config.vocab_size)
        self.context = context_length(model)
        self.head = steering_head
        self.identity = config.identity or describe_model(model, config.model_name, steering=steering_head)
        self.table = SessionTable(model, config.max_sessions, int(config.max_cache_mb * 2**20),
                                  config.kv_backend)
        self.runner = VerifyRunner(model, steering_head)
        self.batcher = Batcher(self.runner, config.batch_window_ms / 1e3, lambda: self.table.ready_count,
                               max_batch=config.max_batch, inline=inline_compute(model))
        self.device = model.device
        self._tracing = tracing
        self._tracer = tracing.get_tracer(__name__)
        self.on_verified = None  # (draft tokens, accepted) of each verified block: the speculative-decoding counters

    async def start(self) -> None:
        prepare_weight_copies(self.model)  # before serving, on the loop's thread (steerspec/serving/compute.py)
        self.batcher.start()

    async def close(self) -> None:
        await self.batcher.close()
        for session in self.table.active():
            self.table.close(session)

    # ------------------------------------------------------------------ stats
    def stats(self) -> common_pb2.ServiceStats:
        return common_pb2.ServiceStats(
            active_sessions=len(self.table), cache_bytes=self.table.cache_bytes(),
            max_sessions=self.table.max_sessions, max_cache_bytes=self.table.max_cache_bytes,
            blocks_total=self.table.blocks_total, model=self.config.model_name,
            identity=wire.identity_to_proto(self.identity), passes_total=self.batcher.batches,
            rows_total=self.batcher.rows, busy_s=self.batcher.busy_s)

    async def GetVerifierStats(self, request, context):
        return verifier_pb2.GetVerifierStatsResponse(stats=self.stats())

    # ------------------------------------------------------------------ the stream
    async def Verify(self, request_iterator, context):
        await self.serve_session(context)

    @property
    def idle_timeout_s(self) -> float:
        return self.config.idle_timeout_s

    async def open_session(self, msg: verifier_pb2.VerifyOpen):
        session, ready = await self._open(msg)
        return session, verifier_pb2.VerifyResponse(ready=ready)

    def close_session(self, session: VerifierSession) -> None:
        self.table.close(session)

    async def _open(self, msg: verifier_pb2.VerifyOpen):
        prompt = wire.ids_array(msg.prompt_ids)
        if prompt.size == 0:
            raise wire.invalid("prompt_ids is empty: a session needs at least one prompt token")
        self._check_client(msg)
        wire.check_ids(prompt, self.vocab_size, "prompt_ids")
        if prompt.size > self.context:
            raise ProtocolError(grpc.StatusCode.OUT_OF_RANGE,
                                f"prompt has {prompt.size} tokens; the verifier's context is {self.context}")
        params = wire.sampling_from_proto(msg.sampling if msg.HasField("sampling") else None, self.vocab_size)
        max_k = int(msg.max_k) or MAX_K
        if max_k > MAX_K:
            raise wire.invalid(f"max_k {max_k} exceeds this verifier's limit of {MAX_K} draft tokens per block")
        if msg.steering and self.head is None:
            raise ProtocolError(grpc.StatusCode.FAILED_PRECONDITION,
                                "steering was requested but this verifier has no SD² steering head; start it "
                                "with --steering-head DIR or open the session with steering=false")
        generator = rounds.generator(rounds.verifier_seed(msg.seed), self.device)
        prompt_ids = prompt.tolist()
        mode = _mode(msg)
        kind = kind_of(mode)
        session = self.table.open(msg.session_id, len(prompt_ids), kind.max_block(mode, max_k),
                                  pending=prompt_ids[-1], params=params, generator=generator,
                                  steering=bool(msg.steering), mode=mode)
        start = time.perf_counter()
        try:
            kind.open_verifier(session)
            steering = await self._prefill(session, prompt_ids)
        except BaseException:
            self.table.close(session)
            raise
        session.ready = True
        session.touch()
        ready = verifier_pb2.VerifyReady(session_id=session.session_id, committed_length=session.committed,
                                         prefill_ms=(time.perf_counter() - start) * 1e3,
                                         replica=self.config.replica, model=wire.identity_to_proto(self.identity))
        if steering is not None:
            ready.steering.CopyFrom(wire.tensor_to_proto(steering))
        return session, ready

    def _check_client(self, msg: verifier_pb2.VerifyOpen) -> None:
        """FAILED_PRECONDITION when the opener's tokenizer would give its token ids another meaning here."""
        client = wire.identity_from_proto(msg.client_model) if msg.HasField("client_model") else None
        differences = [] if client is None else tokenizer_differences(self.identity, client, "coordinator")
        if differences:
            raise ProtocolError(grpc.StatusCode.FAILED_PRECONDITION, mismatch_message(
                self.identity, client, "coordinator", differences,
                "Start the coordinator without --tokenizer (it follows the verifier's model) or with --tokenizer "
                f"naming the verifier's model ({self.identity.name})"))

    async def _prefill(self, session: VerifierSession, prompt_ids: List[int]) -> Optional[torch.Tensor]:
        """Feed the prompt; returns block 1's steering (or None). Passes run on the loop's thread on a CPU
        (steerspec/serving/compute.py), so a long prompt goes in `prefill_chunk`-token passes with the loop running
        between them: heartbeats and other sessions' blocks wait for one chunk (512 tokens: about 0.9 s
        for SmolLM2 on 2 cores), not for the whole prompt (2,048 tokens: 5 s in one pass)."""
        done, chunk = 0, int(self.config.prefill_chunk)
        if self.batcher.inline and chunk > 0:
            while len(prompt_ids) - 1 - done > chunk:
                self.runner.prefill_chunk(session, prompt_ids, done, done + chunk)
                done += chunk
                await asyncio.sleep(0)
                if session.closed:
                    raise ProtocolError(grpc.StatusCode.CANCELLED, "the session closed during its prefill")
        return await self.batcher.run_compute(self.runner.prefill, session, prompt_ids, done, hold=(session,))

    def _check_block(self, session: VerifierSession,
                     msg: common_pb2.DraftBlock) -> Tuple[wire.WireBlock, Optional[object]]:
        """The decoded block, and what its kind checked (`BlockKind.admit`, once here, reused by the batch)."""
        if session.last_seq is not None and msg.seq != session.last_seq + 1:
            raise ProtocolError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"wrong seq {msg.seq}: the last verified block was {session.last_seq}, "
                                f"so the next must be {session.last_seq + 1}")
        if msg.committed_length != session.committed:
            raise ProtocolError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"block {msg.seq} extends a prefix of {msg.committed_length} tokens but the session "
                                f"has committed {session.committed}; draft from the committed sequence")
        k = len(msg.draft_ids)
        if k > session.max_k:
            raise ProtocolError(grpc.StatusCode.OUT_OF_RANGE,
                                f"block {msg.seq} has {k} draft tokens; the session's max_k is {session.max_k}")
        if session.committed + k > self.context:
            raise ProtocolError(grpc.StatusCode.OUT_OF_RANGE,
                                f"block {msg.seq} would take the sequence to {session.committed + k} tokens; the "
                                f"verifier's context is {self.context}: draft fewer tokens or stop")
        block, checked = session.kind.admit(session, msg, self.vocab_size)
        self.table.reserve(session, session.committed + k)
        return block, checked

    async def handle(self, session: VerifierSession, msg: common_pb2.DraftBlock) -> verifier_pb2.VerifyResponse:
        """Verify one block (batched with concurrent sessions' blocks); a bad block gets a StreamError."""
        try:
            block, checked = self._check_block(session, msg)
        except ProtocolError as exc:
            return _error(exc.code, exc.message, msg.seq)
        start_ns = time.time_ns()
        result = await self.batcher.submit(VerifyJob(session=session, block=block, checked=checked))
        committed = session.committed + result.accepted + 1
        session.committed = committed
        session.pending = result.next_token
        session.last_seq = block.seq
        session.blocks += 1
        self.table.blocks_total += 1
        out = common_pb2.VerifyResult(seq=block.seq, accepted=result.accepted, next_token=result.next_token,
                                      is_bonus=result.is_bonus, committed_length=committed,
                                      queue_ms=result.queue_ms, verify_ms=result.verify_ms,
                                      batch_size=result.batch_size, pass_rows=result.pass_rows,
                                      blocks_waiting=self.batcher.queue_depth)
        (out.cost_fixed_ms, out.cost_per_block_ms, out.cost_per_row_ms,
         out.cost_per_branched_row_ms) = self.runner.costs.line()
        out.cost_row_bucket, out.cost_block_rows = self.runner.costs.shape
        if result.steering is not None:
            out.steering.CopyFrom(wire.tensor_to_proto(result.steering))
        session.kind.encode_result(result, out)
        if self.on_verified is not None:
            self.on_verified(block.k, result.accepted)
        if self._tracer is not None and self._tracing is not None:
            self._record_spans(start_ns, result, block, msg.ByteSize(), msg.traceparent)
        return verifier_pb2.VerifyResponse(result=out)

    def _record_spans(self, start_ns: int, result, block: wire.WireBlock, nbytes: int, traceparent: str) -> None:
        """Queue and forward spans, children of the coordinator's block span (its traceparent)."""
        queue_end = start_ns + int(result.queue_ms * 1e6)
        end = queue_end + int(result.verify_ms * 1e6)
        t = self._tracing
        parent = t.context_from_traceparent(traceparent)
        t.record_span(self._tracer, t.VERIFIER_QUEUE_SPAN, start_ns, queue_end, parent=parent, block=block.seq,
                      k=block.k, bytes=nbytes)
        t.record_span(self._tracer, t.VERIFIER_FORWARD_SPAN, queue_end, end, parent=parent, block=block.seq,
                      k=block.k, accepted=result.accepted, batch_size=result.batch_size)


def _mode(msg: verifier_pb2.VerifyOpen) -> BlockMode:
    """VerifyOpen's mode (`blocks.block_mode.parse_mode` of its tree and verification); INVALID_ARGUMENT naming
    the bad field."""
    try:
        return parse_mode(tree=msg.tree, verification=msg.verification, block_kind=msg.block_kind)
    except ModeError as exc:
        raise wire.invalid(str(exc)) from None


async def serve(model, config: VerifierConfig, host: str = "127.0.0.1", port: int = 0, steering_head=None,
                max_message_bytes: Optional[int] = None):
    """Start a verifier server; returns (RunningServer, servicer). Stop with `running.stop(grace)`."""
    servicer = VerifierServicer(model, config, steering_head)
    await servicer.start()
    running = await start_server([(verifier_pb2_grpc.add_VerifierServiceServicer_to_server, servicer)],
                                 [SERVICE_NAME], host=host, port=port,
                                 max_message_bytes=max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES)
    running.on_stop.append(servicer.close)
    return running, servicer

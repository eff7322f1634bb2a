"""Malformed messages on both services: the right status code, a clear message, state unchanged.

In-stream errors (the session exists): a StreamError with the code; then the valid message gets
exactly the answer a fresh session gives it. Stream aborts (the open itself is bad, or nothing was
opened): the call ends with the status code; the server keeps serving others.
"""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
import pytest_asyncio
import torch
from service_helpers import make_tiny_llama, sampling_pb, wait_for_stats

from drafter_service.server import DrafterConfig
from drafter_service.server import serve as serve_drafter
from steerspec.serving import wire
from steerspec.models import load_model
from steerspec.steering import DrafterSteering, attach_steering
from steerspec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from verifier_service.server import VerifierConfig
from verifier_service.server import serve as serve_verifier

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]

C = grpc.StatusCode
VOCAB, CONTEXT, HIDDEN = 97, 96, 32
PROMPT = [5, 6, 7, 8]
MAX_MESSAGE = 64 * 1024


class Env:
    pass


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("malformed")
    verifier = load_model(str(make_tiny_llama(root / "v", seed=0)))
    drafter = load_model(str(make_tiny_llama(root / "d", seed=1, num_hidden_layers=1)))
    steered = load_model(str(root / "d"))
    steering = DrafterSteering.for_model(steered, steer_dim=HIDDEN)
    e = Env()
    e.v_running, e.v = await serve_verifier(verifier, VerifierConfig(), max_message_bytes=MAX_MESSAGE)
    e.d_running, e.d = await serve_drafter(drafter, DrafterConfig())
    e.s_running, e.s = await serve_drafter(steered, DrafterConfig(), hooks=attach_steering(steered, steering))
    e.channels = [grpc.aio.insecure_channel(r.target) for r in (e.v_running, e.d_running, e.s_running)]
    e.verifier = verifier_pb2_grpc.VerifierServiceStub(e.channels[0])
    e.drafter = drafter_pb2_grpc.DrafterServiceStub(e.channels[1])
    e.steered = drafter_pb2_grpc.DrafterServiceStub(e.channels[2])
    e.controls = {}
    yield e
    for channel in e.channels:
        await channel.close()
    for running in (e.v_running, e.d_running, e.s_running):
        await running.stop(0.5)


def code(c: grpc.StatusCode) -> int:
    return c.value[0]


# ============================================================================ verifier: helpers


def v_open(prompt=PROMPT, temperature=0.0, max_k=8, **kw) -> verifier_pb2.VerifyRequest:
    return verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(
        prompt_ids=prompt, sampling=sampling_pb(temperature, kw.pop("top_k", 0), kw.pop("top_p", 1.0)),
        max_k=max_k, seed=3, **kw))


def good_q(drafts, support=4):
    ids = [[d] + [(d + 10 * j) % VOCAB for j in range(1, support)] for d in drafts]
    probs = [[0.5, 0.25, 0.125, 0.125][:support]] * len(drafts)  # exact in fp16: sums to 1, no spread tail
    return wire.encode_sparse(torch.tensor(ids), torch.tensor(probs))


def good_block(mode, seq, committed, drafts=(10, 11, 12)) -> common_pb2.DraftBlock:
    block = common_pb2.DraftBlock(seq=seq, committed_length=committed, draft_ids=list(drafts), draft_ms=1.0)
    if mode == "sample" and drafts:
        block.q.CopyFrom(good_q(drafts))
    return block


def block_req(block) -> verifier_pb2.VerifyRequest:
    return verifier_pb2.VerifyRequest(block=block)


def set_prob(block, index, value):
    probs = np.frombuffer(block.q.probs, "<f2").copy()
    probs[index] = value
    block.q.probs = probs.tobytes()
    return block


def edit(fn):
    """A mutation of the valid block (a copy) into a bad request."""
    def make(block):
        bad = common_pb2.DraftBlock()
        bad.CopyFrom(block)
        out = fn(bad)
        return out if isinstance(out, verifier_pb2.VerifyRequest) else block_req(bad)
    return make


def _set(**fields):
    def fn(b):
        for name, value in fields.items():
            setattr(b, name, value)
    return fn


def _drafts(values):
    def fn(b):
        del b.draft_ids[:]
        b.draft_ids.extend(values)
    return fn


V_STREAM_CASES = [
    # (name, mode, warm, prompt, mutation, code, fragment)
    ("double open", "greedy", False, PROMPT, lambda b: v_open(), C.FAILED_PRECONDITION, "already open"),
    ("empty request", "greedy", False, PROMPT, lambda b: verifier_pb2.VerifyRequest(), C.INVALID_ARGUMENT,
     "empty VerifyRequest"),
    ("seq skips ahead", "greedy", True, PROMPT, edit(lambda b: _set(seq=b.seq + 5)(b)), C.FAILED_PRECONDITION,
     "wrong seq"),
    ("seq replays a verified block", "greedy", True, PROMPT, edit(lambda b: _set(seq=1)(b)), C.FAILED_PRECONDITION,
     "wrong seq"),
    ("committed_length behind", "greedy", False, PROMPT, edit(lambda b: _set(committed_length=3)(b)),
     C.FAILED_PRECONDITION, "has committed 4"),
    ("committed_length ahead", "greedy", True, PROMPT,
     edit(lambda b: _set(committed_length=b.committed_length + 2)(b)), C.FAILED_PRECONDITION, "has committed"),
    ("k above max_k", "greedy", False, PROMPT, edit(_drafts([10] * 9)), C.OUT_OF_RANGE, "max_k is 8"),
    ("block past the context", "greedy", False, [1] * (CONTEXT - 4), edit(_drafts([10] * 5)), C.OUT_OF_RANGE,
     "context"),
    ("negative draft id", "greedy", False, PROMPT, edit(_drafts([10, -3, 12])), C.INVALID_ARGUMENT, "negative"),
    ("out-of-vocab draft id", "greedy", False, PROMPT, edit(_drafts([10, VOCAB, 12])), C.INVALID_ARGUMENT,
     "outside the vocabulary"),
    ("huge draft id", "greedy", False, PROMPT, edit(_drafts([2**31 - 1])), C.INVALID_ARGUMENT, "outside"),
    ("greedy block with q", "greedy", False, PROMPT, edit(lambda b: b.q.CopyFrom(good_q([10, 11, 12]))),
     C.INVALID_ARGUMENT, "greedy"),
    ("sampling block without q", "sample", False, PROMPT, edit(lambda b: b.ClearField("q")), C.INVALID_ARGUMENT,
     "must carry q"),
    ("q support 0", "sample", False, PROMPT, edit(lambda b: setattr(b.q, "support", 0)),
     C.INVALID_ARGUMENT, "support must be >= 1"),
    ("q support above vocab", "sample", False, PROMPT, edit(lambda b: setattr(b.q, "support", VOCAB + 1)),
     C.INVALID_ARGUMENT, "exceeds the vocabulary"),
    ("q ids shape mismatch", "sample", False, PROMPT, edit(lambda b: b.q.ids.pop()), C.INVALID_ARGUMENT,
     "q.ids has 11 entries"),
    ("q rows fewer than drafts", "sample", False, PROMPT,
     edit(lambda b: b.q.CopyFrom(good_q([10, 11]))), C.INVALID_ARGUMENT, "expected k * support"),
    ("q probs bytes short", "sample", False, PROMPT, edit(lambda b: setattr(b.q, "probs", b.q.probs[:-2])),
     C.INVALID_ARGUMENT, "q.probs has 22 bytes"),
    ("q probs odd bytes", "sample", False, PROMPT, edit(lambda b: setattr(b.q, "probs", b.q.probs + b"\0")),
     C.INVALID_ARGUMENT, "q.probs has 25 bytes"),
    ("q probs NaN", "sample", False, PROMPT, edit(lambda b: set_prob(b, 1, np.nan)), C.INVALID_ARGUMENT, "NaN"),
    ("q probs inf", "sample", False, PROMPT, edit(lambda b: set_prob(b, 2, np.inf)), C.INVALID_ARGUMENT,
     "infinity"),
    ("q probs negative", "sample", False, PROMPT, edit(lambda b: set_prob(b, 5, -0.25)), C.INVALID_ARGUMENT,
     "negative probability"),
    ("q row without mass", "sample", False, PROMPT,
     edit(lambda b: [set_prob(b, i, 0.0) for i in range(4, 8)]), C.INVALID_ARGUMENT, "no probability mass"),
    ("q id out of vocab", "sample", False, PROMPT, edit(lambda b: b.q.ids.__setitem__(3, VOCAB)),
     C.INVALID_ARGUMENT, "q.ids contains token id"),
    ("q id negative", "sample", False, PROMPT, edit(lambda b: b.q.ids.__setitem__(3, -1)), C.INVALID_ARGUMENT,
     "q.ids contains a negative"),
    ("q ids repeated in a row", "sample", False, PROMPT, edit(lambda b: b.q.ids.__setitem__(1, b.q.ids[0])),
     C.INVALID_ARGUMENT, "repeats a token id"),
    ("draft outside its q support (row sums to 1)", "sample", False, PROMPT,
     edit(lambda b: b.q.ids.__setitem__(0, 50)), C.INVALID_ARGUMENT, "probability 0"),
    ("draft with q probability 0", "sample", False, PROMPT, edit(lambda b: set_prob(b, 0, 0.0)),
     C.INVALID_ARGUMENT, "probability 0"),
    ("q on an empty block", "sample", False, PROMPT, edit(_drafts([])), C.INVALID_ARGUMENT,
     "no draft ids"),
    ("draft_ms negative", "greedy", False, PROMPT, edit(_set(draft_ms=-1.0)), C.INVALID_ARGUMENT, "draft_ms"),
    ("draft_ms NaN", "sample", False, PROMPT, edit(_set(draft_ms=math.nan)), C.INVALID_ARGUMENT, "draft_ms"),
]


async def v_session(env, mode, warm, prompt):
    """Open a session (and verify a first empty block when warm); return (call, valid block)."""
    call = env.verifier.Verify(timeout=20)
    await call.write(v_open(prompt, temperature=1.0 if mode == "sample" else 0.0))
    ready = await call.read()
    assert ready.WhichOneof("kind") == "ready", ready
    seq, committed = 1, len(prompt)
    if warm:
        await call.write(block_req(good_block(mode, 1, committed, drafts=())))
        reply = await call.read()
        assert reply.WhichOneof("kind") == "result", reply
        seq, committed = 2, reply.result.committed_length
    return call, good_block(mode, seq, committed)


def outcome(result):
    return (result.seq, result.accepted, result.next_token, result.is_bonus, result.committed_length)


@pytest.mark.parametrize("name,mode,warm,prompt,mutation,status,fragment", V_STREAM_CASES,
                         ids=[c[0] for c in V_STREAM_CASES])
async def test_verifier_in_stream_errors(env, name, mode, warm, prompt, mutation, status, fragment):
    key = (mode, warm, len(prompt))
    if key not in env.controls:
        call, block = await v_session(env, mode, warm, prompt)
        await call.write(block_req(block))
        env.controls[key] = outcome((await call.read()).result)
        call.cancel()
    call, block = await v_session(env, mode, warm, prompt)
    try:
        await check_in_stream(env, call, block, mutation(block), status, fragment, key)
    finally:
        call.cancel()


async def check_in_stream(env, call, block, bad, status, fragment, key):
    await call.write(bad)
    reply = await call.read()
    assert reply.WhichOneof("kind") == "error", reply
    assert reply.error.code == code(status), reply.error.message
    assert fragment in reply.error.message
    if bad.WhichOneof("kind") == "block":
        assert reply.error.seq == bad.block.seq
    # the session is unchanged: the valid block gets exactly a fresh session's answer
    await call.write(block_req(block))
    reply = await call.read()
    assert reply.WhichOneof("kind") == "result", reply
    assert outcome(reply.result) == env.controls[key]
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF


V_ABORT_CASES = [
    ("block before open", verifier_pb2.VerifyRequest(block=good_block("greedy", 1, 4)), C.FAILED_PRECONDITION,
     "must be VerifyOpen"),
    ("close before open", verifier_pb2.VerifyRequest(close=verifier_pb2.VerifyClose()), C.FAILED_PRECONDITION,
     "must be VerifyOpen"),
    ("empty first request", verifier_pb2.VerifyRequest(), C.FAILED_PRECONDITION, "empty VerifyRequest"),
    ("empty prompt", v_open(prompt=[]), C.INVALID_ARGUMENT, "prompt_ids is empty"),
    ("negative prompt id", v_open(prompt=[3, -1]), C.INVALID_ARGUMENT, "negative token id"),
    ("out-of-vocab prompt id", v_open(prompt=[3, VOCAB]), C.INVALID_ARGUMENT, "outside the vocabulary"),
    ("prompt longer than context", v_open(prompt=[1] * (CONTEXT + 1)), C.OUT_OF_RANGE, "context"),
    ("temperature negative", v_open(temperature=-1.0), C.INVALID_ARGUMENT, "temperature"),
    ("temperature NaN", v_open(temperature=math.nan), C.INVALID_ARGUMENT, "temperature"),
    ("temperature inf", v_open(temperature=math.inf), C.INVALID_ARGUMENT, "temperature"),
    ("temperature above 100", v_open(temperature=1000.0), C.INVALID_ARGUMENT, "temperature"),
    ("temperature tiny", v_open(temperature=1e-40), C.INVALID_ARGUMENT, "at least 1e-05"),
    ("top_p above 1", v_open(temperature=1.0, top_p=1.5), C.INVALID_ARGUMENT, "top-p"),
    ("top_p negative", v_open(temperature=1.0, top_p=-0.5), C.INVALID_ARGUMENT, "top-p"),
    ("top_p NaN", v_open(temperature=1.0, top_p=math.nan), C.INVALID_ARGUMENT, "top_p"),
    ("top_k huge", v_open(temperature=1.0, top_k=10**9), C.INVALID_ARGUMENT, "top_k"),
    ("max_k above limit", v_open(max_k=65), C.INVALID_ARGUMENT, "max_k 65"),
    ("steering without a head", v_open(steering=True), C.FAILED_PRECONDITION, "--steering-head"),
    ("oversized message", v_open(prompt=list(range(90)) * 2000), C.RESOURCE_EXHAUSTED, ""),
]


async def assert_verifier_serves(env):
    call = env.verifier.Verify(timeout=20)
    await call.write(v_open())
    assert (await call.read()).WhichOneof("kind") == "ready"
    await call.write(block_req(good_block("greedy", 1, 4)))
    assert (await call.read()).WhichOneof("kind") == "result"
    call.cancel()


@pytest.mark.parametrize("name,request_,status,fragment", V_ABORT_CASES, ids=[c[0] for c in V_ABORT_CASES])
async def test_verifier_stream_aborts(env, name, request_, status, fragment):
    call = env.verifier.Verify(timeout=20)
    await call.write(request_)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == status, info.value.details()
    assert fragment in (info.value.details() or "")
    await assert_verifier_serves(env)
    get = lambda: env.verifier.GetVerifierStats(verifier_pb2.GetVerifierStatsRequest())  # noqa: E731
    stats = await wait_for_stats(get, lambda r: r.stats.active_sessions == 0)
    assert stats.stats.active_sessions == 0


async def test_verifier_duplicate_session_id(env):
    first = env.verifier.Verify(timeout=20)
    await first.write(v_open(session_id="dup"))
    assert (await first.read()).WhichOneof("kind") == "ready"
    second = env.verifier.Verify(timeout=20)
    await second.write(v_open(session_id="dup"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await second.read()
    assert info.value.code() == C.ALREADY_EXISTS and "already open" in info.value.details()
    await first.write(block_req(good_block("greedy", 1, 4)))  # the first session is untouched
    assert (await first.read()).WhichOneof("kind") == "result"
    first.cancel()


# ============================================================================ drafter


def d_open(prompt=PROMPT, temperature=0.0, k=4, **kw) -> drafter_pb2.DraftRequest:
    return drafter_pb2.DraftRequest(open=drafter_pb2.DraftOpen(
        prompt_ids=prompt, sampling=sampling_pb(temperature, 0, kw.pop("top_p", 1.0)), k=k,
        draft_top_k=kw.pop("draft_top_k", 8), seed=5, **kw))


def steer(n=HIDDEN, dtype="float16", **kw):
    msg = wire.tensor_to_proto(torch.ones(n), dtype if dtype in wire.WIRE_DTYPES else "float16")
    if dtype not in wire.WIRE_DTYPES:
        msg.dtype = dtype
    for name, value in kw.items():
        if name == "shape":
            del msg.shape[:]
            msg.shape.extend(value)
        else:
            setattr(msg, name, value)
    return msg


NAN_STEER = steer(data=np.array([np.nan] * HIDDEN, "<f2").tobytes())
BAD_STEERING = [
    ("dtype int8", steer(dtype="int8"), "dtype"),
    ("wrong size", steer(n=HIDDEN + 1), "expected 32"),
    ("bytes too short", steer(data=b"\0" * 10), "bytes"),
    ("NaN", NAN_STEER, "NaN"),
    ("empty shape", steer(shape=[]), "shape"),
    # 1824726041 · 315916329 = 1 + 2⁵⁹, so this shape's int64 product wraps to 32: the size check must hold
    ("shape overflowing int64", steer(shape=[HIDDEN, 1824726041, 315916329]), f"expected {HIDDEN}"),
]

D_ABORT_CASES = [
    ("feedback before open", "plain", drafter_pb2.DraftRequest(feedback=drafter_pb2.DraftFeedback()),
     C.FAILED_PRECONDITION, "must be DraftOpen"),
    ("close before open", "plain", drafter_pb2.DraftRequest(close=drafter_pb2.DraftClose()), C.FAILED_PRECONDITION,
     "must be DraftOpen"),
    ("empty first request", "plain", drafter_pb2.DraftRequest(), C.FAILED_PRECONDITION, "empty DraftRequest"),
    ("empty prompt", "plain", d_open(prompt=[]), C.INVALID_ARGUMENT, "prompt_ids is empty"),
    ("negative prompt id", "plain", d_open(prompt=[-5]), C.INVALID_ARGUMENT, "negative"),
    ("out-of-vocab prompt id", "plain", d_open(prompt=[1, 2, 1000]), C.INVALID_ARGUMENT, "outside the vocabulary"),
    ("prompt fills the context", "plain", d_open(prompt=[1] * CONTEXT), C.OUT_OF_RANGE, "context"),
    ("k above limit", "plain", d_open(k=65), C.INVALID_ARGUMENT, "k 65"),
    ("draft_top_k above vocab", "plain", d_open(temperature=1.0, draft_top_k=VOCAB + 1), C.INVALID_ARGUMENT,
     "draft_top_k"),
    ("unknown policy", "plain", d_open(policy="no-such-policy"), C.INVALID_ARGUMENT, "unknown draft-length policy"),
    ("temperature negative", "plain", d_open(temperature=-0.5), C.INVALID_ARGUMENT, "temperature"),
    ("temperature tiny", "plain", d_open(temperature=1e-40), C.INVALID_ARGUMENT, "at least 1e-05"),
    ("top_p above 1", "plain", d_open(temperature=1.0, top_p=2.0), C.INVALID_ARGUMENT, "top-p"),
    ("steering on a plain drafter", "plain", d_open(steering=steer()), C.FAILED_PRECONDITION,
     "no SD² steering weights"),
] + [(f"open steering {n}", "steered", d_open(steering=t), C.INVALID_ARGUMENT, f) for n, t, f in BAD_STEERING]


def d_stub(env, which):
    return env.drafter if which == "plain" else env.steered


@pytest.mark.parametrize("name,which,request_,status,fragment", D_ABORT_CASES, ids=[c[0] for c in D_ABORT_CASES])
async def test_drafter_stream_aborts(env, name, which, request_, status, fragment):
    stub = d_stub(env, which)
    call = stub.Draft(timeout=20)
    await call.write(request_)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == status, info.value.details()
    assert fragment in info.value.details()
    call = stub.Draft(timeout=20)  # still serving
    await call.write(d_open())
    assert (await call.read()).WhichOneof("kind") == "block"
    call.cancel()


def feedback(block, accepted=1, next_token=7, want_block=True, **result_fields) -> drafter_pb2.DraftRequest:
    k = len(block.draft_ids)
    result = common_pb2.VerifyResult(seq=block.seq, accepted=accepted, next_token=next_token,
                                     is_bonus=accepted == k, committed_length=block.committed_length + accepted + 1)
    for name, value in result_fields.items():
        if name == "steering":
            result.steering.CopyFrom(value)
        else:
            setattr(result, name, value)
    return drafter_pb2.DraftRequest(feedback=drafter_pb2.DraftFeedback(result=result, want_block=want_block))


def fb(**kw):
    return lambda block: feedback(block, **kw)


D_STREAM_CASES = [
    # (name, drafter, warm, max_new_tokens, bad request from the open block, code, fragment)
    ("double open", "plain", False, 0, lambda b: d_open(), C.FAILED_PRECONDITION, "already open"),
    ("empty request", "plain", False, 0, lambda b: drafter_pb2.DraftRequest(), C.INVALID_ARGUMENT,
     "empty DraftRequest"),
    ("feedback without result", "plain", False, 0,
     lambda b: drafter_pb2.DraftRequest(feedback=drafter_pb2.DraftFeedback(want_block=True)), C.INVALID_ARGUMENT,
     "no result"),
    ("feedback for a seq never sent", "plain", False, 0, fb(seq=7), C.NOT_FOUND, "never sent"),
    ("feedback for seq 0", "plain", False, 0, fb(seq=0), C.NOT_FOUND, "never sent"),
    ("feedback applied twice", "plain", True, 0, lambda b: feedback(b, seq=b.seq - 1), C.FAILED_PRECONDITION,
     "already applied"),
    ("accepted above k", "plain", False, 0, fb(accepted=5, is_bonus=True, committed_length=10), C.INVALID_ARGUMENT,
     "drafted only 4"),
    ("next_token out of vocab", "plain", False, 0, fb(next_token=VOCAB), C.INVALID_ARGUMENT, "next_token"),
    ("next_token negative", "plain", False, 0, fb(next_token=-2), C.INVALID_ARGUMENT, "next_token"),
    ("committed_length mismatch", "plain", False, 0, fb(committed_length=99), C.INVALID_ARGUMENT,
     "committed_length 99"),
    ("is_bonus contradicts accepted", "plain", False, 0, fb(is_bonus=True), C.INVALID_ARGUMENT, "is_bonus"),
    ("block past max_new_tokens", "plain", False, 2, fb(), C.OUT_OF_RANGE, "max_new_tokens"),
    ("steering on a plain drafter", "plain", False, 0, fb(steering=steer()), C.FAILED_PRECONDITION,
     "no SD² steering weights"),
] + [(f"feedback steering {n}", "steered", False, 0, fb(steering=t), C.INVALID_ARGUMENT, f)
     for n, t, f in BAD_STEERING]


async def d_session(env, which, warm, max_new_tokens):
    call = d_stub(env, which).Draft(timeout=20)
    await call.write(d_open(k=4, max_new_tokens=max_new_tokens))
    block = (await call.read()).block
    if warm:
        await call.write(feedback(block, accepted=0, next_token=9))
        block = (await call.read()).block
    return call, block


@pytest.mark.parametrize("name,which,warm,budget,make_bad,status,fragment", D_STREAM_CASES,
                         ids=[c[0] for c in D_STREAM_CASES])
async def test_drafter_in_stream_errors(env, name, which, warm, budget, make_bad, status, fragment):
    key = ("drafter", which, warm, budget)
    valid = (lambda b: feedback(b, want_block=False)) if budget else feedback
    if key not in env.controls:
        call, block = await d_session(env, which, warm, budget)
        await call.write(valid(block))
        env.controls[key] = None if budget else (await call.read()).block.SerializeToString()
        call.cancel()
    call, block = await d_session(env, which, warm, budget)
    try:
        await check_drafter_in_stream(env, call, block, make_bad(block), valid, status, fragment, key, budget)
    finally:
        call.cancel()


async def check_drafter_in_stream(env, call, block, bad, valid, status, fragment, key, budget):
    await call.write(bad)
    reply = await call.read()
    assert reply.WhichOneof("kind") == "error", reply
    assert reply.error.code == code(status), reply.error.message
    assert fragment in reply.error.message
    await call.write(valid(block))  # the session is unchanged: the valid feedback gets a fresh session's block
    if budget:
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        return
    nxt = (await call.read()).block
    control = common_pb2.DraftBlock.FromString(env.controls[key])
    for blk in (nxt, control):  # timings, and what drafting ahead managed in the time it had
        blk.draft_ms = blk.ahead_ms = 0.0
        blk.ahead_prepared, blk.ahead_hit = 0, False
    assert nxt == control
    call.cancel()


@pytest.mark.asyncio(loop_scope="module")
async def test_at_least_fifty_kinds():
    kinds = len(V_STREAM_CASES) + len(V_ABORT_CASES) + 1 + len(D_ABORT_CASES) + len(D_STREAM_CASES)
    assert kinds >= 50, kinds

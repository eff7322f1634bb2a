"""The drafter gRPC service, alone and driving the verifier service: exact end-to-end decoding."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import pytest_asyncio
import torch
from service_helpers import drive, greedy_reference, make_tiny_llama, sampling_pb, wait_for_stats

from drafter_service.server import DrafterConfig
from drafter_service.server import serve as serve_drafter
from steerspec.serving import wire
from steerspec.decoding.engine import DecodeConfig, autoregressive_generate
from steerspec.models import CachedLM, load_model
from steerspec.decoding.sampling import SamplingParams, draft_distribution, probs_from_logits
from steerspec.steering import DrafterSteering, attach_steering
from steerspec.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2_grpc
from verifier_service.server import VerifierConfig
from verifier_service.server import serve as serve_verifier

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]


class Pair:
    """A drafter server and a verifier server with client stubs."""

    async def start(self, drafter, verifier, hooks=None):
        self.drafter_model, self.verifier_model, self.hooks = drafter, verifier, hooks
        self.d_running, self.d_servicer = await serve_drafter(drafter, DrafterConfig(), hooks=hooks)
        self.v_running, self.v_servicer = await serve_verifier(verifier, VerifierConfig(batch_window_ms=5.0))
        self.d_channel = grpc.aio.insecure_channel(self.d_running.target)
        self.v_channel = grpc.aio.insecure_channel(self.v_running.target)
        self.drafter = drafter_pb2_grpc.DrafterServiceStub(self.d_channel)
        self.verifier = verifier_pb2_grpc.VerifierServiceStub(self.v_channel)
        return self

    async def stats(self):
        return (await self.drafter.GetDrafterStats(drafter_pb2.GetDrafterStatsRequest(), timeout=10)).stats

    async def stop(self):
        for channel in (self.d_channel, self.v_channel):
            await channel.close()
        await self.d_running.stop(0.5)
        await self.v_running.stop(0.5)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("pair")
    verifier = load_model(str(make_tiny_llama(root / "v", seed=0)))
    drafter = load_model(str(make_tiny_llama(root / "d", seed=0, num_hidden_layers=2)))
    return drafter, verifier


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair(models):
    drafter, verifier = models
    steering = DrafterSteering.for_model(drafter, steer_dim=verifier.config.hidden_size)
    with torch.no_grad():
        steering.proj.weight.normal_(0, 2.0)
    hooks = attach_steering(drafter, steering.eval())
    p = await Pair().start(drafter, verifier, hooks)
    yield p
    await p.stop()


async def open_drafter(stub, prompt, temperature=0.0, k=4, draft_top_k=16, max_new_tokens=0, seed=0, steering=None):
    call = stub.Draft(timeout=60)
    msg = drafter_pb2.DraftOpen(prompt_ids=prompt, sampling=sampling_pb(temperature), k=k, draft_top_k=draft_top_k,
                                max_new_tokens=max_new_tokens, seed=seed)
    if steering is not None:
        msg.steering.CopyFrom(steering)
    await call.write(drafter_pb2.DraftRequest(open=msg))
    return call, await call.read()


def local_greedy_drafts(model, prompt, k):
    lm = CachedLM(model)
    feed, out = list(prompt), []
    for _ in range(k):
        token = int(lm.extend(feed, logits_to_keep=1).logits.argmax(-1))
        out.append(token)
        feed = [token]
    return out


async def test_speculative_greedy_equals_verifier_only_concurrently(pair):
    """8 concurrent sessions through both services: each output equals its own verifier-only greedy output."""
    prompts = [[5, 6, 7, 8], [9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [40, 41], [3, 3, 3], [60, 2, 8], [17], [90, 1]]
    refs = [greedy_reference(pair.verifier_model, p, 20) for p in prompts]
    outs = await asyncio.gather(*[drive(pair.drafter, pair.verifier, p, 20, k=1 + i % 5)
                                  for i, p in enumerate(prompts)])
    assert outs == refs
    assert pair.v_servicer.batcher.batched_blocks > pair.v_servicer.batcher.batches  # some blocks shared a pass
    stats = await wait_for_stats(pair.stats, lambda s: s.active_sessions == 0)
    assert stats.active_sessions == 0 and stats.cache_bytes == 0


async def test_bundled_pair_greedy_exact(loaded_pair):
    """The suite's model pair (the bundled verifier + pretrained drafter when installed, else the
    tiny pair of conftest.py): speculative greedy output over gRPC equals the verifier's own."""
    verifier, drafter, tokenizer = loaded_pair
    prompts = [tokenizer("def fibonacci(n):")["input_ids"], tokenizer("import os\n")["input_ids"]]
    p = await Pair().start(drafter, verifier)
    try:
        outs = await asyncio.gather(*[drive(p.drafter, p.verifier, prompt, 24, k=6) for prompt in prompts])
        for prompt, out in zip(prompts, outs):  # the project's own verifier-only greedy decoding
            config = DecodeConfig(max_new_tokens=24, sampling=SamplingParams(temperature=0.0))
            assert out == autoregressive_generate(verifier, prompt, config).token_ids
    finally:
        await p.stop()


async def test_greedy_block_is_ids_only(pair):
    prompt = [5, 6, 7, 8]
    call, reply = await open_drafter(pair.drafter, prompt, k=5)
    block = reply.block
    assert not block.HasField("q") and block.seq == 1 and block.committed_length == 4 and block.draft_ms > 0
    assert list(block.draft_ids) == local_greedy_drafts(pair.drafter_model, prompt, 5)
    call.cancel()


async def test_sampling_block_carries_the_wire_distribution(pair):
    prompt = [5, 6, 7, 8]
    call, reply = await open_drafter(pair.drafter, prompt, temperature=30.0, k=3, draft_top_k=16, seed=4)
    block = reply.block
    assert block.q.support == 16 and len(block.q.ids) == 3 * 16 and len(block.q.probs) == 2 * 3 * 16
    decoded = wire.decode_block(block, pair.verifier_model.config.vocab_size, greedy=False)
    with torch.inference_mode():
        logits = pair.drafter_model(input_ids=torch.tensor([prompt])).logits[:, -1]
    expect = draft_distribution(probs_from_logits(logits, 30.0), 16)
    assert torch.equal(decoded.q.ids[0], expect.ids[0])
    assert torch.equal(decoded.q.probs[0], expect.probs[0]) and torch.equal(decoded.q.floor[0], expect.floor[0])
    assert (decoded.q.floor > 0).all(), "T=30 leaves mass outside the top 16, spread over the other ids"
    assert (decoded.q.prob_of(torch.tensor(list(block.draft_ids))) > 0).all()
    call.cancel()


async def test_never_drafts_past_max_new_tokens(pair):
    call, reply = await open_drafter(pair.drafter, [5, 6, 7], k=8, max_new_tokens=3)
    block = reply.block
    assert len(block.draft_ids) == 2  # the verifier adds the third token itself
    result = {"seq": 1, "accepted": 0, "next_token": 9, "committed_length": 4}
    feedback = drafter_pb2.DraftFeedback(result=dict(result), want_block=True)
    await call.write(drafter_pb2.DraftRequest(feedback=feedback))
    block = (await call.read()).block
    assert block.seq == 2 and block.committed_length == 4 and len(block.draft_ids) == 1
    feedback = drafter_pb2.DraftFeedback(result={"seq": 2, "accepted": 0, "next_token": 9, "committed_length": 5},
                                         want_block=True)
    await call.write(drafter_pb2.DraftRequest(feedback=feedback))
    block = (await call.read()).block
    assert block.seq == 3 and len(block.draft_ids) == 0  # one token left: an empty block
    feedback.result.seq, feedback.result.committed_length, feedback.result.is_bonus = 3, 6, True
    await call.write(drafter_pb2.DraftRequest(feedback=feedback))
    reply = await call.read()
    assert reply.error.code == grpc.StatusCode.OUT_OF_RANGE.value[0] and "max_new_tokens" in reply.error.message
    feedback.want_block = False  # the last result: roll back only, no reply
    await call.write(drafter_pb2.DraftRequest(feedback=feedback))
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF


async def test_seeded_sampled_generation(pair):
    run = lambda seed: drive(pair.drafter, pair.verifier, [5, 6, 7], 16, temperature=30.0, seed=seed, k=3)  # noqa: E731
    a, b = await asyncio.gather(run(1), run(1))
    assert a == b and len(a) == 16
    assert await run(2) != a


async def _scripted_session(stub, prompt, temperature, seed, steering, rounds=4):
    """Open a Draft stream and run `rounds` blocks with scripted feedback (all / none / half accepted,
    a new steering vector in the second result); returns the blocks."""
    call, reply = await open_drafter(stub, prompt, temperature=temperature, k=5, draft_top_k=16, seed=seed,
                                     steering=None if steering is None else wire.tensor_to_proto(steering))
    blocks = [reply.block]
    for r in range(rounds - 1):
        block = blocks[-1]
        drafted = len(block.draft_ids)
        accepted = (drafted, 0, drafted // 2)[(r + seed) % 3]
        result = {"seq": block.seq, "accepted": accepted, "next_token": (13 * r + seed) % 90 + 3,
                  "is_bonus": accepted == drafted, "committed_length": block.committed_length + accepted + 1}
        if steering is not None and r == 1:
            result["steering"] = wire.tensor_to_proto(-steering)
        await call.write(drafter_pb2.DraftRequest(feedback=drafter_pb2.DraftFeedback(result=result, want_block=True)))
        reply = await call.read()
        assert reply.WhichOneof("kind") == "block", reply
        blocks.append(reply.block)
    call.cancel()
    return blocks


async def test_concurrent_sessions_are_drafted_in_batches_exactly(pair):
    """Sessions asking together share batched passes (--draft-batch-window-ms) and get exactly the blocks
    they get one at a time: same tokens and q ids, q probs to fp32 noise (one fp16 ulp at most)."""
    g = torch.randn(pair.verifier_model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    specs = [([5, 6, 7, 8], 0.0, 1, g), ([9], 30.0, 2, 0.5 * g), (list(range(1, 11)), 30.0, 3, None),
             ([40, 41], 0.0, 4, None)]
    alone = [await _scripted_session(pair.drafter, *spec) for spec in specs]
    running, servicer = await serve_drafter(pair.drafter_model, DrafterConfig(batch_window_ms=500.0),
                                            hooks=pair.hooks)
    # a CPU drafter drafts on the one thread that owns its model, off the loop (serving/priority_worker.py)
    assert not servicer.batcher.inline and servicer.batcher.executor is servicer.worker
    threads, draft_many = set(), servicer.batcher.compute

    def compute(jobs):
        threads.add(threading.get_ident())
        return draft_many(jobs)

    servicer.batcher.compute = compute
    channel = grpc.aio.insecure_channel(running.target)
    try:
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        together = await asyncio.gather(*[_scripted_session(stub, *spec) for spec in specs])
        assert servicer.batcher.max_batch_seen >= 2 and servicer.batcher.batched_blocks > servicer.batcher.batches
        assert threads == {servicer.worker.thread.ident}
    finally:
        await channel.close()
        await running.stop(0.5)
    vocab = pair.drafter_model.config.vocab_size
    for (_, temperature, _, _), got, want in zip(specs, together, alone):
        for a, b in zip(got, want):
            assert (a.seq, a.committed_length, list(a.draft_ids)) == (b.seq, b.committed_length, list(b.draft_ids))
            if temperature > 0:
                qa, qb = (wire.decode_block(x, vocab, greedy=False).q for x in (a, b))
                assert torch.equal(qa.ids, qb.ids)
                torch.testing.assert_close(qa.probs, qb.probs, atol=1e-5, rtol=1e-3)


async def test_steering_vector_changes_the_drafts_as_in_process(pair):
    prompt = [5, 6, 7, 8]
    g = torch.randn(pair.verifier_model.config.hidden_size)
    call, reply = await open_drafter(pair.drafter, prompt, k=4, steering=wire.tensor_to_proto(g))
    steered = list(reply.block.draft_ids)
    call.cancel()
    pair.hooks.set_vector(g.half().float().unsqueeze(0))
    try:
        expect = local_greedy_drafts(pair.drafter_model, prompt, 4)
    finally:
        pair.hooks.clear()
    assert steered == expect
    assert steered != local_greedy_drafts(pair.drafter_model, prompt, 4)
    # a vector in feedback steers the next block; without one the last vector stays in force
    call, reply = await open_drafter(pair.drafter, prompt, k=1)
    token = reply.block.draft_ids[0]
    result = {"seq": 1, "accepted": 1, "next_token": 3, "is_bonus": True, "committed_length": 6,
              "steering": wire.tensor_to_proto(g)}
    await call.write(drafter_pb2.DraftRequest(feedback=drafter_pb2.DraftFeedback(result=result, want_block=True)))
    block = (await call.read()).block
    pair.hooks.set_vector(g.half().float().unsqueeze(0))
    try:
        expect = local_greedy_drafts(pair.drafter_model, prompt + [token, 3], 1)
    finally:
        pair.hooks.clear()
    assert list(block.draft_ids) == expect
    call.cancel()


async def test_stream_end_and_cancel_free_the_session(pair):
    call, _ = await open_drafter(pair.drafter, list(range(1, 20)))
    stats = await pair.stats()
    assert stats.active_sessions == 1 and stats.cache_bytes > 0
    await call.write(drafter_pb2.DraftRequest(close=drafter_pb2.DraftClose(reason="done")))
    stats = await wait_for_stats(pair.stats, lambda s: s.active_sessions == 0)
    assert stats.active_sessions == 0 and stats.cache_bytes == 0
    call, _ = await open_drafter(pair.drafter, list(range(1, 20)))
    call.cancel()
    stats = await wait_for_stats(pair.stats, lambda s: s.active_sessions == 0)
    assert stats.active_sessions == 0 and stats.cache_bytes == 0


async def test_drafter_limits_sessions_and_expires_idle_ones(models):
    drafter, _ = models
    running, _ = await serve_drafter(drafter, DrafterConfig(max_sessions=1, idle_timeout_s=0.4))
    channel = grpc.aio.insecure_channel(running.target)
    stub = drafter_pb2_grpc.DrafterServiceStub(channel)
    try:
        call, reply = await open_drafter(stub, [5, 6, 7])
        assert reply.WhichOneof("kind") == "block"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await open_drafter(stub, [5, 6, 7])
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-sessions 1" in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()  # nothing sent for 0.4 s: the session expires
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "idle" in info.value.details()
        call, reply = await open_drafter(stub, [5, 6, 7])  # its slot is free again
        assert reply.WhichOneof("kind") == "block"
        call.cancel()
    finally:
        await channel.close()
        await running.stop(0.5)

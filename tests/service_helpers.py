"""Shared helpers for the service tests: tiny random Llama checkpoints and server start-up."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=96, initializer_range=0.2)


def make_tiny_llama(directory: Path, seed: int, **overrides) -> Path:
    """Save a tiny random LlamaForCausalLM (SwiGLU) into `directory` and return it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY, **overrides}, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger logits so argmaxes are well separated (no near-ties)
        model.lm_head.weight.mul_(64.0)
    model.save_pretrained(str(directory))
    return Path(directory)


def greedy_reference(model, prompt, n):
    """Verifier-only greedy decoding with a plain full forward each step (no cache)."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


async def drive(drafter_stub, verifier_stub, prompt, max_new_tokens, *, temperature=0.0, seed=0, k=4,
                draft_top_k=16, steering=False, timings=None):
    """One generation through a Draft stream and a Verify stream (a minimal coordinator loop).

    Returns the generated ids (exactly max_new_tokens). `timings`, when a list, gets one
    (round_trip_ms, draft_ms, queue_ms + verify_ms) tuple per block."""
    import time

    from steerspec.v1 import common_pb2, drafter_pb2, verifier_pb2

    sampling = common_pb2.SamplingParams(temperature=temperature, top_p=1.0)
    vcall = verifier_stub.Verify()
    await vcall.write(verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(
        prompt_ids=prompt, sampling=sampling, seed=seed, max_k=k, steering=steering)))
    ready = await vcall.read()
    assert ready.WhichOneof("kind") == "ready", ready
    dcall = drafter_stub.Draft()
    await dcall.write(drafter_pb2.DraftRequest(open=drafter_pb2.DraftOpen(
        prompt_ids=prompt, sampling=sampling, seed=seed, k=k, draft_top_k=draft_top_k,
        steering=ready.ready.steering, max_new_tokens=max_new_tokens)))
    generated = []
    while True:
        t0 = time.perf_counter()
        reply = await dcall.read()
        assert reply.WhichOneof("kind") == "block", reply
        block = reply.block
        await vcall.write(verifier_pb2.VerifyRequest(block=block))
        answer = await vcall.read()
        assert answer.WhichOneof("kind") == "result", answer
        result = answer.result
        new = list(block.draft_ids[: result.accepted]) + [result.next_token]
        generated.extend(new)
        done = len(generated) >= max_new_tokens
        feedback = drafter_pb2.DraftFeedback(result=result, want_block=not done)
        await dcall.write(drafter_pb2.DraftRequest(feedback=feedback))
        if timings is not None:
            t1 = time.perf_counter()
            timings.append(((t1 - t0) * 1e3, block.draft_ms, result.queue_ms + result.verify_ms))
        if done:
            break
    await dcall.done_writing()
    await vcall.done_writing()
    assert await dcall.read() is grpc_eof()
    assert await vcall.read() is grpc_eof()
    return generated[:max_new_tokens]


def grpc_eof():
    import grpc.aio

    return grpc.aio.EOF


def sampling_pb(temperature=0.0, top_k=0, top_p=1.0):
    from steerspec.v1 import common_pb2

    return common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)


async def open_verifier(stub, prompt, temperature=0.0, seed=0, max_k=8, steering=False, session_id="", timeout=60):
    """Open a Verify stream; returns (call, VerifyResponse of the open)."""
    from steerspec.v1 import verifier_pb2

    call = stub.Verify(timeout=timeout)
    await call.write(verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(
        session_id=session_id, prompt_ids=prompt, sampling=sampling_pb(temperature), seed=seed, max_k=max_k,
        steering=steering)))
    return call, await call.read()


async def verify(call, seq, committed_length, draft_ids, q=None):
    """Send one DraftBlock (q: SparseDistribution or None) and return the VerifyResponse."""
    from steerspec.v1 import common_pb2, verifier_pb2

    block = common_pb2.DraftBlock(seq=seq, committed_length=committed_length, draft_ids=draft_ids)
    if q is not None:
        block.q.CopyFrom(q)
    await call.write(verifier_pb2.VerifyRequest(block=block))
    return await call.read()


async def wait_for_stats(get_stats, predicate, timeout=5.0):
    """Poll a stats coroutine until predicate(stats) holds; return the last stats."""
    import asyncio
    import time

    end = time.monotonic() + timeout
    while True:
        stats = await get_stats()
        if predicate(stats) or time.monotonic() > end:
            return stats
        await asyncio.sleep(0.02)

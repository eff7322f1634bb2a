"""Client SDK: sync/async streaming, text, retries on UNAVAILABLE, resume without lost or repeated tokens."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from coord_helpers import greedy_reference
from coordinator.client import Chunk, Client, ResumeMismatch, Summary, _Dedup
from coordinator.local import LocalCluster
from coordinator.server import Coordinator, serve
from steerspec.serving.store import RedisStore
from steerspec.serving.linkemu import LinkModel
from steerspec.v1 import coordinator_pb2

PROMPT = [5, 17, 42, 9]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
async def cluster(tiny_pair):
    verifier, drafter = tiny_pair
    async with LocalCluster(str(verifier), str(drafter), eos_ids=()) as c:
        yield c


async def test_sync_generate_streams_chunks_then_summary(cluster, tiny_pair):
    want = greedy_reference(tiny_pair[0], PROMPT, 12)

    def call():
        with cluster.client() as client:
            return list(client.generate(prompt_ids=PROMPT, max_new_tokens=12, k=4, timeout=60))

    items = await asyncio.to_thread(call)
    assert all(isinstance(i, Chunk) for i in items[:-1]) and isinstance(items[-1], Summary)
    assert [t for c in items[:-1] for t in c.token_ids] == want == items[-1].token_ids
    summary = items[-1]
    assert summary.rounds == len(items) - 1 and summary.block_efficiency > 1.0
    assert set(summary.stage_ms) == {"draft", "network", "queue", "verify", "overhead"}


async def test_text_prompt_and_generate_text(cluster, tiny_pair):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    prompt_ids = tokenizer("def fibonacci(n):", add_special_tokens=False)["input_ids"]
    want = tokenizer.decode(greedy_reference(tiny_pair[0], prompt_ids, 10), skip_special_tokens=True)

    def call():
        with cluster.client() as client:
            chunks = [i for i in client.generate("def fibonacci(n):", max_new_tokens=10) if isinstance(i, Chunk)]
            return client.generate_text("def fibonacci(n):", max_new_tokens=10), "".join(c.text for c in chunks)

    text, streamed = await asyncio.to_thread(call)
    assert text == want == streamed


async def test_async_generate(cluster, tiny_pair):
    want = greedy_reference(tiny_pair[0], PROMPT, 9)
    async with cluster.client() as client:
        items = [i async for i in client.agenerate(prompt_ids=PROMPT, max_new_tokens=9, mode="autoregressive")]
        summary = await client.acomplete(prompt_ids=PROMPT, max_new_tokens=9)
    assert [t for c in items[:-1] for t in c.token_ids] == want == summary.token_ids
    assert items[-1].rounds == 9


async def test_retries_unavailable_until_the_coordinator_is_up(cluster, tiny_pair):
    """Nothing listens at first: the client backs off and retries until a coordinator starts."""
    port = _free_port()
    want = greedy_reference(tiny_pair[0], PROMPT, 6)
    client = Client(f"127.0.0.1:{port}", retries=8, backoff_s=0.1, max_backoff_s=0.4)
    task = asyncio.create_task(client.acomplete(prompt_ids=PROMPT, max_new_tokens=6, timeout=30))
    await asyncio.sleep(0.3)
    assert not task.done()
    late = Coordinator(verifiers=cluster.verifier_targets, drafters=cluster.drafter_targets, eos_ids=())
    running = await serve(late, port=port)
    try:
        summary = await asyncio.wait_for(task, 30)
        assert summary.token_ids == want and summary.retries >= 1
    finally:
        await client.aclose()
        await running.stop(grace=0.5)


async def test_no_retry_on_invalid_argument(cluster):
    async with cluster.client(retries=5) as client:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.acomplete(prompt_ids=PROMPT, max_new_tokens=4, k=1000)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_dedup_skips_replayed_tokens_and_detects_divergence():
    def chunk(ids, seq=0):
        text = "".join(chr(96 + i) for i in ids)  # token i <-> one letter
        return coordinator_pb2.GenerateResponse(chunk=coordinator_pb2.TokenChunk(seq=seq, token_ids=ids, text=text))

    d = _Dedup()
    d.new_attempt()
    assert d.feed(chunk([1, 2, 3]), 0).token_ids == [1, 2, 3]
    assert d.feed(chunk([4]), 0).text == "d"
    d.new_attempt()  # the resumed stream starts from the first token again
    assert d.feed(chunk([1, 2]), 1) is None
    fresh = d.feed(chunk([3, 4, 5, 6]), 1)
    assert fresh.token_ids == [5, 6] and fresh.text == "ef"
    assert d.delivered == [1, 2, 3, 4, 5, 6]
    d.new_attempt()
    with pytest.raises(ResumeMismatch):
        d.feed(chunk([1, 9]), 2)


async def test_resume_after_coordinator_restart(tiny_pair, redis_url):
    """The coordinator dies mid-stream; a new one on the same address (same Redis) resumes the session:
    the client's tokens have no gap and no repeat."""
    verifier, drafter = tiny_pair
    want = greedy_reference(verifier, PROMPT, 30)
    port = _free_port()
    prefix = "test-client-resume:"
    async with LocalCluster(str(verifier), str(drafter), eos_ids=()) as cluster:
        def coordinator():
            return Coordinator(store=RedisStore(redis_url, prefix=prefix), verifiers=cluster.verifier_targets,
                               drafters=cluster.drafter_targets, eos_ids=(), link=LinkModel(rtt_ms=30))

        first = await serve(coordinator(), port=port)
        client = Client(f"127.0.0.1:{port}", retries=10, backoff_s=0.1, max_backoff_s=0.3)
        received, summary = [], None
        second = None
        try:
            async for item in client.agenerate(prompt_ids=PROMPT, max_new_tokens=30, mode="autoregressive",
                                               timeout=60):
                if isinstance(item, Chunk):
                    received.extend(item.token_ids)
                    if len(received) == 5 and second is None:
                        await first.stop(grace=0)  # the coordinator goes away mid-generation
                        second = await serve(coordinator(), port=port)
                else:
                    summary = item
        finally:
            await client.aclose()
            if second is not None:
                await second.stop(grace=0.5)
    assert received == want
    assert summary.token_ids == want and summary.retries >= 1 and summary.resumes >= 1

"""Admission: oversized prompts are refused before tokenising; tokenising never blocks the event loop.

Reproduction (before, issue 15 item 3): a 15 MB text prompt was tokenised on the coordinator's
event loop for 15-38 s; health checks timed out and every other session stalled, then an 18 MB
message went to the verifier, which refused it. Now it ends with OUT_OF_RANGE before the
tokenizer sees it, and health checks and another session's round trips go on meanwhile.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.admission import Admission, max_token_bytes
from coordinator.client import Client
from coordinator.local import LocalCluster
from coordinator.streams import SessionError

pytestmark = pytest.mark.timeout(120)


class _CountingTokenizer:
    """A real tokenizer that records how many characters it was asked to encode."""

    def __init__(self, inner):
        self.inner, self.seen = inner, 0

    def get_vocab(self):
        return self.inner.get_vocab()

    def __call__(self, text, **kwargs):
        self.seen += len(text)
        return self.inner(text, **kwargs)


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    from steerspec.models.loading import load_tokenizer

    return load_tokenizer(tiny_pair[0])


@pytest.mark.slow
async def test_oversized_prompt_refused_before_tokenising(tokenizer):
    counting = _CountingTokenizer(tokenizer)
    admission = Admission(counting, max_length=256)
    assert 1 <= admission.token_bytes == max_token_bytes(tokenizer)
    with pytest.raises(SessionError) as refused:
        await admission.tokenize("x = 1\n" * 2_500_000)  # 15 MB
    assert refused.value.code == grpc.StatusCode.OUT_OF_RANGE and "context is 256" in refused.value.message
    assert counting.seen == 0  # the tokenizer never saw it
    # a prompt under the byte bound but over the context in tokens: tokenised (off the loop), then refused
    text = "a b " * 200
    assert admission.min_tokens(text) < 256 <= len(tokenizer(text, add_special_tokens=False)["input_ids"])
    with pytest.raises(SessionError) as exact:
        await admission.tokenize(text)
    assert exact.value.code == grpc.StatusCode.OUT_OF_RANGE and counting.seen == len(text)
    assert await admission.tokenize("def f(x):") == list(tokenizer("def f(x):", add_special_tokens=False)["input_ids"])
    with pytest.raises(SessionError):
        admission.check_ids(list(range(256)))
    admission.check_ids(list(range(255)))


async def test_huge_prompt_does_not_stall_health_or_other_sessions(tiny_pair):
    """A 15 MB prompt through the public API: OUT_OF_RANGE, while health checks and a concurrent
    session's generation keep completing (each health check within its 2 s deadline)."""
    async with LocalCluster(str(tiny_pair[0]), str(tiny_pair[1]), eos_ids=()) as cluster:
        async with Client(cluster.target, retries=0) as client, grpc.aio.insecure_channel(cluster.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            checks = []

            async def probe(stop: asyncio.Event):
                while not stop.is_set():
                    start = time.perf_counter()
                    reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                    checks.append((reply.status, time.perf_counter() - start))
                    await asyncio.sleep(0.02)

            stop = asyncio.Event()
            prober = asyncio.create_task(probe(stop))
            other = asyncio.create_task(client.acomplete(prompt_ids=[5, 17, 42, 9], max_new_tokens=24, k=4,
                                                         timeout=60))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.acomplete("y = 2\n" * 2_500_000, max_new_tokens=4, timeout=60)
            assert refused.value.code() == grpc.StatusCode.OUT_OF_RANGE
            summary = await other
            stop.set()
            await prober
        assert len(summary.token_ids) == 24
        assert checks and all(status == health_pb2.HealthCheckResponse.SERVING for status, _ in checks)

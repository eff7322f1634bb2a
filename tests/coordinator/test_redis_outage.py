"""Redis dies under running sessions: they go on without checkpoints and say so; new sessions get UNAVAILABLE.

Reproduction (before, issue 15 item 5, "sessions already running continue without checkpoints"):
a real redis-server SIGKILLed after a session's second chunk ended that session with UNAVAILABLE
"the session store (Redis) failed" when it finished (its end was written to Redis) and, when its
verifier failed too, at the failover (placement read the registry from Redis): the client got no
summary although every token had been generated.
"""

from __future__ import annotations

import grpc
import pytest

from coord_helpers import greedy_reference
from coordinator.client import Chunk, Client
from coordinator.local import LocalCluster
from steerspec.serving.linkemu import LinkModel
from steerspec.observability import service_metrics

pytestmark = pytest.mark.timeout(180)
PROMPT = [5, 17, 42, 9]
NEW_TOKENS = 40


@pytest.fixture
def metrics():
    calls = service_metrics.CallMetrics("coordinator")
    service_metrics.install(calls)
    yield calls
    service_metrics.install(None)


async def _generate(cluster: LocalCluster, at_chunk: int, action):
    """One streamed generation (no client retries); `await action()` after chunk `at_chunk`."""
    streamed, summary, chunks = [], None, 0
    async with Client(cluster.target, retries=0) as client:
        async for item in client.agenerate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, k=2, timeout=120):
            if isinstance(item, Chunk):
                streamed.extend(item.token_ids)
                chunks += 1
                if chunks == at_chunk:
                    await action()
            else:
                summary = item
    return streamed, summary


def _uncheckpointed(metrics) -> float:
    return metrics.registry.get_sample_value("steerspec_sessions_uncheckpointed_total", {"service": "coordinator"}) or 0


async def test_running_session_outlives_redis(tiny_pair, redis_proc, metrics):
    want = greedy_reference(tiny_pair[0], PROMPT, NEW_TOKENS)
    async with LocalCluster(str(tiny_pair[0]), str(tiny_pair[1]), eos_ids=(), redis_url=redis_proc.url,
                            link=LinkModel(rtt_ms=20)) as cluster:
        async def kill_redis():
            redis_proc.kill()

        streamed, summary = await _generate(cluster, 2, kill_redis)
        assert streamed == want and summary is not None and summary.token_ids == want
        assert _uncheckpointed(metrics) == 1  # it says so
        async with Client(cluster.target, retries=0) as client:  # a new session needs the store
            with pytest.raises(grpc.aio.AioRpcError) as down:
                await client.acomplete(prompt_ids=PROMPT, max_new_tokens=4, timeout=30)
        assert down.value.code() == grpc.StatusCode.UNAVAILABLE and "Redis" in down.value.details()


async def test_failover_while_redis_is_down(tiny_pair, redis_proc, metrics):
    """The session's verifier stops after Redis died: it moves to the other replica the registry listed last."""
    want = greedy_reference(tiny_pair[0], PROMPT, NEW_TOKENS)
    async with LocalCluster(str(tiny_pair[0]), str(tiny_pair[1]), eos_ids=(), verifiers=2, redis_url=redis_proc.url,
                            link=LinkModel(rtt_ms=20)) as cluster:
        by_target = dict(zip(cluster.verifier_targets, cluster.verifier_servers))

        async def kill_redis_then_verifier():
            placed = [a for (kind, a) in cluster.coordinator.config.placer.in_use if kind == "verifier"]
            assert len(placed) == 1
            redis_proc.kill()
            await by_target[placed[0]].stop(grace=0)

        streamed, summary = await _generate(cluster, 2, kill_redis_then_verifier)
    assert streamed == want and summary is not None and summary.token_ids == want
    assert summary.resumes == 1
    assert _uncheckpointed(metrics) == 1

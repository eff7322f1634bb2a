"""A client deadline or a cancellation ends the session on every service and frees its caches."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from coordinator.client import Chunk
from coordinator.local import LocalCluster
from coordinator.streams import SessionError
from steerspec.serving.linkemu import LinkModel

PROMPT = [5, 17, 42, 9]


@pytest.fixture
async def slow_cluster(tiny_pair):
    """20 ms emulated RTT: a 200-token generation takes seconds, so deadlines land mid-stream."""
    verifier, drafter = tiny_pair
    async with LocalCluster(str(verifier), str(drafter), eos_ids=(), link=LinkModel(rtt_ms=20)) as c:
        yield c


async def assert_all_freed(cluster, timeout_s: float = 5.0) -> None:
    """Every verifier and drafter reports no session and no cache (polled, bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        verifiers, drafters = await cluster.stats()
        busy = [(s.active_sessions, s.cache_bytes) for s in verifiers + drafters
                if s.active_sessions or s.cache_bytes]
        if not busy:
            return
        assert time.monotonic() < deadline, f"sessions not freed: {busy}"
        await asyncio.sleep(0.05)


async def wait_busy(cluster, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        verifiers, drafters = await cluster.stats()
        if all(s.active_sessions for s in verifiers + drafters):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the session never opened on every service")


async def test_client_deadline_frees_every_service(slow_cluster):
    async with slow_cluster.client(retries=0) as client:
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for item in client.agenerate(prompt_ids=PROMPT, max_new_tokens=200, k=2, timeout=0.6):
                if isinstance(item, Chunk):
                    received.extend(item.token_ids)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0 < len(received) < 200
    await assert_all_freed(slow_cluster)


async def test_client_cancellation_frees_every_service(slow_cluster):
    async with slow_cluster.client(retries=0) as client:
        async def consume():
            async for _ in client.agenerate(prompt_ids=PROMPT, max_new_tokens=200, k=2, timeout=60):
                pass

        task = asyncio.create_task(consume())
        await wait_busy(slow_cluster)
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await assert_all_freed(slow_cluster)


async def test_sync_client_deadline(slow_cluster):
    def call():
        with slow_cluster.client(retries=0) as client:
            return list(client.generate(prompt_ids=PROMPT, max_new_tokens=200, mode="autoregressive", timeout=0.5))

    with pytest.raises(grpc.RpcError) as info:
        await asyncio.to_thread(call)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await assert_all_freed(slow_cluster)


async def test_loop_deadline_inside_the_coordinator(slow_cluster):
    with pytest.raises(SessionError) as info:
        await slow_cluster.generate(PROMPT, max_new_tokens=200, k=2, timeout=0.4)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    await assert_all_freed(slow_cluster)


def test_a_replica_error_at_the_deadline_is_the_deadlines():
    """grpc may report a deadline landing mid-write as INTERNAL "Internal error from Core": at or past
    the generation's deadline the session ends DEADLINE_EXCEEDED; before it, or with another code, as is."""
    from coordinator.loop import DEADLINE_SLACK_S, deadline_error

    core = SessionError(grpc.StatusCode.INTERNAL, "verifier 127.0.0.1:1: Internal error from Core")
    mapped = deadline_error(core, deadline=10.0, now=10.0)
    assert mapped.code == grpc.StatusCode.DEADLINE_EXCEEDED and "Internal error from Core" in mapped.message
    assert deadline_error(SessionError(grpc.StatusCode.CANCELLED, "x"), 10.0, 11.0).code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert deadline_error(core, deadline=10.0, now=10.0 - 2 * DEADLINE_SLACK_S) is core
    assert deadline_error(core, deadline=None, now=10.0) is core
    invalid = SessionError(grpc.StatusCode.INVALID_ARGUMENT, "bad k")
    assert deadline_error(invalid, deadline=10.0, now=11.0) is invalid


def test_a_replica_lost_at_the_deadline_is_the_deadlines_not_a_failover():
    """The same rule for a lost replica (e.g. grpc core's own INTERNAL, which streams.py fails over): within
    DEADLINE_SLACK_S of the deadline the session ends DEADLINE_EXCEEDED and the replica is not marked failed;
    before it, the loop fails over."""
    from coordinator.loop import DEADLINE_SLACK_S, deadline_reached, lost_to_deadline
    from coordinator.streams import ReplicaLost

    lost = ReplicaLost("verifier", "127.0.0.1:1", "INTERNAL: Internal error from Core")
    for now in (10.0 - DEADLINE_SLACK_S / 2, 10.0, 11.0):
        ended = lost_to_deadline(lost, deadline=10.0, now=now)
        assert ended.code == grpc.StatusCode.DEADLINE_EXCEEDED and "Internal error from Core" in ended.message
    assert lost_to_deadline(lost, deadline=10.0, now=10.0 - 2 * DEADLINE_SLACK_S) is None
    assert lost_to_deadline(lost, deadline=None, now=1e9) is None
    assert deadline_reached(10.0, 10.0 - DEADLINE_SLACK_S) and not deadline_reached(None, 0.0)

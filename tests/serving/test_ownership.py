"""Session ownership, exclusive use, and Redis failures on real servers and a real redis-server.

Reproductions (before, issue 15 items 4-5): any client that knew a session_id and its prompt read
another client's output; two concurrent calls with one session_id both ran and corrupted its
checkpoint (731 tokens stored for a 400-token generation); killing Redis ended calls with UNKNOWN
"redis ConnectionError", and after Redis came back a stale connection failed the next session.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from coord_helpers import greedy_reference
from coordinator.client import Client
from coordinator.local import LocalCluster
from steerspec.serving import security
from steerspec.serving.store import RedisStore

pytestmark = pytest.mark.timeout(180)
PROMPT = [5, 17, 42, 9]
ALICE, BOB = "alice-token-0123", "bob-token-4567"


@pytest.fixture(autouse=True)
def _reset_security():
    security.reset()
    yield
    security.reset()


async def test_a_session_belongs_to_its_creator(tiny_pair):
    """Bob cannot resume (read) Alice's session: PERMISSION_DENIED; Alice can."""
    security.configure(server=security.ServerSecurity(tokens=frozenset({ALICE, BOB, "service-token"})),
                       client=security.ClientSecurity(token="service-token"))  # coordinator -> replicas
    async with LocalCluster(str(tiny_pair[0]), str(tiny_pair[1]), eos_ids=()) as cluster:
        async with Client(cluster.target, token=ALICE, retries=0) as alice:
            first = await alice.acomplete(prompt_ids=PROMPT, max_new_tokens=8, session_id="shared-id")
        async with Client(cluster.target, token=BOB, retries=0) as bob:
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await bob.acomplete(prompt_ids=PROMPT, max_new_tokens=8, session_id="shared-id")
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "belongs to another identity" in denied.value.details()
        async with Client(cluster.target, token=ALICE, retries=0) as alice:
            again = await alice.acomplete(prompt_ids=PROMPT, max_new_tokens=8, session_id="shared-id")
        assert again.token_ids == first.token_ids


@pytest.mark.parametrize("with_redis", [False, True])
async def test_second_live_call_is_aborted_and_checkpoint_intact(tiny_pair, redis_proc, with_redis):
    """Two concurrent calls with one session_id: the second gets ABORTED; the checkpoint holds exactly
    the first call's tokens (never interleaved)."""
    n = 60
    want = greedy_reference(tiny_pair[0], PROMPT, n)
    url = redis_proc.url if with_redis else None
    async with LocalCluster(str(tiny_pair[0]), str(tiny_pair[1]), eos_ids=(), redis_url=url,
                            verifier_options={"batch_window_ms": 20.0}) as cluster:
        async with Client(cluster.target, retries=0) as client:
            stream = client.agenerate(prompt_ids=PROMPT, max_new_tokens=n, k=1, session_id="one-at-a-time")
            await stream.__anext__()  # the first call is live
            with pytest.raises(grpc.aio.AioRpcError) as second:
                await client.acomplete(prompt_ids=PROMPT, max_new_tokens=n, k=1, session_id="one-at-a-time")
            assert second.value.code() == grpc.StatusCode.ABORTED
            items = [item async for item in stream]
        assert items[-1].token_ids == want
        record = await cluster.coordinator.store.get_session("one-at-a-time")
        assert record.token_ids == want and record.status == "done"


@pytest.mark.slow
async def test_redis_down_is_unavailable_and_reconnects(tiny_pair, redis_proc):
    """Redis killed: a new session ends UNAVAILABLE with a message (not UNKNOWN); Redis restarted:
    the next session succeeds through the SDK's retries, on a fresh connection."""
    want = greedy_reference(tiny_pair[0], PROMPT, 8)
    async with LocalCluster(str(tiny_pair[0]), str(tiny_pair[1]), eos_ids=(), redis_url=redis_proc.url) as cluster:
        assert isinstance(cluster.coordinator.store, RedisStore)
        async with Client(cluster.target, retries=0) as client:
            assert (await client.acomplete(prompt_ids=PROMPT, max_new_tokens=8)).token_ids == want
            redis_proc.kill()
            with pytest.raises(grpc.aio.AioRpcError) as down:
                await client.acomplete(prompt_ids=PROMPT, max_new_tokens=8, timeout=30)
            assert down.value.code() == grpc.StatusCode.UNAVAILABLE and "Redis" in down.value.details()
        redis_proc.start()
        async with Client(cluster.target) as client:  # default retries ride out re-registration
            summary = await client.acomplete(prompt_ids=PROMPT, max_new_tokens=8, timeout=60)
        assert summary.token_ids == want
        assert (await cluster.coordinator.store.get_session(summary.session_id)).token_ids == want
    await asyncio.sleep(0)

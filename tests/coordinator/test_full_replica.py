"""A full verifier replica (RESOURCE_EXHAUSTED) gets no new session: it goes to another replica.

Reproduction (before, issue 15 item 1/6): 64 idle VerifyOpen streams filled one replica and every
generation placed there then failed with RESOURCE_EXHAUSTED although a second replica was idle.
"""

from __future__ import annotations

import grpc
import pytest

from coord_helpers import greedy_reference
from coordinator.local import LocalCluster
from coordinator.streams import SessionError
from service_helpers import open_verifier, wait_for_stats
from steerspec.v1 import verifier_pb2, verifier_pb2_grpc
from verifier_service.cache_budget import default_cache_mb

pytestmark = pytest.mark.timeout(120)
PROMPT = [5, 17, 42, 9]


async def test_full_replica_fails_over(tiny_pair):
    want = greedy_reference(tiny_pair[0], PROMPT, 10)
    async with LocalCluster(str(tiny_pair[0]), str(tiny_pair[1]), eos_ids=(), verifiers=2,
                            verifier_options={"max_sessions": 1}) as cluster:
        full = cluster.verifier_targets[0]
        async with grpc.aio.insecure_channel(full) as channel:
            squatter, opened = await open_verifier(verifier_pb2_grpc.VerifierServiceStub(channel), [1, 2, 3],
                                                   session_id="squatter")
            assert opened.WhichOneof("kind") != "error", opened
            results = [await cluster.generate(PROMPT, max_new_tokens=10, k=4) for _ in range(4)]
            squatter.cancel()
    assert all(r.token_ids == want for r in results)


def test_default_cache_budget_is_bounded():
    """--max-cache-mb defaults to a share of the device's memory, never 'no limit'."""
    mb = default_cache_mb("cpu")
    assert 64.0 <= mb < float("inf")


async def test_full_replica_stays_registered(tiny_pair):
    """A full replica is alive: it is skipped for the session it refused but stays in the registry, so
    a later session is placed there once it has room.

    Reproduction (before): RESOURCE_EXHAUSTED dropped the replica from the registry like a dead one;
    with the other replica gone, the next session got UNAVAILABLE "no live verifier replica" although
    the full one had room again (until a heartbeat, here every 20 s, registered it again)."""
    want = greedy_reference(tiny_pair[0], PROMPT, 10)
    async with LocalCluster(str(tiny_pair[0]), str(tiny_pair[1]), eos_ids=(), verifiers=2, heartbeat_ttl_s=60,
                            verifier_options={"max_sessions": 1}) as cluster:
        full = cluster.verifier_targets[0]
        store = cluster.coordinator.store
        await cluster.verifier_servers[1].stop(grace=0)  # still registered: the first session finds it dead
        async with grpc.aio.insecure_channel(full) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            squatter, opened = await open_verifier(stub, [1, 2, 3], session_id="squatter")
            assert opened.WhichOneof("kind") != "error", opened
            with pytest.raises(SessionError) as refused:  # the dead one, then the full one: nowhere to go
                await cluster.generate(PROMPT, max_new_tokens=10, k=4)
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
            assert [e.address for e in await store.live("verifier")] == [full]  # alive, so still registered
            squatter.cancel()
            stats = await wait_for_stats(lambda: stub.GetVerifierStats(verifier_pb2.GetVerifierStatsRequest()),
                                         lambda s: s.stats.active_sessions == 0)
            assert stats.stats.active_sessions == 0
        later = await cluster.generate(PROMPT, max_new_tokens=10, k=4)  # placed on it now that it has room
    assert later.token_ids == want


async def test_replica_full_mid_session_fails_over(tiny_pair):
    """A replica whose KV-cache budget runs out in the middle of a session (an in-stream
    RESOURCE_EXHAUSTED) hands the session to another replica from its committed prefix: the output
    is the uninterrupted greedy one.

    Reproduction (before): the session ended with RESOURCE_EXHAUSTED "KV-cache memory limit reached"
    although the other replica had room (only a full replica at the open failed over)."""
    from coord_helpers import load_cached
    from steerspec.models.loading import kv_bytes_per_token

    n = 40
    want = greedy_reference(tiny_pair[0], PROMPT, n)
    budget_mb = 120 * kv_bytes_per_token(load_cached(tiny_pair[0])) / 2 ** 20  # 120 tokens per replica
    async with LocalCluster(str(tiny_pair[0]), str(tiny_pair[1]), eos_ids=(), verifiers=2,
                            verifier_options={"max_cache_mb": budget_mb}) as cluster:
        async with grpc.aio.insecure_channel(cluster.verifier_targets[0]) as channel:
            # 90 prompt tokens + max_k 8 reserved: about 22 tokens left there, a session needs ~50
            squatter, opened = await open_verifier(verifier_pb2_grpc.VerifierServiceStub(channel),
                                                   [3 + i % 50 for i in range(90)], session_id="squatter")
            assert opened.WhichOneof("kind") == "ready", opened
            results = [await cluster.generate(PROMPT, max_new_tokens=n, k=4) for _ in range(2)]  # one starts there
            squatter.cancel()
    assert all(r.token_ids == want for r in results)
    assert sum(r.resumes for r in results) >= 1

"""State store: registry TTLs and session checkpoints, in-process and against a real redis-server."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from steerspec.serving.store import InProcessStore, RedisStore, keep_registered


@pytest.fixture(params=["inproc", pytest.param("redis", marks=pytest.mark.redis)])
async def store(request):
    if request.param == "inproc":
        s = InProcessStore()
    else:
        url = request.getfixturevalue("redis_url")
        s = RedisStore(url, prefix=f"test-{uuid.uuid4().hex[:8]}:")
        assert await s.ping()
    yield s
    await s.close()


async def test_registry_ttl_heartbeat_and_expire(store):
    await store.register("verifier", "127.0.0.1:1001", ttl_s=0.5, meta={"load": 1})
    await store.register("verifier", "127.0.0.1:1002", ttl_s=30.0)
    await store.register("drafter", "127.0.0.1:2001", ttl_s=30.0)
    assert [e.address for e in await store.live("verifier")] == ["127.0.0.1:1001", "127.0.0.1:1002"]
    assert [e.address for e in await store.live("drafter")] == ["127.0.0.1:2001"]
    assert (await store.live("verifier"))[0].meta == {"load": 1}
    # A heartbeat extends the TTL (and can update metadata) ...
    await asyncio.sleep(0.3)
    assert await store.heartbeat("verifier", "127.0.0.1:1001", ttl_s=0.5, meta={"load": 2})
    await asyncio.sleep(0.3)  # 0.6 s after registering: alive only thanks to the heartbeat
    live = await store.live("verifier")
    assert [e.address for e in live] == ["127.0.0.1:1001", "127.0.0.1:1002"]
    assert live[0].meta == {"load": 2}
    # ... without one it expires, and a late heartbeat says so.
    await asyncio.sleep(0.5)
    assert [e.address for e in await store.live("verifier")] == ["127.0.0.1:1002"]
    assert not await store.heartbeat("verifier", "127.0.0.1:1001", ttl_s=1.0)
    # expire() drops a replica at once.
    await store.expire("verifier", "127.0.0.1:1002")
    assert await store.live("verifier") == []
    assert [e.address for e in await store.live("drafter")] == ["127.0.0.1:2001"]


@pytest.mark.slow
async def test_keep_registered_follows_probe(store):
    healthy = {"ok": True}

    async def probe():
        return healthy["ok"]

    task = asyncio.create_task(keep_registered(store, "verifier", "127.0.0.1:3001", ttl_s=0.6, probe=probe))
    try:
        await asyncio.sleep(0.05)
        assert [e.address for e in await store.live("verifier")] == ["127.0.0.1:3001"]
        await asyncio.sleep(0.8)  # renewed every 0.2 s
        assert [e.address for e in await store.live("verifier")] == ["127.0.0.1:3001"]
        healthy["ok"] = False
        await asyncio.sleep(1.0)
        assert await store.live("verifier") == []
        healthy["ok"] = True
        await asyncio.sleep(0.4)
        assert [e.address for e in await store.live("verifier")] == ["127.0.0.1:3001"]
    finally:
        task.cancel()


async def test_session_checkpoint_roundtrip(store):
    assert await store.get_session("nope") is None
    params = {"prompt_ids": [1, 2, 3], "max_new_tokens": 8, "k": 4}
    await store.create_session("s1", params, {"verifier": "a:1", "drafter": "b:2"})
    # Appends return at once; order is kept across many small writes.
    for i in range(50):
        store.append_tokens("s1", [i, i + 100])
    await store.set_placement("s1", {"verifier": "c:3", "drafter": "b:2"})
    await store.flush("s1")
    rec = await store.get_session("s1")
    assert rec.params == params
    assert rec.placement == {"verifier": "c:3", "drafter": "b:2"}
    assert rec.token_ids == [t for i in range(50) for t in (i, i + 100)]
    assert rec.status == "running"
    store.append_tokens("s1", [7])
    await store.finish_session("s1", "done", "length")
    rec = await store.get_session("s1")
    assert rec.token_ids[-1] == 7 and rec.status == "done" and rec.finish_reason == "length"
    # Re-creating a session id starts a clean record.
    await store.create_session("s1", params, {})
    assert (await store.get_session("s1")).token_ids == []


async def test_append_does_not_wait_for_the_store(store):
    """append_tokens is synchronous (no await): the write happens on a background task."""
    await store.create_session("s2", {}, {})
    store.append_tokens("s2", [1, 2, 3])
    store.append_tokens("s2", [4])
    assert store._pending.get("s2") == [1, 2, 3, 4]  # queued, not yet written
    await store.flush()
    assert (await store.get_session("s2")).token_ids == [1, 2, 3, 4]
    assert store.write_errors == 0


async def test_placement_takes_the_least_loaded_replica_without_counting_twice(store):
    from coordinator.placement import Placer

    await store.register("verifier", "a:1", 30.0, {"active_sessions": 2})  # self-registered: ours included
    await store.register("verifier", "b:1", 30.0, {"active_sessions": 0})
    await store.register("verifier", "c:1", 30.0)  # registered by a coordinator: no report
    placer = Placer(store)
    for _ in range(2):
        placer.acquire("verifier", "a:1")  # the 2 sessions a:1 reports are ours
    placer.acquire("verifier", "b:1")
    placer.acquire("verifier", "c:1")
    placer.acquire("verifier", "c:1")
    assert await placer.choose("verifier") == "b:1"  # loads a 2, b 1, c 2 (a's not 4)
    placer.acquire("verifier", "b:1")
    assert {await placer.choose("verifier") for _ in range(4)} == {"a:1", "b:1", "c:1"}  # all tied at 2: rotate
    assert await placer.choose("verifier", exclude=["a:1", "b:1"]) == "c:1"


async def test_ties_rotate_per_kind(store):
    """Sequential sessions alternate verifier replicas even though each also places a drafter (a round-robin
    count shared by both kinds sent every session to the same verifier)."""
    from coordinator.placement import Placer

    await store.register("verifier", "v:1", 30.0)
    await store.register("verifier", "v:2", 30.0)
    await store.register("drafter", "d:1", 30.0)
    placer = Placer(store)
    verifiers = []
    for _ in range(4):
        verifiers.append(await placer.choose("verifier"))
        assert await placer.choose("drafter") == "d:1"
    assert sorted(verifiers) == ["v:1", "v:1", "v:2", "v:2"]


async def test_pinned_drafters_keep_a_coordinator_on_its_own_edge_while_one_is_live(store):
    from coordinator.placement import Placer

    for address, sessions in (("edge-a:1", 3), ("edge-a:2", 5), ("edge-b:1", 0)):
        await store.register("drafter", address, 30.0, {"active_sessions": sessions})
    await store.register("verifier", "v:1", 30.0)
    placer = Placer(store, pinned={"drafter": ["edge-a:1", "edge-a:2"], "verifier": []})
    assert await placer.choose("drafter") == "edge-a:1"  # edge-b:1 is idle but another edge's
    assert await placer.choose("drafter", exclude=["edge-a:1"]) == "edge-a:2"
    assert await placer.choose("drafter", exclude=["edge-a:1", "edge-a:2"]) == "edge-b:1"  # none of ours left
    assert await placer.choose("drafter", exclude=["edge-a:1", "edge-a:2", "edge-b:1"]) is None  # verifier-only
    assert await placer.choose("verifier") == "v:1"  # an empty pin is no pin
    assert await Placer(store).choose("drafter") == "edge-b:1"  # unpinned: any registered drafter


async def test_inprocess_sessions_expire_like_redis_and_writers_are_dropped():
    """The embedded store stays bounded in a long-lived coordinator: a record lives SESSION_TTL_S
    past its last write (as the Redis keys do), and a finished checkpoint writer is not kept."""
    from steerspec.serving.store import SESSION_TTL_S

    now = [0.0]
    store = InProcessStore(clock=lambda: now[0])
    await store.create_session("old", {}, {})
    await store.create_session("busy", {}, {})
    store.append_tokens("old", [1])
    await asyncio.sleep(0)  # the writer runs and finishes without anybody calling flush
    await asyncio.sleep(0)
    assert "old" not in store._writers and (await store.get_session("old")).token_ids == [1]
    now[0] = SESSION_TTL_S * 0.75
    store.append_tokens("busy", [2])  # a write pushes its record's expiry back
    await store.flush()
    now[0] = SESSION_TTL_S * 1.5
    await store.create_session("new", {}, {})
    assert await store.get_session("old") is None
    assert (await store.get_session("busy")).token_ids == [2]
    assert set(store._sessions) == {"busy", "new"}

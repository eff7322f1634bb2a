"""Failover: SIGKILL a verifier or drafter replica (a real subprocess) in the middle of a generation.

The session resumes on another replica from its committed prefix (or verifier-only when no drafter
is left); the client's stream has no token lost or repeated; greedy output equals an uninterrupted run.
The replicas that get killed are subprocesses (`python -m steerspec serve ...`); the standby
replicas run in this process (LocalCluster) and join the registry once the session is placed, so
the kill always hits the session's replica.
"""

from __future__ import annotations

import asyncio

import pytest

from coord_helpers import greedy_reference, kill, spawn_service, wait_ready
from coordinator.client import Chunk, Client
from coordinator.local import LocalCluster
from coordinator.server import Coordinator, serve
from steerspec.serving.linkemu import LinkModel

PROMPT = [5, 17, 42, 9]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def doomed(tiny_pair):
    """A verifier and a drafter subprocess, started in parallel: {"verifier": (addr, proc), ...}."""
    verifier, drafter = tiny_pair
    spawned = {"verifier": spawn_service("verifier", verifier), "drafter": spawn_service("drafter", drafter)}
    try:
        yield {kind: (wait_ready(proc, log), proc) for kind, (proc, log) in spawned.items()}
    finally:
        for proc, _log in spawned.values():
            kill(proc)


@pytest.fixture
async def standby(tiny_pair):
    verifier, drafter = tiny_pair
    async with LocalCluster(str(verifier), str(drafter), eos_ids=()) as cluster:
        yield cluster


async def run_session(coordinator: Coordinator, session_id: str, actions: dict):
    """Stream a generation through the public API; after n chunks, `await actions[n](placement)`."""
    running = await serve(coordinator)
    streamed, summary, chunks = [], None, 0
    try:
        async with Client(running.target, retries=0) as client:
            async for item in client.agenerate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, k=2, timeout=120,
                                               session_id=session_id):
                if isinstance(item, Chunk):
                    streamed.extend(item.token_ids)
                    chunks += 1
                    if chunks in actions:
                        await actions[chunks]((await coordinator.store.get_session(session_id)).placement)
                else:
                    summary = item
    finally:
        await running.stop(grace=1.0)
    return streamed, summary


@pytest.mark.slow
async def test_verifier_killed_mid_generation(doomed, standby, tiny_pair):
    want = greedy_reference(tiny_pair[0], PROMPT, NEW_TOKENS)
    address, proc = doomed["verifier"]
    coordinator = Coordinator(verifiers=[address], drafters=standby.drafter_targets, eos_ids=(),
                              link=LinkModel(rtt_ms=20))

    async def kill_verifier(placement):
        assert placement["verifier"] == address
        await coordinator.store.register("verifier", standby.verifier_targets[0], ttl_s=60)
        kill(proc)  # SIGKILL mid-generation

    streamed, summary = await asyncio.wait_for(run_session(coordinator, "failover-v", {2: kill_verifier}), 90)
    assert proc.poll() is not None
    assert streamed == want == summary.token_ids  # nothing lost, nothing repeated, same greedy output
    assert summary.resumes == 1
    assert summary.rounds < NEW_TOKENS  # still speculative after the resume
    record = await coordinator.store.get_session("failover-v")
    assert record.placement["verifier"] == standby.verifier_targets[0] and record.token_ids == want


async def test_drafter_killed_then_none_left(doomed, standby, tiny_pair):
    want = greedy_reference(tiny_pair[0], PROMPT, NEW_TOKENS)
    address, proc = doomed["drafter"]
    backup = standby.drafter_targets[0]
    coordinator = Coordinator(verifiers=standby.verifier_targets, drafters=[address], eos_ids=(),
                              link=LinkModel(rtt_ms=20))

    async def kill_drafter(placement):
        assert placement["drafter"] == address
        await coordinator.store.register("drafter", backup, ttl_s=60)
        kill(proc)  # SIGKILL: the session moves to the standby drafter

    async def stop_last_drafter(placement):
        assert placement["drafter"] == backup
        await standby.drafter_servers[0].stop(grace=0)  # no drafter left: verifier-only from here

    streamed, summary = await asyncio.wait_for(
        run_session(coordinator, "failover-d", {2: kill_drafter, 5: stop_last_drafter}), 90)
    assert proc.poll() is not None
    assert streamed == want == summary.token_ids
    assert summary.resumes == 2
    record = await coordinator.store.get_session("failover-d")
    assert record.placement["drafter"] == "" and record.token_ids == want


async def test_sampling_session_survives_a_verifier_stop(tiny_pair):
    """T=1: a verifier replica stops mid-generation (in-process, grace 0); the session resumes on the
    other one and still yields exactly max_new_tokens tokens, streamed once each."""
    verifier, drafter = tiny_pair
    async with LocalCluster(str(verifier), str(drafter), verifiers=2, eos_ids=(), link=LinkModel(rtt_ms=10)) as c:
        by_target = dict(zip(c.verifier_targets, c.verifier_servers))

        async def stop_verifier(placement):
            await by_target[placement["verifier"]].stop(grace=0)

        streamed, summary = await asyncio.wait_for(run_session_sampling(c, stop_verifier), 60)
    assert len(streamed) == NEW_TOKENS and streamed == summary.token_ids
    assert summary.resumes == 1


async def run_session_sampling(cluster: LocalCluster, action) -> tuple:
    streamed, summary, chunks = [], None, 0
    async with cluster.client(retries=0) as client:
        async for item in client.agenerate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, k=3, temperature=1.0,
                                           seed=5, draft_top_k=32, timeout=60, session_id="failover-t1"):
            if isinstance(item, Chunk):
                streamed.extend(item.token_ids)
                chunks += 1
                if chunks == 2:
                    await action((await cluster.coordinator.store.get_session("failover-t1")).placement)
            else:
                summary = item
    return streamed, summary


def test_grpc_cores_own_internal_error_counts_as_a_lost_replica():
    """A replica stopped mid-write can end the call with grpc core's "Internal error from Core" (seen in CI
    on test_sampling_session_survives_a_verifier_stop); that is a transport failure, so the coordinator
    fails over, while an INTERNAL status the server itself sent stays a session error."""
    import grpc

    from coordinator.streams import _core_transport_failure

    def err(code, details):
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)

    assert _core_transport_failure(err(grpc.StatusCode.INTERNAL, "Internal error from Core"))
    assert not _core_transport_failure(err(grpc.StatusCode.INTERNAL, "verify failed: shape mismatch"))
    assert not _core_transport_failure(err(grpc.StatusCode.INVALID_ARGUMENT, "Internal error from Core"))

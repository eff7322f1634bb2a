"""The policy contract through the services: policy state survives a drafter failover, and every
block's feedback carries the measured draft, verify, queue, network and overhead times."""

from __future__ import annotations

from typing import Any, Dict, List

from coordinator.client import Chunk
from coordinator.local import LocalCluster
from steerspec.serving.linkemu import LinkModel
from steerspec.policies.base import BlockFeedback, PolicyBase
from steerspec.policies.registry import Key, register

PROMPT = [5, 17, 42, 9]
NEW_TOKENS = 40
LOADED: List[Dict[str, Any]] = []  # states restored into a policy (one per failover)
FEEDBACK: List[BlockFeedback] = []


@register("test_counting", {"k": Key(int, 3, "upper bound")}, doc="test: counts blocks, k cycles 1..k")
class CountingPolicy(PolicyBase):
    """A policy whose choice depends on its state: a fresh policy after a failover would restart the cycle."""

    name = "test_counting"

    def __init__(self, k: int = 3, context: Any = None) -> None:
        self.k = self.max_k = int(k)
        self.blocks = 0

    def next_k(self) -> int:
        return 1 + self.blocks % self.k

    def update(self, feedback: BlockFeedback) -> None:
        FEEDBACK.append(feedback)
        self.blocks += 1

    def state_dict(self) -> Dict[str, Any]:
        return {"blocks": self.blocks}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        LOADED.append(dict(state))
        self.blocks = int(state["blocks"])


async def test_policy_state_survives_a_drafter_failover(tiny_pair):
    verifier, drafter = tiny_pair
    LOADED.clear()
    FEEDBACK.clear()
    async with LocalCluster(str(verifier), str(drafter), drafters=2, eos_ids=(), link=LinkModel(rtt_ms=4)) as c:
        by_target = dict(zip(c.drafter_targets, c.drafter_servers))
        streamed, summary, chunks = [], None, 0
        async with c.client(retries=0) as client:
            async for item in client.agenerate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, k=3,
                                               policy="test_counting:k=3", timeout=60, session_id="policy-fo"):
                if isinstance(item, Chunk):
                    streamed.extend(item.token_ids)
                    chunks += 1
                    if chunks == 4:
                        placement = (await c.coordinator.store.get_session("policy-fo")).placement
                        await by_target[placement["drafter"]].stop(grace=0)
                else:
                    summary = item
    assert summary is not None and summary.resumes == 1 and len(streamed) == NEW_TOKENS
    assert len(LOADED) == 1 and LOADED[0]["blocks"] >= 2, LOADED  # resumed with its state, not a fresh policy
    drafted = [f.drafted for f in FEEDBACK]
    assert drafted[: len(drafted) // 2] and all(1 <= d <= 3 for d in drafted)
    assert all(f.verify_ms > 0 and f.draft_ms > 0 for f in FEEDBACK)
    assert all(f.network_ms >= 3.0 for f in FEEDBACK)  # the emulated 4 ms round trip
    assert all(f.queue_ms >= 0 for f in FEEDBACK)
    assert any(f.overhead_ms > 0 for f in FEEDBACK)  # the verifier hop's RPC time, seen by the drafter


async def test_unknown_policy_is_invalid_argument_on_the_wire(tiny_pair):
    import grpc
    import pytest

    verifier, drafter = tiny_pair
    async with LocalCluster(str(verifier), str(drafter), eos_ids=()) as c:
        async with c.client(retries=0) as client:
            for spec, known in (("nosuch", "known policies: "), ("fixed:q=1", "its keys: k")):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await client.acomplete(prompt_ids=PROMPT, max_new_tokens=4, policy=spec)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert known in info.value.details()


def test_cli_refuses_a_bad_policy_in_one_line(capsys, model_pair):
    from steerspec.cli import main

    verifier, drafter = model_pair
    for spec, known in (("nosuch", "known policies: "), ("fixed:q=1", "its keys: k")):
        code = main(["run", "x", "--policy", spec, "--verifier", str(verifier), "--drafter", str(drafter)])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and known in err


@register("test_warm", {"k": Key(int, 3, "upper bound")}, doc="test: a warm-start policy that counts blocks")
class WarmCounting(CountingPolicy):
    """CountingPolicy whose count describes the deployment: new sessions start from the latest one's."""

    name = "test_warm"
    warm_start = True

    def reset(self) -> None:
        RESETS.append(self.blocks)


RESETS: List[int] = []


async def test_a_warm_start_policy_starts_new_sessions_from_the_latest_state(tiny_pair):
    verifier, drafter = tiny_pair
    LOADED.clear()
    RESETS.clear()
    async with LocalCluster(str(verifier), str(drafter), eos_ids=()) as c:
        async with c.client(retries=0) as client:
            first = await client.acomplete(prompt_ids=PROMPT, max_new_tokens=12, k=3, policy="test_warm:k=3")
            assert LOADED == []  # the first session of a spec starts from the policy's priors
            await client.acomplete(prompt_ids=PROMPT, max_new_tokens=12, k=3, policy="test_warm:k=3")
            assert len(LOADED) == 1 and LOADED[0]["blocks"] == first.rounds - 1  # state sent with its last block
            assert RESETS == [LOADED[0]["blocks"]]  # then reset for the new sequence, keeping what it learned
            await client.acomplete(prompt_ids=PROMPT, max_new_tokens=12, k=3, policy="test_warm:k=2")
            assert len(LOADED) == 1  # another spec is another policy: no state shared
            await client.acomplete(prompt_ids=PROMPT, max_new_tokens=12, k=3, policy="test_counting:k=3")
            assert len(LOADED) == 1  # a policy without warm_start always starts fresh

"""Through the services a policy's own bound (gmax, max, k of its spec), not the request's k, caps
a block: adaptive policies draft as long through the coordinator as in process, still exactly."""

from __future__ import annotations

import grpc
import pytest

from coordinator.client import Chunk
from coordinator.local import LocalCluster
from coordinator.loop import SessionRequest
from steerspec.policies import max_block
from tests.coord_helpers import greedy_reference

PROMPTS = [[5, 17, 42, 9], [3, 1, 4, 1, 5], [11, 22, 33], [7, 8, 9, 10, 11, 12]]
NEW_TOKENS = 48
SPEC = "gammatune:k=2,gmax=8,eta=1,delta=4"  # a fully accepted block of 2 makes the next one 6 long


def test_max_block_reads_the_bound_from_the_spec():
    assert max_block("fixed:k=6") == 6
    assert max_block("gammatune:gmax=8") == 8
    assert max_block("gammatune:k=12,gmax=8") == 12  # the initial γ may exceed γ_max for one block
    assert max_block("heuristic:max=10") == 10
    assert max_block("pacer:max=16") == 16  # no head needed to read the bound
    assert max_block("latency") == 32
    assert SessionRequest(prompt_ids=[1], k=4, policy="fixed").block_limit == 4
    assert SessionRequest(prompt_ids=[1], k=4, policy="gammatune:gmax=8").block_limit == 8


async def test_gammatune_drafts_past_the_request_k_through_the_services(tiny_pair):
    verifier, drafter = tiny_pair
    async with LocalCluster(str(verifier), str(drafter), eos_ids=()) as c:
        async with c.client(retries=0) as client:
            longest = 0
            for prompt in PROMPTS:
                tokens, drafted = [], []
                async for item in client.agenerate(prompt_ids=prompt, max_new_tokens=NEW_TOKENS, k=4,
                                                   policy=SPEC, timeout=120):
                    if isinstance(item, Chunk):
                        tokens.extend(item.token_ids)
                        drafted.append(item.drafted)
                assert tokens == greedy_reference(verifier, prompt, NEW_TOKENS), prompt
                assert max(drafted) <= 8, drafted
                longest = max(longest, max(drafted))
    assert longest > 4  # past the request's k = 4 (before, the services capped blocks there)


async def test_a_policy_bound_past_the_limit_is_invalid_argument(tiny_pair):
    verifier, drafter = tiny_pair
    async with LocalCluster(str(verifier), str(drafter), eos_ids=()) as c:
        async with c.client(retries=0) as client:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.acomplete(prompt_ids=PROMPTS[0], max_new_tokens=4, policy="heuristic:max=65")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max" in info.value.details()

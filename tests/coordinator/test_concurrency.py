"""8 concurrent sessions through one coordinator: each output equals its own verifier-only greedy output."""

from __future__ import annotations

import asyncio

from coord_helpers import greedy_reference
from coordinator.client import Chunk
from coordinator.local import LocalCluster
import pytest

N_SESSIONS = 8
NEW_TOKENS = 12


@pytest.mark.slow
async def test_eight_concurrent_sessions_match_greedy(model_pair):
    verifier, drafter = model_pair
    prompts = [[5 + i, 17, 42 + 3 * i, 9 + i] for i in range(N_SESSIONS)]
    wants = [greedy_reference(verifier, p, NEW_TOKENS) for p in prompts]
    async with LocalCluster(str(verifier), str(drafter), eos_ids=(),
                            verifier_options={"batch_window_ms": 3.0}) as cluster:
        async with cluster.client(retries=0) as client:
            async def one(prompt):
                streamed, summary = [], None
                async for item in client.agenerate(prompt_ids=prompt, max_new_tokens=NEW_TOKENS, k=4, timeout=90):
                    if isinstance(item, Chunk):
                        streamed.extend(item.token_ids)
                    else:
                        summary = item
                return streamed, summary

            results = await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), timeout=120)
        verifiers, _ = await cluster.stats()
    for want, (streamed, summary) in zip(wants, results):
        assert streamed == want == summary.token_ids
    assert verifiers[0].active_sessions == 0 and verifiers[0].blocks_total >= N_SESSIONS


async def test_concurrent_sessions_share_verifier_batches(tiny_pair):
    """Blocks of concurrent sessions are verified together (batch_size > 1), outputs still exact."""
    verifier, drafter = tiny_pair
    prompts = [[7 + i, 3, 11 * i % 300, 2] for i in range(N_SESSIONS)]
    async with LocalCluster(str(verifier), str(drafter), eos_ids=(),
                            verifier_options={"batch_window_ms": 5.0}) as cluster:
        results = await asyncio.wait_for(asyncio.gather(
            *(cluster.generate(p, max_new_tokens=NEW_TOKENS, k=4) for p in prompts)), timeout=90)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == greedy_reference(verifier, prompt, NEW_TOKENS)
    assert max(b.batch_size for r in results for b in r.blocks) > 1

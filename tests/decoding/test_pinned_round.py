"""Pinned outputs of the round (captured before the round was refactored into steerspec/decoding/rounds.py).

Greedy and seeded T=1 generations of the bundled pair, in process and through the three services
(LocalCluster): tokens and per-block accepted/drafted counts must stay exactly what they were.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from steerspec.decoding.engine import DecodeConfig, speculative_generate
from steerspec.models import cached_lm, context_length, eos_token_ids
from steerspec.policies import FixedK
from steerspec.decoding.sampling import SamplingParams

from conftest import BUNDLED_DRAFTER, BUNDLED_VERIFIER, bundled_pair_present

PINNED = json.loads((Path(__file__).parent / "pinned_round_outputs.json").read_text())
CASES = {"greedy_k4": (0.0, 1.0, 4), "t1_k4": (1.0, 1.0, 4), "t1_p95_k6": (1.0, 0.95, 6)}
MAX_NEW = 24

pytestmark = pytest.mark.skipif(not bundled_pair_present(), reason="needs the bundled model pair")


def _row(tokens, accepted, drafted) -> dict:
    return {"tokens": list(tokens), "accepted": list(accepted), "drafted": list(drafted)}


@pytest.fixture(scope="module")
def pair():
    from steerspec.models import load_model, load_tokenizer

    verifier, drafter = load_model(BUNDLED_VERIFIER), load_model(BUNDLED_DRAFTER)
    return verifier, drafter, load_tokenizer(BUNDLED_VERIFIER)


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_outputs_are_pinned(pair, case):
    verifier, drafter, tok = pair
    temperature, top_p, k = CASES[case]
    eos, limit = eos_token_ids(verifier, tok), min(context_length(verifier), context_length(drafter))
    cv, cd = cached_lm(verifier), cached_lm(drafter)
    for i, prompt in enumerate(PINNED["prompts"]):
        config = DecodeConfig(max_new_tokens=MAX_NEW, sampling=SamplingParams(temperature=temperature, top_p=top_p),
                              seed=100 + i, eos_token_ids=eos, max_length=limit)
        r = speculative_generate(cv, cd, prompt, config, FixedK(k))
        assert _row(r.token_ids, r.block_accepted, r.block_drafted) == PINNED["engine"][case][i]


@pytest.mark.slow
def test_service_outputs_are_pinned():
    from coordinator.local import LocalCluster

    async def run() -> dict:
        got = {}
        async with LocalCluster(str(BUNDLED_VERIFIER), str(BUNDLED_DRAFTER)) as cluster:
            for case, (temperature, top_p, k) in sorted(CASES.items()):
                got[case] = []
                for i, prompt in enumerate(PINNED["prompts"]):
                    r = await cluster.generate(prompt, max_new_tokens=MAX_NEW, temperature=temperature, top_p=top_p,
                                               seed=100 + i, k=k)
                    got[case].append(_row(r.token_ids, r.block_accepted, r.block_drafted))
        return got

    assert asyncio.run(run()) == PINNED["services"]

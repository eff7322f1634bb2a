"""At T=1, adaptive draft-length policies keep speculative decoding exact on the bundled pair.

Samples are drawn 50 sessions at a time through the services' batched draft loop and batched
verification (tests/distribution_helpers.py `sample_batched`); each session has its own policy,
never reset between its samples, so its state (GammaTune's γ̄, Pacer's context, the latency
policy's estimates) and with it every block's length change from sample to sample and block to
block, and sessions of different lengths share each batch. The first generated tokens must still follow the verifier's exact distribution:
chi-square over the most likely tokens as bins plus one bin for the rest (tests/
distribution_helpers.py), fixed seeds, p > 0.001. The same machinery rejects a decoder that
accepts every draft (the drafter's distribution), so the test can fail.
"""

from __future__ import annotations

from collections import Counter
from typing import List, Tuple

import pytest
import torch
from distribution_helpers import P_MIN, first_two_p_values, pick_prompt, sample_batched

from steerspec.decoding.drafting import DraftRow, draft_blocks
from steerspec.decoding.engine import DecodeConfig, make_generators
from steerspec.models import cached_lm
from steerspec.policies import BlockFeedback, PolicyContext, make_policy
from steerspec.policies.heads import build_head, save_head
from steerspec.decoding.sampling import SamplingParams

N_SAMPLES = 1000
ROWS = 50  # sessions sampled at once
PARAMS = SamplingParams(temperature=1.0)
CONFIG = DecodeConfig(max_new_tokens=2, sampling=PARAMS, draft_top_k=8)


@pytest.fixture(scope="module")
def pair(loaded_pair, eval_prompts, tmp_path_factory):
    verifier, drafter, tok = loaded_pair
    ids = pick_prompt(verifier, drafter, tok, eval_prompts, PARAMS)
    size = int(drafter.config.hidden_size)
    torch.manual_seed(0)  # an untrained head: exactness must not depend on what it predicts
    head = tmp_path_factory.mktemp("heads") / "pacer.safetensors"
    save_head(head, "pacer", build_head("pacer", {"hidden_size": size}), {"hidden_size": size}, {})
    return verifier, drafter, ids, head, size


def feedback(accepted: int, drafted: int) -> BlockFeedback:
    """Fixed stage times of a remote regime (50 ms away), so the latency policy drafts long and the
    run is deterministic."""
    return BlockFeedback(accepted, drafted, draft_ms=1.0 * drafted, verify_ms=2.0, network_ms=50.0)


def drafter_prefixes(drafter, ids, policies, g_draft, lengths: List[int]) -> Counter:
    """N_SAMPLES first-two-token pairs with every draft committed unverified (the drafter's
    distribution, which the chi-square must reject), one session per policy drafting at once."""
    caches = [cached_lm(drafter) for _ in policies]
    counts: Counter = Counter()
    while sum(counts.values()) < N_SAMPLES:
        rows = range(min(len(policies), N_SAMPLES - sum(counts.values())))
        committed = {r: list(ids) for r in rows}
        while any(len(c) < len(ids) + 2 for c in committed.values()):
            todo = [r for r in rows if len(committed[r]) < len(ids) + 2]
            blocks = draft_blocks([DraftRow(caches[r], committed[r], policies[r].next_k(), CONFIG, g_draft,
                                            policies[r]) for r in todo])
            for r, block in zip(todo, blocks):
                drafted = int(block.tokens.shape[1])
                lengths.append(drafted)
                committed[r] += block.tokens[0].tolist()
                policies[r].update(feedback(drafted, drafted))
        for r in rows:
            counts[tuple(committed[r][len(ids):len(ids) + 2])] += 1
            caches[r].rollback(min(caches[r].length, len(ids) - 1))
    return counts


def run(pair, spec: str, seed: int, accept_all: bool = False):
    """N_SAMPLES first-two-token pairs: ROWS sessions at a time (batched drafting and verification),
    each with its own policy that is never reset, so its state carries from sample to sample."""
    verifier, drafter, ids, head, size = pair
    spec = spec.replace("HEAD", str(head))
    g_draft, g_verify = make_generators(seed)
    lengths: List[int] = []
    policies = [make_policy(spec, PolicyContext(hidden_size=size)) for _ in range(ROWS)]
    if accept_all:
        return drafter_prefixes(drafter, ids, policies, g_draft, lengths), lengths
    counts = sample_batched(verifier, drafter, ids, CONFIG, N_SAMPLES, ROWS, g_draft, g_verify, Counter(),
                            policies=policies, feedback=feedback, lengths=lengths)
    assert sum(counts.values()) == N_SAMPLES
    return counts, lengths


def p_values(pair, counts: Counter) -> Tuple[float, float]:
    """Chi-square p of the first token's marginal and of the first two tokens' joint distribution."""
    verifier, _, ids, _, _ = pair
    return first_two_p_values(verifier, ids, PARAMS, counts, N_SAMPLES)


@pytest.mark.parametrize("spec, seed", [("gammatune:k=3,gmax=8", 11), ("gammatune+:k=3,gmax=8,tau=0.3", 12),
                                        ("pacer:b=2,t=0.5,max=8,head=HEAD", 13), ("latency:max=8", 14)])
@pytest.mark.slow
def test_adaptive_policy_samples_the_verifier_distribution(pair, spec, seed):
    counts, lengths = run(pair, spec, seed)
    assert len(set(lengths)) > 1, f"{spec}: every block had the same length {lengths[0]}"  # the state moved
    p_first, p_joint = p_values(pair, counts)
    assert p_first > P_MIN and p_joint > P_MIN, (spec, p_first, p_joint)


@pytest.mark.slow
def test_the_chi_square_rejects_a_decoder_that_accepts_everything(pair):
    counts, _ = run(pair, "fixed:k=2", 15, accept_all=True)
    p_first, p_joint = p_values(pair, counts)
    assert p_first < P_MIN and p_joint < P_MIN, (p_first, p_joint)

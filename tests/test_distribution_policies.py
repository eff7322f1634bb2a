"""At T=1, adaptive draft-length policies keep speculative decoding exact on the bundled pair.

The policy is never reset between samples, so its state (GammaTune's γ̄, Pacer's context, the
latency policy's estimates) and with it every block's length change from sample to sample and
block to block. The first generated tokens must still follow the verifier's exact distribution:
chi-square over the most likely tokens as bins plus one bin for the rest (tests/
distribution_helpers.py), fixed seeds, p > 0.001. The same machinery rejects a decoder that
accepts every draft (the drafter's distribution), so the test can fail.
"""

from __future__ import annotations

from collections import Counter
from typing import List, Tuple

import pytest
import torch
from distribution_helpers import P_MIN, first_two_p_values, pick_prompt

from steerspec.engine import DecodeConfig, draft_block, make_generators, prefill, verify_block
from steerspec.models import cached_lm
from steerspec.policies import BlockFeedback, PolicyContext, make_policy
from steerspec.policies.heads import build_head, save_head
from steerspec.sampling import SamplingParams

N_SAMPLES = 1000
PARAMS = SamplingParams(temperature=1.0)
CONFIG = DecodeConfig(max_new_tokens=2, sampling=PARAMS, draft_top_k=8)


@pytest.fixture(scope="module")
def pair(loaded_pair, eval_prompts, tmp_path_factory):
    verifier, drafter, tok = loaded_pair
    ids = pick_prompt(verifier, drafter, tok, eval_prompts, PARAMS)
    v, d = cached_lm(verifier), cached_lm(drafter)
    prefill(v, ids)
    size = int(drafter.config.hidden_size)
    torch.manual_seed(0)  # an untrained head: exactness must not depend on what it predicts
    head = tmp_path_factory.mktemp("heads") / "pacer.safetensors"
    save_head(head, "pacer", build_head("pacer", {"hidden_size": size}), {"hidden_size": size}, {})
    return verifier, v, d, ids, head, size


def sample_prefix(v, d, ids, policy, g_draft, g_verify, lengths: List[int], accept_all: bool = False) -> Tuple[int, int]:
    """Blocks of the policy's length (never cut by a budget) until two tokens are committed; the
    first two. Feedback reports fixed stage times of a remote regime (50 ms away), so the latency
    policy drafts long and the run is deterministic. `accept_all` commits every draft unverified
    (the drafter's distribution)."""
    committed = list(ids)
    base = v.length
    while len(committed) < len(ids) + 2:
        n = len(committed)
        block = draft_block(d, committed, policy.next_k(), CONFIG, g_draft, policy)
        drafted = int(block.tokens.shape[1])
        lengths.append(drafted)
        tokens = block.tokens[0].tolist()
        if accept_all:
            accepted, new = drafted, tokens
        else:
            outcome, _ = verify_block(v, committed[-1], block, CONFIG, g_verify)
            accepted = int(outcome.accepted[0])
            new = tokens[:accepted] + [int(outcome.next_tokens[0])]
        if d.length > n + accepted:
            d.rollback(n + accepted)
        committed += new
        policy.update(BlockFeedback(accepted, drafted, draft_ms=1.0 * drafted, verify_ms=2.0, network_ms=50.0))
    v.rollback(base)
    d.rollback(min(d.length, len(ids) - 1))
    return committed[len(ids)], committed[len(ids) + 1]


def run(pair, spec: str, seed: int, accept_all: bool = False):
    verifier, v, d, ids, head, size = pair
    spec = spec.replace("HEAD", str(head))
    policy = make_policy(spec, PolicyContext(hidden_size=size))
    g_draft, g_verify = make_generators(seed)
    lengths: List[int] = []
    counts: Counter = Counter(sample_prefix(v, d, ids, policy, g_draft, g_verify, lengths, accept_all)
                              for _ in range(N_SAMPLES))
    return counts, lengths


def p_values(pair, counts: Counter) -> Tuple[float, float]:
    """Chi-square p of the first token's marginal and of the first two tokens' joint distribution."""
    verifier, _, _, ids, _, _ = pair
    return first_two_p_values(verifier, ids, PARAMS, counts, N_SAMPLES)


@pytest.mark.parametrize("spec, seed", [("gammatune:k=3,gmax=8", 11), ("gammatune+:k=3,gmax=8,tau=0.3", 12),
                                        ("pacer:b=2,t=0.5,max=8,head=HEAD", 13), ("latency:max=8", 14)])
def test_adaptive_policy_samples_the_verifier_distribution(pair, spec, seed):
    counts, lengths = run(pair, spec, seed)
    assert len(set(lengths)) > 1, f"{spec}: every block had the same length {lengths[0]}"  # the state moved
    p_first, p_joint = p_values(pair, counts)
    assert p_first > P_MIN and p_joint > P_MIN, (spec, p_first, p_joint)


def test_the_chi_square_rejects_a_decoder_that_accepts_everything(pair):
    counts, _ = run(pair, "fixed:k=2", 15, accept_all=True)
    p_first, p_joint = p_values(pair, counts)
    assert p_first < P_MIN and p_joint < P_MIN, (p_first, p_joint)

"""At T=1, speculative decoding on the real pair samples exactly the verifier's distribution.

Chi-square goodness of fit of the empirical distribution of the first generated tokens against
the verifier's exact distribution (computed by a fresh forward pass; direct verifier sampling
draws from exactly that). Rare tokens are pooled into one bin (expected count < 5).
"""

from __future__ import annotations

from collections import Counter

import torch
from scipy.stats import chisquare

from steerspec.engine import DecodeConfig, draft_block, make_generators, prefill, verify_block
from steerspec.models import cached_lm
from steerspec.sampling import SamplingParams, probs_from_logits

P_MIN = 1e-3
MIN_EXPECTED = 5.0


def chi_square_p(counts: Counter, expected_probs: dict, n: int) -> float:
    """p-value of observed counts against expected probabilities, pooling rare outcomes."""
    for outcome in counts:
        assert expected_probs.get(outcome, 0.0) > 0, f"sampled {outcome}, which has probability 0"
    common = [o for o, p in expected_probs.items() if p * n >= MIN_EXPECTED]
    observed = [counts.get(o, 0) for o in common]
    expected = [expected_probs[o] * n for o in common]
    rest_obs = n - sum(observed)
    rest_exp = n - sum(expected)
    if rest_exp >= 1e-9:
        observed.append(rest_obs)
        expected.append(rest_exp)
    assert len(observed) >= 3, "too few bins for a meaningful test"
    return float(chisquare(observed, expected).pvalue)


def verifier_probs(model, ids, params: SamplingParams) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor(ids)).logits[:, -1]
    return probs_from_logits(logits, params.temperature, params.top_k, params.top_p)


def pick_prompt(verifier, drafter, tok, prompts, params):
    """A prompt prefix where the drafter's first proposal is accepted about half the time."""
    best, best_gap = None, 2.0
    for text in prompts[:16]:
        ids = tok(text, add_special_tokens=False)["input_ids"][:16]
        p = verifier_probs(verifier, [ids], params)[0]
        q = verifier_probs(drafter, [ids], params)[0]
        acceptance = 1.0 - 0.5 * float((p - q).abs().sum())  # P(first draft accepted) = 1 - TV(p, q)
        gap = abs(acceptance - 0.5) + (1.0 if float(p.max()) > 0.9 else 0.0)
        if gap < best_gap:
            best, best_gap = ids, gap
    return best


def sample_two_tokens(v, d, ids, config, k, g_draft, g_verify, accepted_counts):
    """The engine's round loop (draft_block, verify_block, commit, drafter rollback) until two
    tokens are committed; then both caches go back to the prompt, ready for the next sample."""
    committed = list(ids)
    base = v.length
    while len(committed) < len(ids) + 2:
        n = len(committed)
        block = draft_block(d, committed, k, config, g_draft)
        outcome, _ = verify_block(v, committed[-1], block, config, g_verify)
        accepted = int(outcome.accepted[0])
        accepted_counts[accepted] += 1
        if d.length > n + accepted:
            d.rollback(n + accepted)
        committed += block.tokens[0, :accepted].tolist() + [int(outcome.next_tokens[0])]
    v.rollback(base)
    d.rollback(min(d.length, len(ids) - 1))
    return tuple(committed[len(ids):len(ids) + 2])


def test_first_two_tokens_match_verifier_sampling(loaded_pair, eval_prompts):
    """2,000 samples of the first two tokens at T=1 (k = 3, sparse top-8 drafter): the joint and
    the first-token marginal both match the verifier's exact distribution (chi-square)."""
    verifier, drafter, tok = loaded_pair
    params = SamplingParams(temperature=1.0)
    config = DecodeConfig(max_new_tokens=2, sampling=params, draft_top_k=8)
    ids = pick_prompt(verifier, drafter, tok, eval_prompts, params)
    v, d = cached_lm(verifier), cached_lm(drafter)
    prefill(v, ids)
    g_draft, g_verify = make_generators(2024)
    n = 2000
    counts: Counter = Counter()
    accepted_counts: Counter = Counter()
    for _ in range(n):
        counts[sample_two_tokens(v, d, ids, config, 3, g_draft, g_verify, accepted_counts)] += 1
    blocks = sum(accepted_counts.values())
    assert accepted_counts[0] > 0.05 * blocks and blocks - accepted_counts[0] > 0.05 * blocks, accepted_counts
    # exact p(x1) and p(x2 | x1) for every first token that matters, in one batched pass
    p1 = verifier_probs(verifier, [ids], params)[0]
    firsts = sorted(set(torch.nonzero(p1 * n >= 0.5).flatten().tolist()) | {a for a, _ in counts})
    p2 = verifier_probs(verifier, [ids + [a] for a in firsts], params)
    joint = {}
    for row, a in enumerate(firsts):
        pa = p1[a] * p2[row]
        for b in torch.nonzero(pa * n >= 1e-3).flatten().tolist():
            joint[(a, b)] = float(pa[b])
        for pair in counts:
            if pair[0] == a and pair not in joint:
                joint[pair] = float(pa[pair[1]])
    first_counts: Counter = Counter()
    for (a, _), c in counts.items():
        first_counts[a] += c
    marginal = {i: float(p1[i]) for i in torch.nonzero(p1 > 0).flatten().tolist()}
    assert chi_square_p(first_counts, marginal, n) > P_MIN
    assert chi_square_p(counts, joint, n) > P_MIN

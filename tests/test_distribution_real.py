"""At T=1, speculative decoding on the real pair samples exactly the verifier's distribution.

Chi-square goodness of fit of the empirical distribution of the first generated tokens against
the verifier's exact distribution (computed by a fresh forward pass; direct verifier sampling
draws from exactly that). Rare tokens are pooled into one bin (expected count < 5).
"""

from __future__ import annotations

from collections import Counter

import torch
from distribution_helpers import P_MIN, chi_square_p, pick_prompt, sample_tokens, verifier_probs

from steerspec.engine import DecodeConfig, make_generators, prefill
from steerspec.models import cached_lm
from steerspec.sampling import SamplingParams


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
        counts[sample_tokens(v, d, ids, config, 3, g_draft, g_verify, accepted_counts)] += 1
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

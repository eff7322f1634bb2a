"""At T=1, speculative decoding on the real pair samples exactly the verifier's distribution.

Chi-square goodness of fit of the empirical distribution of the first generated tokens against
the verifier's exact distribution (computed by a fresh forward pass; direct verifier sampling
draws from exactly that). Rare tokens are pooled into one bin (expected count < 5).
"""

from __future__ import annotations

from collections import Counter

from distribution_helpers import P_MIN, first_two_p_values, pick_prompt, sample_tokens

from steerspec.decoding.engine import DecodeConfig, make_generators, prefill
from steerspec.models import cached_lm, load_model, load_tokenizer
from steerspec.models.invariant_pass import InvariantPlan, set_invariant
from steerspec.models.layouts import native_bf16
from steerspec.decoding.sampling import SamplingParams
import pytest


@pytest.mark.slow
def test_first_two_tokens_match_verifier_sampling(loaded_pair, eval_prompts):
    """1,000 samples of the first two tokens at T=1 (k = 3, sparse top-8 drafter) through the engine's
    own sequential round and rollbacks: the joint and the first-token marginal both match the
    verifier's exact distribution (chi-square), at the sample size of the batched path's tests."""
    check_first_two_tokens(*loaded_pair, eval_prompts)


@pytest.mark.slow
@pytest.mark.skipif(not native_bf16(), reason="bfloat16 is emulated on this CPU")
def test_first_two_tokens_match_verifier_sampling_in_bfloat16(model_pair, eval_prompts):
    """The same in bfloat16, the verifier's passes batch-invariant (steerspec/models/invariant_pass.py)."""
    verifier_dir, drafter_dir = model_pair
    verifier = load_model(verifier_dir, dtype="bfloat16")
    set_invariant(verifier, InvariantPlan())
    check_first_two_tokens(verifier, load_model(drafter_dir, dtype="bfloat16"), load_tokenizer(verifier_dir),
                           eval_prompts)


def check_first_two_tokens(verifier, drafter, tok, eval_prompts) -> None:
    """Sample the first two tokens 1,000 times through the engine's round; chi-square against the verifier's."""
    params = SamplingParams(temperature=1.0)
    config = DecodeConfig(max_new_tokens=2, sampling=params, draft_top_k=8)
    ids = pick_prompt(verifier, drafter, tok, eval_prompts, params)
    v, d = cached_lm(verifier), cached_lm(drafter)
    prefill(v, ids)
    g_draft, g_verify = make_generators(2024)
    n = 1000
    counts: Counter = Counter()
    accepted_counts: Counter = Counter()
    for _ in range(n):
        counts[sample_tokens(v, d, ids, config, 3, g_draft, g_verify, accepted_counts)] += 1
    blocks = sum(accepted_counts.values())
    assert accepted_counts[0] > 0.05 * blocks and blocks - accepted_counts[0] > 0.05 * blocks, accepted_counts
    p_first, p_joint = first_two_p_values(verifier, ids, params, counts, n)
    assert p_first > P_MIN
    assert p_joint > P_MIN

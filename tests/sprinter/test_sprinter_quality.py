"""The quality measure SPRINTER's bench reports: per-token NLL against exact decoding's expectation at the
same prefixes, and paired perplexity ratios with intervals."""

from __future__ import annotations

import math

import pytest
import torch

from steerspec.decoding.sampling import SamplingParams
from steerspec.sprinter.quality import SequenceQuality, quality_ratios, token_nll_and_baseline


def test_baseline_is_the_entropy_at_t1_and_the_argmax_nll_when_greedy():
    torch.manual_seed(0)
    logits = torch.randn(5, 11) * 2
    tokens = torch.tensor([0, 3, 3, 10, 7])
    logp = logits.log_softmax(-1)
    nll, base = token_nll_and_baseline(logits, tokens, SamplingParams(temperature=1.0))
    assert torch.allclose(nll, -logp[torch.arange(5), tokens])
    assert torch.allclose(base, -(logp.exp() * logp).sum(-1), atol=1e-6)
    _, greedy = token_nll_and_baseline(logits, tokens, SamplingParams(temperature=0.0))
    assert torch.allclose(greedy, -logp.max(-1).values, atol=1e-6)


def test_excess_is_zero_in_expectation_when_sampling_from_p_and_the_cross_entropy_gap_from_q():
    """The control variate: drawing from the verifier's p leaves E[nll − baseline] = 0, drawing from q
    leaves H(q, p) − H(p); 20,000 seeded draws land within a few standard errors of each."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 9, generator=g) * 1.5
    q_logits = logits + torch.randn(4, 9, generator=g) * 2
    p, q = logits.softmax(-1), q_logits.softmax(-1)
    n = 20_000
    for dist, want in ((p, torch.zeros(4)), (q, -(q * p.log()).sum(-1) + (p * p.log()).sum(-1))):
        tokens = torch.multinomial(dist, n, replacement=True, generator=g)  # [4, n]
        rows = logits.repeat_interleave(n, 0)
        nll, base = token_nll_and_baseline(rows, tokens.reshape(-1), SamplingParams(temperature=1.0))
        excess = (nll - base).view(4, n)
        se = excess.std(-1) / math.sqrt(n)
        assert ((excess.mean(-1) - want).abs() < 4 * se + 1e-3).all(), (excess.mean(-1), want)
    assert (want.abs() > 0.05).all()  # the q case is a real gap (either sign), not zero by accident


def test_quality_ratios_pair_by_sequence_and_give_intervals():
    exact = [SequenceQuality(10, 20.0, 19.0), SequenceQuality(10, 30.0, 31.0), SequenceQuality(5, 10.0, 10.0)]
    same = quality_ratios(exact, exact)
    assert same["ppl_ratio"] == same["ppl_ratio_low"] == same["ppl_ratio_high"] == 1.0
    assert same["ppl_drift"] == 1.0
    assert same["ppl_excess"] == pytest.approx(math.exp((60 - 60) / 25))
    worse = [SequenceQuality(s.tokens, s.nll + 0.5 * s.tokens + i, s.baseline) for i, s in enumerate(exact)]
    r = quality_ratios(worse, exact)
    assert r["ppl_ratio"] == pytest.approx(math.exp(0.5 + 3 / 25))
    assert r["ppl_ratio_low"] < r["ppl_ratio"] < r["ppl_ratio_high"]
    assert r["ppl_excess"] == pytest.approx(math.exp((63 + 12.5 - 60) / 25)) and r["ppl_drift"] == 1.0
    with pytest.raises(ValueError, match="equal lengths"):
        quality_ratios(worse[:2], exact)

"""Logits warping matches transformers' own warpers; sparse top-K truncation and sampling behave."""

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from steerspec.decoding.sampling import (SamplingParams, draft_distribution, probs_from_logits, sample,
    sample_sparse, truncate_top_k, warp_logits, wire_dist)


def hf_warp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    out = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        out = TopKLogitsWarper(top_k)(None, out)
    if top_p < 1.0:
        out = TopPLogitsWarper(top_p)(None, out)
    return out


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 10, 1.0), (1.0, 0, 0.9), (0.8, 20, 0.75)])
def test_warp_matches_transformers(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(6, 100) * 3
    ours = probs_from_logits(logits, temperature, top_k, top_p)
    ref = hf_warp(logits, temperature, top_k, top_p).softmax(-1)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)


def test_greedy_rows_are_one_hot_and_per_row_params():
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    probs = probs_from_logits(logits, torch.tensor([0.0, 1.0, 0.0]))
    assert torch.equal(probs[0], torch.nn.functional.one_hot(logits[0].argmax(), 50).float())
    assert torch.equal(probs[2], torch.nn.functional.one_hot(logits[2].argmax(), 50).float())
    torch.testing.assert_close(probs[1], logits[1].softmax(-1))


def test_top_p_keeps_at_least_one_token():
    logits = torch.tensor([[10.0, 0.0, -1.0]])
    probs = probs_from_logits(logits, 1.0, 0, 0.01)
    assert probs[0, 0] == 1.0


def test_truncate_top_k_is_sparse_and_normalised():
    torch.manual_seed(2)
    probs = torch.randn(4, 3, 200).softmax(-1)
    dist = truncate_top_k(probs, 16)
    assert dist.ids.shape == (4, 3, 16) and dist.probs.shape == (4, 3, 16)
    torch.testing.assert_close(dist.probs.sum(-1), torch.ones(4, 3))
    dense = dist.to_dense(200)
    assert (dense > 0).sum(-1).max() == 16
    full = truncate_top_k(probs, 0)
    torch.testing.assert_close(full.to_dense(200), probs)


def test_draft_distribution_spreads_the_dropped_mass_evenly():
    torch.manual_seed(3)
    probs = torch.randn(5, 300).softmax(-1)
    dist = draft_distribution(probs, 16)
    top = probs.topk(16, -1)
    assert torch.equal(dist.ids, top.indices)
    assert (dist.probs <= top.values).all(), "fp16 rounds toward zero: a listed token never gains mass"
    torch.testing.assert_close(dist.probs, top.values, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(dist.floor, (1 - top.values.sum(-1)) / (300 - 16), atol=1e-6, rtol=1e-3)
    dense = dist.to_dense(300)
    torch.testing.assert_close(dense.double().sum(-1), torch.ones(5, dtype=torch.float64))
    assert dense.min() > 0
    outside = torch.ones(300, dtype=torch.bool)
    outside[dist.ids[0]] = False
    assert torch.equal(dist.prob_of(torch.nonzero(outside)[0].expand(5)), dist.floor)
    off = draft_distribution(probs, 16, tail=False)
    assert off.floor.max() < 1e-5, "renormalised: only fp16 rounding crumbs are left to spread"
    assert off.probs.sum(-1).min() > dist.probs.sum(-1).max()


def test_full_vocabulary_q_is_normalised_so_the_output_is_p():
    """draft-top-k 0 lists every id: what fp16 rounds off has no tail to go to, so rows are rescaled;
    otherwise the drafter samples q / Σq while the verifier accepts with p / q (output ≠ p)."""
    vocab = 50_000
    q_true = torch.full((1, vocab), (1 - 0.9762) / (vocab - 1), dtype=torch.float64)
    q_true[0, 0] = 0.9762  # the rest sit in fp16's subnormal range, where rounding down loses ~10%
    q = draft_distribution(q_true.float(), 0).to_dense(vocab)[0].double()
    assert abs(float(q.sum()) - 1.0) < 1e-6
    p = torch.full((vocab,), 0.1 / (vocab - 1), dtype=torch.float64)
    p[0] = 0.9
    accepted = torch.minimum(p, q)  # drafted and accepted, plus the residual after a rejection
    out = accepted + (1 - accepted.sum()) * (p - q).clamp(min=0) / (p - q).clamp(min=0).sum()
    assert torch.allclose(out, p, atol=1e-7, rtol=0)


def test_wire_dist_is_exact_whatever_the_row_shape():
    torch.manual_seed(4)
    probs = torch.randn(8, 1000).softmax(-1)
    dist = draft_distribution(probs, 64)
    rows = [draft_distribution(probs[i : i + 1], 64) for i in range(8)]
    assert torch.equal(torch.cat([r.probs for r in rows]), dist.probs)
    assert torch.equal(torch.cat([r.floor for r in rows]), dist.floor)
    # decoding the fp16 values again gives the identical distribution (what the verifier does)
    again = wire_dist(dist.ids, dist.probs.to(torch.float16).float(), 1000)
    assert torch.equal(again.probs, dist.probs) and torch.equal(again.floor, dist.floor)
    heavy = wire_dist(dist.ids[:1, :2], torch.tensor([[0.75, 0.75]]), 1000)
    assert heavy.probs.tolist() == [[0.5, 0.5]] and heavy.floor.tolist() == [0.0]


def test_sampling_from_a_spread_tail_reaches_unlisted_tokens():
    dist = wire_dist(torch.tensor([[0, 1]]).repeat(4000, 1), torch.tensor([[0.25, 0.25]]).repeat(4000, 1), 6)
    drawn = sample_sparse(dist, torch.Generator().manual_seed(1))
    counts = torch.bincount(drawn, minlength=6).float() / 4000
    torch.testing.assert_close(counts, torch.tensor([0.25, 0.25, 0.125, 0.125, 0.125, 0.125]), atol=0.03, rtol=0)


def test_sampling_is_seeded_and_respects_support():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0]]).repeat(64, 1)
    a = sample(probs, torch.Generator().manual_seed(7))
    b = sample(probs, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    assert set(a.tolist()) <= {1, 2}
    dist = truncate_top_k(torch.tensor([[0.1, 0.6, 0.3]]).repeat(5, 1), 2)
    gens = [torch.Generator().manual_seed(i) for i in range(5)]
    assert set(sample_sparse(dist, gens).tolist()) <= {1, 2}


@pytest.mark.parametrize(
    "params,message",
    [
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(top_p=0.0), "top-p"),
        (SamplingParams(top_p=1.5), "top-p"),
        (SamplingParams(top_k=-1), "top-k"),
        (SamplingParams(temperature=1e-40), "at least 1e-05"),  # logits / T would overflow to NaN
    ],
)
def test_params_validation(params, message):
    with pytest.raises(ValueError, match=message):
        params.validate()


def test_warp_handles_all_neg_inf_free_rows():
    logits = torch.randn(2, 10)
    out = warp_logits(logits, 1.0, 3, 1.0)
    assert torch.isfinite(out).sum(-1).tolist() == [3, 3]

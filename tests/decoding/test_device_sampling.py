"""Device-side sampling equals the host path: warping and draft q bit for bit, samples in
distribution (chi-square), greedy exactly; rejection sampling keeps the target distribution."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from steerspec.decoding import device_sampling as ds
from steerspec.decoding.sampling import _unlisted, draft_distribution, probs_from_logits
from steerspec.decoding.speculative import DraftBlock, greedy_verify, rejection_sample

N = 40_000


def _logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2.0


@pytest.mark.parametrize("params", [
    dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.0), dict(temperature=torch.tensor([0.0, 1.0, 0.5, 2.0]), top_k=torch.tensor([0, 3, 7, 0]),
                                top_p=torch.tensor([1.0, 0.9, 1.0, 0.5])),
])
def test_warp_and_draft_distribution_are_bit_for_bit(params):
    logits = _logits(4, 97)
    want = probs_from_logits(logits, **params)
    got = ds.warp_probs(logits, **params)
    assert torch.equal(got, want)
    for top_k, tail in ((8, True), (8, False), (0, True)):
        a, b = ds.draft_distribution_device(got, top_k, tail), draft_distribution(want, top_k, tail)
        assert torch.equal(a.ids, b.ids) and torch.equal(a.probs, b.probs)
        assert (a.floor is None and b.floor is None) or torch.equal(a.floor, b.floor)


def test_unlisted_token_matches_host():
    gen = torch.Generator().manual_seed(1)
    vocab = 50
    listed = torch.stack([torch.randperm(vocab, generator=gen)[:7] for _ in range(200)])
    u = torch.rand(200, generator=gen)
    got = ds.unlisted_token(listed, u, vocab)
    want = [_unlisted(row.tolist(), float(x), vocab - 7) for row, x in zip(listed, u)]
    assert got.tolist() == want
    assert not (got.unsqueeze(-1) == listed).any()


def _chi2_ok(samples: torch.Tensor, probs: torch.Tensor) -> None:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    keep = expected > 5
    assert counts[~keep].sum() <= max(30.0, 3 * expected[~keep].sum())
    obs, exp = counts[keep], expected[keep]
    if bool((~keep).any()) and float(expected[~keep].sum()) > 5:
        obs = torch.cat([obs, counts[~keep].sum().view(1)])
        exp = torch.cat([exp, expected[~keep].sum().view(1)])
    exp = exp * obs.sum() / exp.sum()
    assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-4
    tv = 0.5 * (counts / samples.numel() - probs.double()).abs().sum()
    assert tv < (int((probs > 0).sum()) / samples.numel()) ** 0.5  # noise alone gives ~0.4 of this


def test_sparse_sampling_has_the_draft_distribution():
    probs = ds.warp_probs(_logits(1, 60, seed=2), temperature=1.5)
    dist = draft_distribution(probs, 6, tail=True)
    dense = dist.to_dense(60)[0]
    rows = dist.map(lambda t: t.expand(N, *t.shape[1:]))
    u = torch.rand(N, 2, generator=torch.Generator().manual_seed(3))
    _chi2_ok(ds.sample_sparse_device(rows, u), dense)
    assert float(dense[dist.ids[0]].sum()) < 0.95  # the tail carries real mass in this test


def test_greedy_step_is_argmax():
    logits = _logits(5, 33)
    token, q = ds.draft_step(logits, True, 0.0, 0, 1.0, 64, True, None)
    assert q is None and torch.equal(token, logits.argmax(-1))
    target = _logits(5, 33, seed=4).view(5, 1, 33).expand(5, 4, 33).contiguous()
    block = DraftBlock(tokens=torch.randint(0, 33, (5, 3)), lengths=torch.tensor([3, 2, 0, 3, 1]))
    block.tokens[0] = target[0, 0].argmax()
    a, b = ds.greedy_verify_device(target, block.tokens, block.lengths), greedy_verify(target, block)
    assert torch.equal(a.accepted, b.accepted) and torch.equal(a.next_tokens, b.next_tokens)


@pytest.mark.parametrize("k", [1, 3])
def test_rejection_sampling_keeps_the_target_distribution(k):
    """First committed token of a block: d_1 if accepted else the recovered token; it must be ~ p_1,
    on the device path as on the host path, whatever q (top-K with tail) the drafter used."""
    vocab = 40
    p = ds.warp_probs(_logits(k + 1, vocab, seed=5), temperature=1.0)
    q_probs = ds.warp_probs(_logits(k, vocab, seed=6), temperature=1.2)
    q = ds.draft_distribution_device(q_probs, 5, tail=True)
    gen = torch.Generator().manual_seed(7)
    qs = q.map(lambda t: t.unsqueeze(0).expand(N, *t.shape))
    drafts = torch.stack([ds.sample_sparse_device(q.map(lambda t, i=i: t[i : i + 1].expand(N, *t.shape[1:])),
                                                  torch.rand(N, 2, generator=gen)) for i in range(k)], dim=1)
    block = DraftBlock(tokens=drafts, lengths=torch.full((N,), k), q=qs)
    target = p.unsqueeze(0).expand(N, k + 1, vocab)
    out = ds.rejection_sample_device(target, block, torch.rand(N, k + 1, generator=gen))
    first = torch.where(out.accepted > 0, drafts[:, 0], out.next_tokens)
    _chi2_ok(first, p[0])
    host = rejection_sample(target, block, torch.Generator().manual_seed(8))
    # same acceptance law: mean accepted counts agree (the host path is the reference)
    assert abs(out.accepted.double().mean() - host.accepted.double().mean()) < 0.05
    bonus = out.next_tokens[out.is_bonus]
    if k == 1 and bonus.numel() > 2000:
        _chi2_ok(bonus, p[1])

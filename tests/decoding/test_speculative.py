"""The rejection sampler: forced-argmax cases, edge cases, seeded determinism, and convergence to p."""

import pytest
import torch
from scipy.stats import chisquare

from steerspec.decoding.sampling import (SparseDist, draft_distribution, probs_from_logits, sample_sparse,
    truncate_top_k)
from steerspec.decoding.speculative import DraftBlock, greedy_verify, rejection_sample

V = 24
N = 50_000


def one_hot_logits(tokens: list[int], vocab: int = V) -> torch.Tensor:
    logits = torch.full((len(tokens), vocab), -5.0)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_forced_argmax_perfect_match_gets_bonus():
    target = one_hot_logits([3, 7, 1, 9]).unsqueeze(0)  # k = 3 drafts + bonus
    block = DraftBlock(tokens=torch.tensor([[3, 7, 1]]), lengths=torch.tensor([3]))
    out = greedy_verify(target, block)
    assert out.accepted.tolist() == [3] and out.next_tokens.tolist() == [9] and out.is_bonus.tolist() == [True]
    probs = probs_from_logits(target, 0.0)
    out2 = rejection_sample(probs, block, torch.Generator().manual_seed(0))
    assert out2.accepted.tolist() == [3] and out2.next_tokens.tolist() == [9]


def test_forced_argmax_early_mismatch_recovers_verifier_token():
    target = one_hot_logits([3, 7, 1, 9]).unsqueeze(0)
    block = DraftBlock(tokens=torch.tensor([[3, 8, 1]]), lengths=torch.tensor([3]))
    out = greedy_verify(target, block)
    assert out.accepted.tolist() == [1] and out.next_tokens.tolist() == [7] and out.is_bonus.tolist() == [False]
    out2 = rejection_sample(probs_from_logits(target, 0.0), block, torch.Generator().manual_seed(0))
    assert out2.accepted.tolist() == [1] and out2.next_tokens.tolist() == [7]


def test_ragged_batch_and_k_zero():
    target = torch.stack([one_hot_logits([3, 7, 1, 9]), one_hot_logits([2, 2, 2, 2]), one_hot_logits([5, 6, 4, 0])])
    block = DraftBlock(tokens=torch.tensor([[0, 0, 0], [2, 2, 0], [5, 6, 4]]), lengths=torch.tensor([0, 2, 3]))
    out = greedy_verify(target, block)
    assert out.accepted.tolist() == [0, 2, 3]
    assert out.next_tokens.tolist() == [3, 2, 0]
    assert out.is_bonus.tolist() == [True, True, True]
    out2 = rejection_sample(probs_from_logits(target, 0.0), block, torch.Generator().manual_seed(1))
    assert out2.accepted.tolist() == [0, 2, 3] and out2.next_tokens.tolist() == [3, 2, 0]


def test_seeded_determinism():
    torch.manual_seed(0)
    p = torch.randn(32, 5, V).softmax(-1)
    q = truncate_top_k(torch.randn(32, 4, V).softmax(-1), 8)
    tokens = sample_sparse(SparseDist(q.ids.view(-1, 8), q.probs.view(-1, 8)), torch.Generator().manual_seed(3)).view(32, 4)
    block = DraftBlock(tokens=tokens, lengths=torch.full((32,), 4), q=q)
    a = rejection_sample(p, block, torch.Generator().manual_seed(11))
    b = rejection_sample(p, block, torch.Generator().manual_seed(11))
    assert torch.equal(a.accepted, b.accepted) and torch.equal(a.next_tokens, b.next_tokens)
    gens = lambda: [torch.Generator().manual_seed(100 + i) for i in range(32)]  # noqa: E731
    c, d = rejection_sample(p, block, gens()), rejection_sample(p, block, gens())
    assert torch.equal(c.next_tokens, d.next_tokens)


def _run_blocks(p: torch.Tensor, q_full: torch.Tensor, k: int, draft_top_k: int, seed: int, tail: bool = False):
    """N independent blocks with position-independent p and q (the wire distribution the drafter
    proposes): returns (draft tokens [N, k], outcome)."""
    gen = torch.Generator().manual_seed(seed)
    q_rows = q_full.expand(N, k, V)
    q = draft_distribution(q_rows, draft_top_k, tail) if tail else truncate_top_k(q_rows, draft_top_k)
    tokens = sample_sparse(q.map(lambda t: t.reshape(N * k, -1)), gen).view(N, k)
    block = DraftBlock(tokens=tokens, lengths=torch.full((N,), k), q=q)
    return tokens, rejection_sample(p.expand(N, k + 1, V), block, gen)


def _emitted_tokens(p: torch.Tensor, q_full: torch.Tensor, k: int, draft_top_k: int, seed: int,
                    tail: bool = False) -> torch.Tensor:
    """Every committed token of `_run_blocks`."""
    tokens, out = _run_blocks(p, q_full, k, draft_top_k, seed, tail)
    pos = torch.arange(k)
    accepted_tokens = tokens[pos.unsqueeze(0) < out.accepted.unsqueeze(1)]
    return torch.cat([accepted_tokens, out.next_tokens])


def _chi_square_p(samples: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=V).double()
    keep = p > 0
    assert counts[~keep].sum() == 0, "sampled a token the verifier gives probability 0"
    expected = p.double()[keep] / p.double()[keep].sum() * counts.sum()
    return float(chisquare(counts[keep].numpy(), expected.numpy()).pvalue)


def _distributions(zeros: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    p = (torch.randn(V, generator=g) * 1.5).softmax(-1)
    q = (torch.randn(V, generator=g) * 1.5).softmax(-1)
    if zeros:
        p[:4] = 0.0  # drafter likes tokens the verifier never emits
        q[:4] *= 20
        q[10:14] = 0.0  # verifier tokens the drafter never drafts
        p, q = p / p.sum(), q / q.sum()
    return p, q


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("draft_top_k", [0, 6])
@pytest.mark.parametrize("zeros", [False, True])
def test_output_distribution_converges_to_verifier(k, draft_top_k, zeros):
    p, q = _distributions(zeros)
    emitted = _emitted_tokens(p, q, k, draft_top_k, seed=k * 10 + draft_top_k)
    assert emitted.numel() >= N
    assert _chi_square_p(emitted, p) > 0.001


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("zeros", [False, True])
def test_output_distribution_converges_to_verifier_with_spread_tail(k, zeros):
    p, q = _distributions(zeros)
    tokens, out = _run_blocks(p, q, k, 6, seed=k + 77, tail=True)
    top = set(q.topk(6).indices.tolist())
    assert any(int(t) not in top for t in tokens[:, 0]), "the tail proposes tokens outside the top K"
    emitted = _emitted_tokens(p, q, k, 6, seed=k + 77, tail=True)
    assert _chi_square_p(emitted, p) > 0.001


def test_spread_tail_accepts_more_than_renormalising():
    p, q = _distributions(zeros=False)
    _, renormalised = _run_blocks(p, q, 4, 6, seed=3, tail=False)
    _, spread = _run_blocks(p, q, 4, 6, seed=3, tail=True)
    # p and q share much mass outside q's top 6: spreading q's own tail there is accepted more often
    assert spread.accepted.float().mean() > renormalised.accepted.float().mean() + 0.05


def test_first_token_distribution_matches_p_under_sparse_q():
    p, q = _distributions(zeros=True)
    gen = torch.Generator().manual_seed(9)
    qd = truncate_top_k(q.expand(N, 1, V), 5)
    tokens = sample_sparse(SparseDist(qd.ids.view(N, 5), qd.probs.view(N, 5)), gen).view(N, 1)
    out = rejection_sample(p.expand(N, 2, V), DraftBlock(tokens, torch.ones(N, dtype=torch.long), qd), gen)
    first = torch.where(out.accepted > 0, tokens[:, 0], out.next_tokens)
    assert _chi_square_p(first, p) > 0.001


def test_empty_residual_falls_back_to_p():
    # q does not cover the draft token (q(d) = 0 -> reject) and equals p elsewhere: residual is all zero.
    p = torch.tensor([0.0, 0.5, 0.5, 0.0])
    q = SparseDist(ids=torch.tensor([[[1, 2]]]).expand(N, 1, 2), probs=torch.tensor([[[0.5, 0.5]]]).expand(N, 1, 2))
    block = DraftBlock(tokens=torch.full((N, 1), 3), lengths=torch.ones(N, dtype=torch.long), q=q)
    out = rejection_sample(p.expand(N, 2, 4), block, torch.Generator().manual_seed(0))
    assert out.accepted.sum() == 0
    counts = torch.bincount(out.next_tokens, minlength=4)
    assert counts[0] == 0 and counts[3] == 0 and abs(int(counts[1]) - N // 2) < 1000


def test_zero_p_draft_is_always_rejected():
    p = torch.tensor([0.0, 1.0, 0.0])
    q = SparseDist(ids=torch.tensor([[[0, 1]]]).expand(1000, 1, 2), probs=torch.tensor([[[0.9, 0.1]]]).expand(1000, 1, 2))
    block = DraftBlock(tokens=torch.zeros(1000, 1, dtype=torch.long), lengths=torch.ones(1000, dtype=torch.long), q=q)
    out = rejection_sample(p.expand(1000, 2, 3), block, torch.Generator().manual_seed(0))
    assert out.accepted.sum() == 0 and (out.next_tokens == 1).all()

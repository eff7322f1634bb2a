"""Block verification for a chain of drafts (Sun et al., "Block Verification Accelerates Speculative
Decoding", ICLR 2025): exact like token-wise speculative sampling, and never fewer accepted tokens in
expectation, since it judges the drafted prefixes as a whole (pure torch, batched, no I/O).

Per row with drafts x_1..x_k, the verifier's p_i and the drafter's q_i (i = 1..k + 1 for p):
- weights w_0 = 1, w_i = min(1, w_{i-1} · p_i(x_i) / q_i(x_i));
- residual after prefix i: r_i(x) = max(0, w_i · p_{i+1}(x) − q_{i+1}(x)), mass s_i;
- keep prefix i with probability h_i = s_i / (s_i + 1 − w_i) for i < k (0 when both vanish), h_k = w_k;
- the accepted length a is the longest prefix kept (one uniform per prefix, as token-wise draws one per
  draft), else 0; the next token is drawn from p_{k+1} when a = k (bonus), else from norm(r_a) (p_{a+1}
  when r_a has no mass, as `speculative.rejection_sample` does).
Token-wise acceptance stops at the first draft whose ratio fails; here a later ratio above 1 can make
up for an earlier one below 1. Greedy rows (one-hot p and q) accept exactly the leading matches.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from steerspec.decoding.sampling import Generators, sample
from steerspec.decoding.speculative import DraftBlock, VerifyOutcome, draft_uniforms


def _ratios(target_probs: Tensor, block: DraftBlock) -> Tuple[Tensor, Tensor]:
    """(p(x_i) / q(x_i) [B, K], 0 past a row's length or where q(x_i) = 0; dense q rows [B, K, V]) of a block
    (one-hot q for greedy drafts)."""
    width = block.tokens.shape[1]
    vocab = target_probs.shape[-1]
    tokens = block.tokens.clamp(0, vocab - 1)
    p_draft = target_probs[:, :width].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if block.q is None:
        q_dense = torch.zeros_like(target_probs[:, :width]).scatter_(-1, tokens.unsqueeze(-1), 1.0)
    else:
        q_dense = block.q.to_dense(vocab).to(target_probs.dtype)
    q_draft = q_dense.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    valid = torch.arange(width, device=target_probs.device).unsqueeze(0) < block.lengths.unsqueeze(1)
    ratio = torch.where(valid & (q_draft > 0), p_draft / q_draft.clamp(min=1e-30), torch.zeros_like(p_draft))
    return ratio, q_dense


def block_weights(target_probs: Tensor, block: DraftBlock) -> Tuple[Tensor, Tensor, Tensor]:
    """The rule's quantities for every prefix: (h [B, K]: the chance to keep prefix i = 1..K, zero past a
    row's length; w [B, K + 1]: the weights w_0..w_K; residuals [B, K, V]: r_0..r_{K-1}, unnormalised)."""
    return _weights(target_probs, block, *_ratios(target_probs, block))


def _weights(target_probs: Tensor, block: DraftBlock, ratio: Tensor,
             q_dense: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """`block_weights` from the block's ratios and dense q rows (`_ratios`)."""
    batch, width = block.tokens.shape
    valid = torch.arange(width, device=target_probs.device).unsqueeze(0) < block.lengths.unsqueeze(1)
    w = torch.ones(batch, width + 1, dtype=target_probs.dtype, device=target_probs.device)
    for i in range(width):
        w[:, i + 1] = (w[:, i] * ratio[:, i]).clamp(max=1.0)
    residual = (w[:, :width, None] * target_probs[:, :width] - q_dense).clamp(min=0.0)
    mass = residual.sum(-1)  # [B, K]: s_0..s_{K-1}
    s, wi = mass[:, 1:], w[:, 1:width]  # prefixes 1..K-1
    denom = s + 1.0 - wi
    h_mid = torch.where(denom > 0, s / denom.clamp(min=1e-30), torch.zeros_like(s))
    h = torch.cat([h_mid, torch.zeros(batch, 1, dtype=h_mid.dtype, device=h_mid.device)], dim=1)  # [B, K]
    full = block.lengths.clamp(min=1) - 1  # column of prefix k (the row's whole block)
    h.scatter_(1, full.view(-1, 1), w.gather(1, block.lengths.view(-1, 1)))
    h = torch.where(valid, h, torch.zeros_like(h))
    return h, w, residual


def block_verify(target_probs: Tensor, block: DraftBlock, generator: Generators = None) -> VerifyOutcome:
    """Block verification for a batch of ragged chains: `speculative.rejection_sample`'s arguments, uniforms
    (k per row, from the row's own generator when given one per row) and outcome."""
    batch, width = block.tokens.shape
    vocab = target_probs.shape[-1]
    device = target_probs.device
    u = draft_uniforms(block, generator, device)
    if width == 0:
        accepted = torch.zeros(batch, dtype=torch.long, device=device)
        return VerifyOutcome(accepted, sample(target_probs[:, 0], generator), torch.ones(batch, dtype=torch.bool))
    h, w, residual = block_weights(target_probs, block)
    kept = u.to(h.dtype) < h  # prefix i + 1 kept
    prefix = torch.arange(1, width + 1, device=device).unsqueeze(0)
    accepted = torch.where(kept, prefix, torch.zeros_like(prefix)).max(dim=1).values
    is_bonus = accepted == block.lengths
    p_next = target_probs.gather(1, accepted.view(batch, 1, 1).expand(batch, 1, vocab)).squeeze(1)
    at = accepted.clamp(max=width - 1).view(batch, 1, 1).expand(batch, 1, vocab)
    r = residual.gather(1, at).squeeze(1)
    empty = r.sum(-1, keepdim=True) <= 0
    dist = torch.where(is_bonus.unsqueeze(-1) | empty, p_next, r)
    return VerifyOutcome(accepted=accepted, next_tokens=sample(dist, generator), is_bonus=is_bonus)


def expected_accepted(target_probs: Tensor, block: DraftBlock) -> Tuple[Tensor, Tensor]:
    """E[accepted drafts] per row given its drafts, under token-wise acceptance (the sum over i of
    prod_{j <= i} min(1, p_j / q_j)) and under block verification (the sum over i of P(a >= i)): a paired,
    noise-free comparison of the two rules on the same blocks (scripts/bench_block_verify.py)."""
    width = block.tokens.shape[1]
    if width == 0:
        zero = torch.zeros(block.tokens.shape[0], dtype=target_probs.dtype, device=target_probs.device)
        return zero, zero.clone()
    ratio, q_dense = _ratios(target_probs, block)
    token_wise = ratio.clamp(max=1.0).cumprod(-1).sum(-1)
    h = _weights(target_probs, block, ratio, q_dense)[0]
    none_after = torch.flip(torch.cumprod(torch.flip(1 - h, [1]), 1), [1])  # P(no prefix >= i kept), i = 1..K
    return token_wise, (1 - none_after).sum(-1)

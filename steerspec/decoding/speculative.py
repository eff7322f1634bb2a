"""Exact speculative sampling over a batch of sessions (pure torch, no I/O).

Definitions, per session row with a block of k draft tokens d_1..d_k:
- accepted tokens: the longest prefix d_1..d_a whose tokens all pass the test u_i < p_i(d_i) / q_i(d_i),
  where p is the verifier's warped distribution and q the drafter's (its top K listed, the rest of its
  mass spread evenly: `sampling.draft_distribution`);
- recovered token: when a < k, the token that replaces the first rejected draft d_{a+1}, sampled
  from norm(max(0, p_{a+1} - q_{a+1})) (or p_{a+1} itself when that residual has no mass);
- bonus token: when a = k, one extra token sampled from p_{k+1}, the verifier's next position.
Each block therefore commits a + 1 tokens, and the committed text has exactly the verifier's
distribution whatever q is, as long as the verifier uses the same q the drafter sampled from.
Greedy blocks (temperature 0) compare argmaxes and carry no probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from steerspec.decoding.sampling import Generators, SparseDist, row_generators, sample, uniform


@dataclass
class DraftBlock:
    """A batch of proposals: tokens [B, K] (right-padded), lengths [B] (ragged k, 0 allowed).

    `q` is the drafter's sparse distribution per draft position, ids/probs [B, K, S];
    None means greedy drafts (token ids only, i.e. q is one-hot at each draft token).
    """

    tokens: Tensor
    lengths: Tensor
    q: Optional[SparseDist] = None


@dataclass
class VerifyOutcome:
    """Per row: accepted count a, the next token (recovered or bonus) and whether it is a bonus."""

    accepted: Tensor
    next_tokens: Tensor
    is_bonus: Tensor


def _leading_true(mask: Tensor) -> Tensor:
    """Count of leading True values per row of a [B, K] bool tensor."""
    return mask.long().cumprod(dim=-1).sum(dim=-1)


def greedy_verify(target_logits: Tensor, block: DraftBlock) -> VerifyOutcome:
    """Greedy verification: accept while the draft equals the verifier's argmax.

    target_logits [B, K+1, V]: position i scores draft i (i < K) and position K the bonus.
    """
    batch, width = block.tokens.shape
    argmax = target_logits.argmax(dim=-1)  # [B, K+1]
    pos = torch.arange(width, device=argmax.device)
    valid = pos.unsqueeze(0) < block.lengths.unsqueeze(1)
    accepted = _leading_true((argmax[:, :width] == block.tokens) & valid)
    next_tokens = argmax.gather(1, accepted.unsqueeze(1)).squeeze(1)
    return VerifyOutcome(accepted=accepted, next_tokens=next_tokens, is_bonus=accepted == block.lengths)


def draft_uniforms(block: DraftBlock, generator: Generators, device) -> Tensor:
    """One uniform per draft [B, K] (both acceptance rules test each draft or prefix against one): from one
    generator, or each row's k from its own generator, as it would draw them alone (1 past a row's k)."""
    batch, width = block.tokens.shape
    if generator is None or isinstance(generator, torch.Generator):
        return uniform((batch, width), generator, device=device)
    u = torch.ones(batch, width, device=device)
    for i, (g, k) in enumerate(zip(row_generators(generator, batch), block.lengths.tolist())):
        u[i, :k] = uniform((k,), g, device=device)
    return u


def rejection_sample(target_probs: Tensor, block: DraftBlock, generator: Generators = None) -> VerifyOutcome:
    """Speculative sampling (Leviathan et al.; Chen et al.) for a batch of ragged blocks.

    target_probs [B, K+1, V] are the verifier's warped probabilities (one-hot rows for greedy
    sessions); `generator` is one torch.Generator or one per row, for seeded determinism (one per
    row: each row draws its own k uniforms and one token, exactly as it would alone).
    """
    batch, width = block.tokens.shape
    vocab = target_probs.shape[-1]
    device = target_probs.device
    tokens = block.tokens.clamp(0, vocab - 1)
    pos = torch.arange(width, device=device)
    valid = pos.unsqueeze(0) < block.lengths.unsqueeze(1)

    p_draft = target_probs[:, :width].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B, K]
    if block.q is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = block.q.prob_of(tokens).to(p_draft.dtype)
    u = draft_uniforms(block, generator, device)
    # u * q < p  <=>  u < p / q; rejects when p = 0 and when q = 0 (a token the drafter could not draw).
    accept = (u * q_draft < p_draft) & (q_draft > 0) & valid
    accepted = _leading_true(accept)

    at = accepted.view(batch, 1, 1).expand(batch, 1, vocab)
    p_next = target_probs.gather(1, at).squeeze(1)  # [B, V]: p at the first rejected (or bonus) position
    is_bonus = accepted == block.lengths
    idx = accepted.clamp(max=max(width - 1, 0)).view(batch, 1)
    if width == 0:
        q_rows = torch.zeros_like(p_next)
    elif block.q is None:
        q_rows = torch.zeros_like(p_next).scatter_(-1, tokens.gather(1, idx), 1.0)
    else:
        at_idx = idx.view(batch, 1, 1)
        row_q = block.q.map(lambda t: t.gather(1, at_idx.expand(batch, 1, t.shape[-1])).squeeze(1))
        q_rows = row_q.to_dense(vocab).to(p_next.dtype)
    residual = (p_next - q_rows).clamp(min=0.0)
    empty = residual.sum(-1, keepdim=True) <= 0
    # Bonus rows sample p itself; recovered rows the residual, or p when the residual has no mass.
    dist = torch.where(is_bonus.unsqueeze(-1) | empty, p_next, residual)
    next_tokens = sample(dist, generator)
    return VerifyOutcome(accepted=accepted, next_tokens=next_tokens, is_bonus=is_bonus)

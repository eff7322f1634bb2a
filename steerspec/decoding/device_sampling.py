"""Draft sampling and rejection sampling that stay on the device (pure batched torch, no host sync).

The host path (`steerspec.decoding.sampling`, `steerspec.decoding.speculative`) branches on tensor values
(`bool(mask.any())`) and samples with `torch.multinomial`, each a stream sync on a GPU. Here
every branch depends only on Python-known parameters, and sampling is inverse-CDF from uniforms
drawn with (device-side) torch.Generators, so a whole block runs without waiting for the GPU.

Same math, same numbers: warping and the draft distribution are bit-for-bit those of the host
path (tests/decoding/test_device_sampling.py); the samples have the same distribution but consume the
generators differently, so a seed gives other (equally distributed) tokens than the host path.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from steerspec.decoding.sampling import Generators, SparseDist, fp16_down, row_generators, truncate_top_k
from steerspec.decoding.speculative import DraftBlock, VerifyOutcome, greedy_verify

Param = Union[float, int, Tensor]


def _rows(value: Param, like: Tensor, dtype: torch.dtype) -> Tensor:
    """A scalar or per-row [B] parameter as a [B, 1] column on like's device. A Python scalar
    becomes a fill kernel (no host→device copy, which would wait for the stream)."""
    if not isinstance(value, Tensor):
        return torch.full((like.shape[0], 1), value, dtype=dtype, device=like.device)
    t = value.to(device=like.device, dtype=dtype, non_blocking=True)
    return t.reshape(-1, 1).expand(like.shape[0], 1) if t.dim() else t.expand(like.shape[0], 1)


def warp_probs(logits: Tensor, temperature: Param = 1.0, top_k: Param = 0, top_p: Param = 1.0,
               filter_top_k: Optional[bool] = None, filter_top_p: Optional[bool] = None) -> Tensor:
    """`sampling.probs_from_logits` for logits [B, V] without host syncs (same float32 values).

    Whether the top-k / top-p filters run is decided from Python values: pass `filter_top_k` /
    `filter_top_p` when the parameters are tensors (None: derived from scalar parameters, and
    True for tensors). A filter that runs with k = 0 or p = 1 on a row leaves that row unchanged.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    temp = _rows(temperature, logits, torch.float32)
    greedy = temp <= 0
    out = logits / torch.where(greedy, torch.ones_like(temp), temp)
    if filter_top_k is None:
        filter_top_k = isinstance(top_k, Tensor) or int(top_k) > 0
    if filter_top_p is None:
        filter_top_p = isinstance(top_p, Tensor) or float(top_p) < 1.0
    if filter_top_k:
        k = _rows(top_k, logits, torch.long).clamp(min=0, max=vocab)
        kth = out.sort(dim=-1, descending=True).values.gather(-1, (k - 1).clamp(min=0))
        out = torch.where((k > 0) & (out < kth), float("-inf"), out)
    if filter_top_p:
        p = _rows(top_p, logits, torch.float32)
        sorted_logits, order = out.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        before = sorted_probs.cumsum(-1) - sorted_probs
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, (before >= p) & (p < 1.0))
        out = out.masked_fill(drop, float("-inf"))
    if isinstance(temperature, Tensor) or temperature <= 0:  # else no row is greedy (known on the host)
        onehot = torch.full_like(out, float("-inf")).scatter(-1, logits.argmax(-1, keepdim=True), 0.0)
        out = torch.where(greedy, onehot, out)
    return out.softmax(-1)


def wire_dist_device(ids: Tensor, weights: Tensor, vocab: int) -> SparseDist:
    """`sampling.wire_dist` without its host branch (dividing a row by exactly 1 changes no bit)."""
    weights = weights.float()
    total = weights.sum(-1, dtype=torch.float64)
    unlisted = vocab - ids.shape[-1]
    divisor = total.clamp(min=1.0) if unlisted > 0 else total
    probs = (weights.double() / divisor.unsqueeze(-1)).float()
    if unlisted > 0:
        floor = torch.sub(1.0, total).clamp_(min=0.0).div_(unlisted).float()
    else:
        floor = torch.zeros_like(total, dtype=torch.float32)
    return SparseDist(ids=ids, probs=probs, floor=floor, vocab=vocab)


def draft_distribution_device(probs: Tensor, draft_top_k: int, tail: bool = True) -> SparseDist:
    """`sampling.draft_distribution` (top K, fp16 wire rounding, even tail) without host syncs."""
    kept = truncate_top_k(probs, draft_top_k, renormalise_kept=not tail)
    return wire_dist_device(kept.ids, fp16_down(kept.probs).float(), probs.shape[-1])


def uniforms(rows: int, cols: int, generator: Generators, device: torch.device) -> Tensor:
    """U[0, 1) [rows, cols]; with one generator per row, row i draws from generator i (no sync)."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand((rows, cols), generator=generator, device=device)
    return torch.stack([torch.rand(cols, generator=g, device=device) for g in row_generators(generator, rows)])


def sample_inverse_cdf(weights: Tensor, u: Tensor) -> Tensor:
    """One index per row of weights [B, N] (non-negative, not necessarily normalised) for u [B]."""
    cdf = weights.float().cumsum(-1)
    x = (u * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_(max=weights.shape[-1] - 1)


def unlisted_token(listed: Tensor, u: Tensor, vocab: int) -> Tensor:
    """Per row, the unlisted id at uniform position u [B]: the r-th id absent from listed [B, S]
    (distinct ids), r = ⌊u·(vocab − S)⌋. Vectorised `sampling._unlisted`."""
    unlisted = vocab - listed.shape[-1]
    r = (u * unlisted).long().clamp_(min=0, max=max(unlisted - 1, 0))
    ranks = listed.sort(-1).values - torch.arange(listed.shape[-1], device=listed.device)
    return r + (ranks <= r.unsqueeze(-1)).sum(-1)


def sample_sparse_device(dist: SparseDist, u: Tensor) -> Tensor:
    """One token per row of dist (ids/probs [B, S], floor [B]) from uniforms u [B, 2], as
    `sampling.sample_sparse` draws: a listed id or the tail slot, then a uniform unlisted id."""
    if dist.floor is None:
        return dist.ids.gather(-1, sample_inverse_cdf(dist.probs, u[:, 0]).unsqueeze(-1)).squeeze(-1)
    support = dist.ids.shape[-1]
    unlisted = dist.vocab - support
    weights = torch.cat([dist.probs, dist.floor.mul(unlisted).unsqueeze(-1)], dim=-1)
    slot = sample_inverse_cdf(weights, u[:, 0])
    listed = dist.ids.gather(-1, slot.clamp(max=support - 1).unsqueeze(-1)).squeeze(-1)
    if unlisted <= 0:
        return listed
    return torch.where(slot == support, unlisted_token(dist.ids, u[:, 1], dist.vocab), listed)


def draft_step(logits: Tensor, greedy: bool, temperature: Param, top_k: Param, top_p: Param, draft_top_k: int,
               tail: bool, u: Optional[Tensor]) -> Tuple[Tensor, Optional[SparseDist]]:
    """One draft token per row of logits [B, V] and the q it was drawn from (None when greedy)."""
    if greedy:
        return logits.argmax(-1), None
    dist = draft_distribution_device(warp_probs(logits, temperature, top_k, top_p), draft_top_k, tail)
    return sample_sparse_device(dist, u), dist


def greedy_verify_device(target_logits: Tensor, tokens: Tensor, lengths: Tensor) -> VerifyOutcome:
    """`speculative.greedy_verify` (it has no host sync; re-exported for one device API)."""
    return greedy_verify(target_logits, DraftBlock(tokens=tokens, lengths=lengths))


def rejection_sample_device(target_probs: Tensor, block: DraftBlock, u: Tensor) -> VerifyOutcome:
    """`speculative.rejection_sample` with uniforms u [B, K + 1] given (column i < k_b tests draft
    i of row b, column k_b draws its recovered or bonus token by inverse CDF): no host sync."""
    batch, width = block.tokens.shape
    vocab = target_probs.shape[-1]
    tokens = block.tokens.clamp(0, vocab - 1)
    valid = torch.arange(width, device=tokens.device).unsqueeze(0) < block.lengths.unsqueeze(1)
    p_draft = target_probs[:, :width].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    q_draft = torch.ones_like(p_draft) if block.q is None else block.q.prob_of(tokens).to(p_draft.dtype)
    accept = (u[:, :width] * q_draft < p_draft) & (q_draft > 0) & valid
    accepted = accept.long().cumprod(-1).sum(-1)
    p_next = target_probs.gather(1, accepted.view(batch, 1, 1).expand(batch, 1, vocab)).squeeze(1)
    is_bonus = accepted == block.lengths
    u_next = u.gather(1, block.lengths.view(batch, 1).clamp(max=u.shape[1] - 1)).squeeze(1)
    if width == 0:
        return VerifyOutcome(accepted, sample_inverse_cdf(p_next, u_next), is_bonus)
    idx = accepted.clamp(max=width - 1).view(batch, 1)
    if block.q is None:
        q_rows = torch.zeros_like(p_next).scatter_(-1, tokens.gather(1, idx), 1.0)
    else:
        at = idx.view(batch, 1, 1)
        q_rows = block.q.map(lambda t: t.gather(1, at.expand(batch, 1, t.shape[-1])).squeeze(1))
        q_rows = q_rows.to_dense(vocab).to(p_next.dtype)
    residual = (p_next - q_rows).clamp(min=0.0)
    empty = residual.sum(-1, keepdim=True) <= 0
    dist = torch.where(is_bonus.unsqueeze(-1) | empty, p_next, residual)
    return VerifyOutcome(accepted, sample_inverse_cdf(dist, u_next), is_bonus)

"""Batch-invariant kernels: a row's result never depends on how many rows share its pass, nor on which.

A CPU GEMM reduces in an order fixed by its shape (a one-row product is a GEMV with another order
than a 5-row one), so the lean forward's invariant mode gives every kernel one shape:

- `bucket_linear`: rows padded to a bucket of R and computed R at a time (one weight layout for all).
- `block_attention`: each query's visible keys, laid out as one-token decoding sees them (the cached
  prefix, then the query's own ancestors in order), cut at fixed multiples of B; scores and P@V come
  from [R, hd] x [hd, B] and [R, B] x [B, hd] products whatever the cache length or query count, the
  softmax max is exact, and blocks are summed in order (`torch.cumsum`, sequential), so a block a query
  cannot see adds an exact zero.

Element-wise work (norms, rotary, SiLU) is per row already. Measured and tested in
tests/models/test_invariant.py ("Defeating Nondeterminism in LLM Inference", 2025; vLLM's batch-invariant mode).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from steerspec.models.layouts import linear as kernel_linear

DEFAULT_ROWS = 8  # the row bucket: every linear product has this many rows (a 5-6 row verify pass: one product)
KEY_BLOCK = 32  # keys per attention block
QUERY_ROWS = 16  # query rows per attention product


def pad_rows(x: Tensor, rows: int) -> Tensor:
    """`x` [N, ...] with zero rows appended up to a multiple of `rows` (itself when already so)."""
    extra = (-x.shape[0]) % rows
    if not extra:
        return x
    return torch.cat([x, x.new_zeros((extra,) + tuple(x.shape[1:]))])


def bucket_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], rows: int) -> Tensor:
    """x [N, in] @ weight.T (+ bias) as products of exactly `rows` rows each; [N, out]."""
    n = x.shape[0]
    padded = pad_rows(x, rows).contiguous()
    if padded.shape[0] == rows:
        out = kernel_linear(padded, weight, bias)
    else:
        out = torch.cat([kernel_linear(padded[i:i + rows], weight, bias) for i in range(0, padded.shape[0], rows)])
    return out if out.shape[0] == n else out[:n]


class KeyLayout(NamedTuple):
    """Where each of a pass's n queries finds its visible keys, laid out in blocks (layer-independent: made once
    per pass by `key_layout`). A chain's queries read the cache's blocks 0..nb-1 in place (their visible keys
    are slots 0..start+i already); a tree's read the full blocks below S0 in place and gather the rest."""

    start: int
    n: int
    block: int
    shared_blocks: int  # blocks read in place by every query
    shared_mask: Tensor  # [C, shared_blocks, R, B] bool: visible, per query row (C * R rows: n * G padded)
    tail_slots: Optional[Tensor]  # [n * T] long: per query, the slots of its gathered keys (None: a chain)
    tail_mask: Optional[Tensor]  # [n, 1, T // B, 1, B] bool


def key_layout(start: int, visible_new: Optional[Tensor], n: int, group: int, rows: int, block: int,
               device: torch.device) -> KeyLayout:
    """The KeyLayout of n new queries after `start` cached slots: a chain (`visible_new` None: query i sees
    slots 0..start+i) or a tree (query i sees every cached slot and the new slots where visible_new[i])."""
    chunks = -(-(n * group) // rows)
    query = torch.arange(chunks * rows, device=device) // group  # each padded row's query (past n: padding)
    if visible_new is None:
        blocks = -(-(start + n) // block)
        key = torch.arange(blocks * block, device=device).view(blocks, block)
        limit = (start + query).clamp(max=start + n - 1).view(chunks, 1, rows, 1)
        return KeyLayout(start, n, block, blocks, key.view(1, blocks, 1, block) <= limit, None, None)
    s0 = (start // block) * block
    shared = s0 // block
    mask = torch.ones(chunks, shared, rows, block, dtype=torch.bool, device=device)
    visible_new = visible_new.to(device, torch.bool)
    most = int(visible_new.sum(-1).max())
    width = max(block, -(-((start - s0) + most) // block) * block)
    slots = torch.zeros(n, width, dtype=torch.long, device=device)
    valid = torch.zeros(n, width, dtype=torch.bool, device=device)
    if start > s0:
        slots[:, : start - s0] = torch.arange(s0, start, device=device)
        valid[:, : start - s0] = True
    # the new slots each query sees, packed left in slot order (a stable sort puts the visible ones first)
    order = torch.argsort((~visible_new).to(torch.int8), dim=-1, stable=True)
    seen = torch.gather(visible_new, 1, order)
    packed_slots = torch.where(seen, order + start, torch.zeros_like(order))
    slots[:, start - s0: start - s0 + most] = packed_slots[:, :most]
    valid[:, start - s0: start - s0 + most] = seen[:, :most]
    return KeyLayout(start, n, block, shared, mask, slots.view(-1), valid.view(n, 1, width // block, 1, block))


def _padded_rows(x: Tensor, total: int, dim: int) -> Tensor:
    """`x` zero-padded along `dim` to `total`."""
    extra = total - x.shape[dim]
    if not extra:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def block_attention(q: Tensor, keys: Tensor, values: Tensor, layout: KeyLayout, scaling: float,
                    rows: int = QUERY_ROWS) -> Tensor:
    """Attention of n new queries q [n, H, hd] over a cache keys/values [Hkv, capacity, hd] (capacity at least
    the layout's blocks; slots start.. hold the new tokens) as `layout` says. Returns [n, H, hd] in q's dtype,
    computed in float32 from fixed-shape products (module docstring), so each query's result equals its own
    one-token pass over a compacted cache."""
    n, heads, hd = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    if group > rows:
        raise ValueError(f"{group} query heads per key head exceed the attention row bucket {rows}")
    block, shared = layout.block, layout.shared_blocks
    qf = q.float().view(n, kv_heads, group, hd)
    chunks = layout.shared_mask.shape[0]
    scores, probs_v = [], []
    if shared:
        k_in = keys[:, : shared * block].float().view(kv_heads, shared, block, hd)
        v_in = values[:, : shared * block].float().view(kv_heads, shared, block, hd)
        q_rows = _padded_rows(qf.permute(1, 0, 2, 3).reshape(kv_heads, n * group, hd), chunks * rows, 1)
        s = torch.matmul(q_rows.view(kv_heads, chunks, 1, rows, hd), k_in.transpose(-1, -2).unsqueeze(1))
        scores.append(s.masked_fill(~layout.shared_mask, float("-inf")))  # [Hkv, C, nbs, R, B]
    if layout.tail_slots is not None:
        tail = layout.tail_mask.shape[2]
        k_t = keys.index_select(1, layout.tail_slots).float().view(kv_heads, n, tail, block, hd)
        v_t = values.index_select(1, layout.tail_slots).float().view(kv_heads, n, tail, block, hd)
        q_t = _padded_rows(qf, rows, 2).unsqueeze(2)  # [n, Hkv, 1, R, hd]
        s = torch.matmul(q_t, k_t.permute(1, 0, 2, 4, 3))  # [n, Hkv, nbt, R, B]
        scores.append(s.masked_fill(~layout.tail_mask, float("-inf")))
    # the max over all of a row's visible keys (exact), then per block exp, sums and P @ V
    if shared:
        top_shared = scores[0].amax(dim=(2, 4))  # [Hkv, C, R]
        top_rows = top_shared.reshape(kv_heads, chunks * rows)[:, : n * group].view(kv_heads, n, group)
        top_rows = top_rows.permute(1, 0, 2)  # [n, Hkv, G]
    if layout.tail_slots is not None:
        top_tail = scores[-1][..., :group, :].amax(dim=(2, 4))  # [n, Hkv, G]
        top_rows = top_tail if not shared else torch.maximum(top_rows, top_tail)
    sums, outs = [], []
    if shared:
        top = _padded_rows(top_rows.permute(1, 0, 2).reshape(kv_heads, n * group), chunks * rows, 1)
        p = torch.exp(scores[0] * scaling - top.view(kv_heads, chunks, 1, rows, 1) * scaling)
        sums.append(p.sum(-1))  # [Hkv, C, nbs, R]
        outs.append(torch.matmul(p, v_in.unsqueeze(1)))  # [Hkv, C, nbs, R, hd]
    if layout.tail_slots is not None:
        top = _padded_rows(top_rows, rows, 2).view(n, kv_heads, 1, rows, 1)
        p = torch.exp(scores[-1] * scaling - top * scaling)  # [n, Hkv, nbt, R, B]
        sums.append(p.sum(-1))  # [n, Hkv, nbt, R]
        outs.append(torch.matmul(p, v_t.permute(1, 0, 2, 3, 4)))  # [n, Hkv, nbt, R, hd]
    # blocks in order, summed sequentially: shared ones (per padded row) then the tail's (per query)
    if shared:
        sums[0] = sums[0].permute(0, 1, 3, 2).reshape(kv_heads, chunks * rows, shared)[:, : n * group]
        sums[0] = sums[0].view(kv_heads, n, group, shared).permute(1, 0, 2, 3)  # [n, Hkv, G, nbs]
        outs[0] = outs[0].permute(0, 1, 3, 2, 4).reshape(kv_heads, chunks * rows, shared, hd)[:, : n * group]
        outs[0] = outs[0].view(kv_heads, n, group, shared, hd).permute(1, 0, 2, 3, 4)  # [n, Hkv, G, nbs, hd]
    if layout.tail_slots is not None:
        sums[-1] = sums[-1][..., :group].transpose(2, 3)  # [n, Hkv, G, nbt]
        outs[-1] = outs[-1][..., :group, :].transpose(2, 3)  # [n, Hkv, G, nbt, hd]
    total = torch.cumsum(torch.cat(sums, dim=3) if len(sums) > 1 else sums[0], dim=3)[..., -1]
    o = torch.cumsum(torch.cat(outs, dim=3) if len(outs) > 1 else outs[0], dim=3)[:, :, :, -1]
    return (o / total.unsqueeze(-1)).reshape(n, heads, hd).to(q.dtype)


def rms_norm_rows(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' RMSNorm, per row (float32 statistics, weight applied in the input dtype)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)

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

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from steerspec.models.layouts import linear as kernel_linear

DEFAULT_ROWS = 16  # the row bucket: every linear product has this many rows
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


def compact_slots(start: int, visible_new: Tensor, block: int) -> "tuple[int, Tensor, Tensor]":
    """(S0, tail slots [n, T], tail validity [n, T]) of each query's visible keys from S0 = start rounded
    down to `block` on: cached slots S0..start-1, then the new slots it sees (`visible_new` [n, n]), in
    order, padded to T (a multiple of `block`) with slot 0, invalid."""
    s0 = (start // block) * block
    n = visible_new.shape[0]
    device = visible_new.device
    new_slots = torch.arange(start, start + n, device=device)
    most = int(visible_new.sum(-1).max())
    width = (start - s0) + most
    width = max(block, -(-width // block) * block)
    slots = torch.zeros(n, width, dtype=torch.long, device=device)
    valid = torch.zeros(n, width, dtype=torch.bool, device=device)
    if start > s0:
        slots[:, : start - s0] = torch.arange(s0, start, device=device)
        valid[:, : start - s0] = True
    # new slots each query sees, packed left in slot order: a stable sort of not-visible first-false
    order = torch.argsort((~visible_new).to(torch.int8), dim=-1, stable=True)
    seen = torch.gather(visible_new, 1, order)
    packed = torch.where(seen, new_slots[order], torch.zeros_like(order))
    slots[:, start - s0: start - s0 + most] = packed[:, :most]
    valid[:, start - s0: start - s0 + most] = seen[:, :most]
    return s0, slots, valid


def _rows_first(q: Tensor, rows: int) -> "tuple[Tensor, int]":
    """q [Hkv, M, hd] -> [Hkv, C, rows, hd] (M padded to C * rows) and M."""
    hkv, m, hd = q.shape
    extra = (-m) % rows
    if extra:
        q = torch.cat([q, q.new_zeros(hkv, extra, hd)], dim=1)
    return q.view(hkv, -1, rows, hd), m


def block_attention(q: Tensor, keys: Tensor, values: Tensor, start: int, visible_new: Tensor, scaling: float,
                    block: int = KEY_BLOCK, rows: int = QUERY_ROWS) -> Tensor:
    """Attention of n new queries q [n, H, hd] over a cache keys/values [Hkv, >= start + n, hd] whose slots
    start.. hold the n new tokens; query i sees every cached slot < start and the new slots where
    visible_new[i] ([n, n] bool). Returns [n, H, hd] in q's dtype, computed in float32 with fixed
    shapes (module docstring), so each query's result equals its own pass over a compacted cache."""
    n, heads, hd = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    out_dtype = q.dtype
    qf = q.float().view(n, kv_heads, group, hd)
    s0, slots, valid = compact_slots(start, visible_new.to(torch.bool), block)
    shared_blocks = s0 // block
    tail_blocks = slots.shape[1] // block

    # tail: per query, its G head rows padded to `rows`, against its own gathered keys
    tail_k = keys.index_select(1, slots.reshape(-1)).float().view(kv_heads, n, tail_blocks, block, hd)
    tail_v = values.index_select(1, slots.reshape(-1)).float().view(kv_heads, n, tail_blocks, block, hd)
    tail_k = tail_k.permute(1, 0, 2, 4, 3)  # [n, Hkv, nbt, hd, B]
    tail_v = tail_v.permute(1, 0, 2, 3, 4)  # [n, Hkv, nbt, B, hd]
    q_tail = qf
    if group < rows:
        q_tail = torch.cat([qf, qf.new_zeros(n, kv_heads, rows - group, hd)], dim=2)
    elif group > rows:
        raise ValueError(f"{group} query heads per key head exceed the attention row bucket {rows}")
    s_tail = torch.matmul(q_tail.unsqueeze(2).contiguous(), tail_k.contiguous())[:, :, :, :group]  # [n,Hkv,nbt,G,B]
    s_tail = s_tail.permute(0, 1, 3, 2, 4)  # [n, Hkv, G, nbt, B]

    parts = [s_tail]
    if shared_blocks:
        shared_k = keys[:, :s0].float().view(kv_heads, shared_blocks, block, hd)
        shared_v = values[:, :s0].float().view(kv_heads, shared_blocks, block, hd)
        q_rows, m = _rows_first(qf.permute(1, 0, 2, 3).reshape(kv_heads, n * group, hd), rows)  # [Hkv, C, R, hd]
        s_shared = torch.matmul(q_rows.unsqueeze(2), shared_k.transpose(-1, -2).unsqueeze(1))  # [Hkv, C, nbs, R, B]
        chunks = s_shared.shape[1]
        s_shared = s_shared.permute(0, 1, 3, 2, 4).reshape(kv_heads, chunks * rows, shared_blocks, block)[:, :m]
        s_shared = s_shared.view(kv_heads, n, group, shared_blocks, block).permute(1, 0, 2, 3, 4)
        parts.insert(0, s_shared)
    scores = torch.cat(parts, dim=3) if len(parts) > 1 else parts[0]  # [n, Hkv, G, nb, B]
    scores = scores * scaling
    mask = torch.ones(n, shared_blocks * block, dtype=torch.bool, device=q.device)
    mask = torch.cat([mask, valid], dim=1).view(n, 1, 1, shared_blocks + tail_blocks, block)
    scores = scores.masked_fill(~mask, float("-inf"))
    top = scores.amax(dim=(3, 4), keepdim=True)
    p = torch.exp(scores - top)  # masked: exactly 0
    total = torch.cumsum(p.sum(-1), dim=-1)[..., -1]  # [n, Hkv, G], blocks in order

    p_tail = p[:, :, :, shared_blocks:].permute(0, 1, 3, 2, 4)  # [n, Hkv, nbt, G, B]
    if group < rows:
        p_tail = torch.cat([p_tail, p_tail.new_zeros(n, kv_heads, tail_blocks, rows - group, block)], dim=3)
    o_tail = torch.matmul(p_tail.contiguous(), tail_v.contiguous())[:, :, :, :group]  # [n, Hkv, nbt, G, hd]
    o_blocks = [o_tail.permute(0, 1, 3, 2, 4)]  # [n, Hkv, G, nbt, hd]
    if shared_blocks:
        p_shared = p[:, :, :, :shared_blocks].permute(1, 0, 2, 3, 4).reshape(kv_heads, n * group, shared_blocks, block)
        p_shared = p_shared.permute(0, 2, 1, 3)  # [Hkv, nbs, M, B]
        extra = (-(n * group)) % rows
        if extra:
            p_shared = torch.cat([p_shared, p_shared.new_zeros(kv_heads, shared_blocks, extra, block)], dim=2)
        chunks = p_shared.shape[2] // rows
        p_shared = p_shared.reshape(kv_heads, shared_blocks, chunks, rows, block).permute(0, 2, 1, 3, 4)
        o_shared = torch.matmul(p_shared.contiguous(), shared_v.unsqueeze(1))  # [Hkv, C, nbs, R, hd]
        o_shared = o_shared.permute(0, 2, 1, 3, 4).reshape(kv_heads, shared_blocks, chunks * rows, hd)[:, :, : n * group]
        o_shared = o_shared.view(kv_heads, shared_blocks, n, group, hd).permute(2, 0, 3, 1, 4)  # [n, Hkv, G, nbs, hd]
        o_blocks.insert(0, o_shared)
    o = torch.cat(o_blocks, dim=3) if len(o_blocks) > 1 else o_blocks[0]
    o = torch.cumsum(o, dim=3)[:, :, :, -1]  # [n, Hkv, G, hd]
    o = o / total.unsqueeze(-1)
    return o.reshape(n, heads, hd).to(out_dtype)


def causal_visible(n: int, device: torch.device) -> Tensor:
    """[n, n] bool: new token i sees new tokens 0..i (a chain)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril_()


def rms_norm_rows(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' RMSNorm, per row (float32 statistics, weight applied in the input dtype)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)

"""The batch-invariant lean forward: one pass over several sequences' new tokens, each row's logits bit-identical
to what one-token decoding gives for it (steerspec/models/invariant_ops.py says how).

`invariant_extend(lms, feeds, trees, hidden_layers, logits_to_keep)` serves `FastCachedLM.extend`/`extend_tree`
(one sequence) and `batched.packed_extend` (a verifier's sessions packed into one pass) when the model's
`InvariantPlan` is set (`set_invariant`, from `load_model(..., invariant=...)`). The rows of all sequences are
packed for the projections and the MLP (`bucket_linear`: R rows per product), attention runs per sequence
(`block_attention`). The lms are FastCachedLMs over one model (duck-typed: this module sits below kv.py).
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from steerspec.models.invariant_ops import (
    DEFAULT_ROWS,
    KEY_BLOCK,
    QUERY_ROWS,
    block_attention,
    bucket_linear,
    key_layout,
    pad_rows,
    rms_norm_rows,
)

PLAN_ATTR = "_steerspec_invariant"  # on the model: its InvariantPlan (absent: invariance off)
ROTARY_ATTR = "_steerspec_rotary_chunks"  # on the model: chunk index -> (cos, sin) [ROTARY_CHUNK, hd]
ROTARY_CHUNK = 1024  # rotary rows are computed this many positions at a time, always the same shape


class InvariantPlan(NamedTuple):
    """How a model's invariant passes compute: the row bucket, the key block, and which weights the linears read."""

    rows: int = DEFAULT_ROWS
    block: int = KEY_BLOCK
    layout: str = "packed"  # "packed" (oneDNN copies where packable) or "own" (the model's weights)


def set_invariant(model, plan: Optional[InvariantPlan]) -> None:
    """Turn `model`'s invariant passes on with `plan`, or off (None); FastCachedLMs made later follow it."""
    if plan is None:
        model.__dict__.pop(PLAN_ATTR, None)
    else:
        if plan.rows < 1 or plan.block < 1 or plan.layout not in ("packed", "own"):
            raise ValueError(f"bad invariant plan {plan}")
        model.__dict__[PLAN_ATTR] = plan


def invariant_plan(model) -> Optional[InvariantPlan]:
    """The model's InvariantPlan, or None when its passes are not invariant."""
    return model.__dict__.get(PLAN_ATTR)


def rotary_rows(model, rotary, positions: Tensor, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """(cos, sin) [n, hd] at `positions`, read from tables computed ROTARY_CHUNK positions at a time and kept on the
    model, so a position's values never depend on how large a cache grew."""
    chunks: Dict[int, Tuple[Tensor, Tensor]] = model.__dict__.setdefault(ROTARY_ATTR, {})
    top = int(positions.max()) // ROTARY_CHUNK if positions.numel() else 0
    device = positions.device
    for c in range(top + 1):
        hit = chunks.get(c)
        if hit is None or hit[0].dtype != dtype or hit[0].device != device:
            span = torch.arange(c * ROTARY_CHUNK, (c + 1) * ROTARY_CHUNK, device=device).unsqueeze(0)
            with torch.inference_mode():
                cos, sin = rotary(torch.zeros(1, dtype=dtype, device=device), span)
            chunks[c] = (cos[0], sin[0])
    cos = torch.cat([chunks[c][0] for c in range(top + 1)])
    sin = torch.cat([chunks[c][1] for c in range(top + 1)])
    return cos.index_select(0, positions), sin.index_select(0, positions)


def rotate_half(x: Tensor) -> Tensor:
    """The rotary embedding's half rotation (last dim)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.inference_mode()
def invariant_extend(lms: Sequence, feeds: Sequence[Tensor], trees: Sequence[Optional[Tuple[Tensor, Tensor]]],
                     hidden_layers: Optional[Sequence[int]] = None,
                     logits_to_keep: int = 0) -> List[Tuple[Tensor, Optional[Tensor]]]:
    """Feed feeds[i] (LongTensor [n_i] ids) after lms[i]'s cached prefix, or with trees[i] = (positions, visible)
    as a tree; per sequence (logits [n_i or logits_to_keep, V], hidden [L, n_i, D] or None)."""
    first = lms[0]
    plan: InvariantPlan = invariant_plan(first.model)
    rows, block = plan.rows, plan.block
    device = first.device
    counts = [int(f.numel()) for f in feeds]
    starts = [lm.length for lm in lms]
    hd, heads, kv_heads = first.head_dim, first.num_heads, first.num_kv_heads
    group = heads // kv_heads
    key_layouts, positions = [], []
    for lm, start, n, tree in zip(lms, starts, counts, trees):
        lm._grow(-(-(start + n) // block) * block)  # whole key blocks: attention reads them in place
        if tree is None:
            positions.append(torch.arange(start, start + n, device=device))
            key_layouts.append(key_layout(start, None, n, group, QUERY_ROWS, block, device))
        else:
            pos, visible = tree[0].to(device, torch.long), tree[1].to(device, torch.bool)
            if visible.shape != (n, start + n):
                raise ValueError(f"a tree of {n} tokens after {start} cached needs a mask of {(n, start + n)}, "
                                 f"got {tuple(visible.shape)}")
            if start and not bool(visible[:, :start].all()):
                raise ValueError("an invariant tree pass needs every cached slot visible to every tree token")
            positions.append(pos)
            if is_chain(start, pos, visible):  # a path: the chain's layout reads its keys in place (no gather)
                key_layouts.append(key_layout(start, None, n, group, QUERY_ROWS, block, device))
                continue
            key_layouts.append(key_layout(start, visible[:, start:], n, group, QUERY_ROWS, block, device))
    total = sum(counts)
    cos, sin = rotary_rows(first.model, first.decoder.rotary_emb, torch.cat(positions), first.dtype)
    cos, sin = cos.view(total, 1, hd), sin.view(total, 1, hd)
    layers = list(hidden_layers or ())
    for index in layers:
        if not 0 <= index <= first.num_layers:
            raise ValueError(f"layer {index} out of range (model has {first.num_layers} layers)")
    biases = row_biases(lms, counts)
    x = F.embedding(torch.cat([f.to(device) for f in feeds]), first._embed)  # [N, D]
    plans, head = first.plans_for(rows)
    captured = {}
    spans, offset = [], 0
    for n in counts:
        spans.append((offset, offset + n))
        offset += n
    for index, layer_plan in enumerate(plans):
        if index in layers:
            captured[index] = x
        h = pad_rows(rms_norm_rows(x, *layer_plan.input_norm), rows)  # padded once for q, k and v
        q = bucket_linear(h, *layer_plan.q, rows)[:total].view(total, heads, hd)
        k = bucket_linear(h, *layer_plan.k, rows)[:total].view(total, kv_heads, hd)
        v = bucket_linear(h, *layer_plan.v, rows)[:total].view(total, kv_heads, hd)
        if layer_plan.q_norm is not None:
            q, k = rms_norm_rows(q, *layer_plan.q_norm), rms_norm_rows(k, *layer_plan.k_norm)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        outs = []
        for lm, start, (lo, hi), layout in zip(lms, starts, spans, key_layouts):
            keys, values = lm._keys[index][0], lm._values[index][0]  # [Hkv, capacity, hd]
            keys[:, start:start + hi - lo] = k[lo:hi].transpose(0, 1)
            values[:, start:start + hi - lo] = v[lo:hi].transpose(0, 1)
            o = block_attention(q[lo:hi], keys, values, layout, first.scaling, QUERY_ROWS)
            outs.append(o.reshape(hi - lo, heads * hd))
        x = x + bucket_linear(torch.cat(outs) if len(outs) > 1 else outs[0], *layer_plan.o, rows)
        h = pad_rows(rms_norm_rows(x, *layer_plan.post_attention_norm), rows)
        up = bucket_linear(h, *layer_plan.up, rows)[:total]
        if biases is not None and biases[index] is not None:
            up = up + biases[index]
        gate = bucket_linear(h, *layer_plan.gate, rows)[:total]
        x = x + bucket_linear(F.silu(gate) * up, *layer_plan.down, rows)
    for lm, start, n in zip(lms, starts, counts):  # only now: a failed pass leaves every cache as it was
        lm.length = start + n
    normed = rms_norm_rows(x, *first._final_norm)
    if first.num_layers in layers:
        captured[first.num_layers] = normed
    hidden = torch.stack([captured[i] for i in layers]) if layers else None
    if logits_to_keep:
        keep = torch.cat([torch.arange(max(lo, hi - logits_to_keep), hi, device=device) for lo, hi in spans])
        logits = _head(first, normed.index_select(0, keep), head, rows)
        kept, out_spans = 0, []
        for lo, hi in spans:
            width = hi - max(lo, hi - logits_to_keep)
            out_spans.append((kept, kept + width))
            kept += width
    else:
        logits = _head(first, normed, head, rows)
        out_spans = spans
    results = []
    for lm, (lo, hi), (a, b) in zip(lms, spans, out_spans):
        if lm.keep_last_hidden:
            lm.last_hidden = normed[hi - 1]
        results.append((logits[a:b], None if hidden is None else hidden[:, lo:hi]))
    return results


def is_chain(start: int, positions: Tensor, visible: Tensor) -> bool:
    """Whether a tree of n tokens after `start` cached ones is a path in slot order (each token at the next position,
    seeing exactly the tokens before it): then the chain's layout computes the same keys in the same blocks."""
    n = positions.numel()
    causal = torch.ones(n, n, dtype=torch.bool, device=visible.device).tril_()
    return bool(torch.equal(positions, torch.arange(start, start + n, device=positions.device))
                and torch.equal(visible[:, start:], causal))


def _head(lm, normed: Tensor, head, rows: int) -> Tensor:
    """Final-normed rows -> full-vocabulary logits, R rows per product (a reduced head scatters after)."""
    logits = bucket_linear(normed, *head, rows)
    return logits if lm._head_module is None else lm._head_module.scatter(logits)


def row_biases(lms: Sequence, counts: Sequence[int]) -> Optional[List[Optional[Tensor]]]:
    """Per layer, each token's SD² up-projection bias [N, F] (each lm's repeated over its `counts` rows; zeros for
    unbiased rows), or None: the packed passes' biases, invariant or not."""
    if all(lm.up_bias is None for lm in lms):
        return None
    stacked: List[Optional[Tensor]] = []
    for layer in range(lms[0].num_layers):
        own = [None if lm.up_bias is None else lm.up_bias[layer] for lm in lms]
        ref = next((b for b in own if b is not None), None)
        if ref is None:
            stacked.append(None)
            continue
        rows = [(torch.zeros_like(ref) if b is None else b.to(ref.device)).expand(n, -1) for b, n in zip(own, counts)]
        stacked.append(torch.cat(rows))
    return stacked

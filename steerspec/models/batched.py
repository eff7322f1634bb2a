"""One decode step for several sequences at once, each in its own FastCachedLM K/V buffers.

`batched_extend(lms, tokens)` feeds tokens[i] to lms[i] at that sequence's own position and
returns logits [B, V]. Embedding, norms, projections, rotary and MLP run once for the batch;
attention runs per row over that row's own cache, so ragged lengths need no padding or copies.
Row i adds its own SD² up-projection bias (`FastCachedLM.set_up_bias`), or none.

Logits equal per-row `lm.extend([t])` to ~1e-6, not bit for bit: a B-row GEMM sums in another
order than a one-row GEMV. A batch of one is `lm.extend` itself. When the fast path cannot run
(`can_batch` is False) each row runs its own `extend`. Its pass is `packed_extend` with one token
per row.

`packed_extend(lms, feeds)` is the same with several tokens per row (a verifier scoring each
session's [pending, d_1..d_k]): the rows' tokens are packed into one sequence for the
projections and the MLP, attention runs per row with its own causal mask. No padding.

This module reads FastCachedLM's internals (same package): plans, buffers, rotary tables.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from steerspec.models.graphed import can_graph, graphed_step
from steerspec.models.invariant_pass import invariant_extend, row_biases
from steerspec.models.kv import (
    CachedLM,
    FastCachedLM,
    StepOutput,
    has_global_hooks,
    hook_state,
    rms_normalize,
    rotate_half,
)
from steerspec.models.layouts import linear as kernel_linear


def can_batch(lms: Sequence[CachedLM]) -> bool:
    """True when every row is a FastCachedLM over one model and no hook needs the module path.

    Inactive SD² steering hooks are fine (rows carry their biases in `up_bias`); active ones,
    or any other hook, are not: the batched pass would skip them.
    """
    if not lms or not all(isinstance(lm, FastCachedLM) for lm in lms):
        return False
    model = lms[0].model
    if any(lm.model is not model for lm in lms) or has_global_hooks():
        return False
    for plan in lms[0].layer_plans:
        hooked, steering = hook_state(plan.modules)
        if hooked or (steering is not None and steering.active):
            return False
    return True


@torch.inference_mode()
def batched_extend(lms: Sequence[CachedLM], tokens: Tensor) -> Tensor:
    """Feed tokens[i] ([B] ids) after lms[i]'s cached prefix, all in one pass; return logits [B, V]."""
    tokens = tokens.view(-1)
    if tokens.numel() != len(lms):
        raise ValueError(f"need one token per sequence: {len(lms)} sequences, {tokens.numel()} tokens")
    if len(lms) > 1 and can_graph(lms, 1) and not any(lm.keep_last_hidden for lm in lms):  # a shared static pool: one graphed step for every row (CUDA graph on a GPU)
        return graphed_step(lms, tokens)
    return torch.cat([out.logits for out in packed_extend(lms, tokens.view(-1, 1))])


@torch.inference_mode()
def packed_extend(lms: Sequence[CachedLM], feeds: Sequence[Union[Sequence[int], Tensor]],
                  hidden_layers: Optional[Sequence[int]] = None,
                  trees: Optional[Sequence[Optional[Tuple[Tensor, Tensor]]]] = None) -> List[StepOutput]:
    """Feed feeds[i] after lms[i]'s cached prefix, every row in one pass; per row, what
    `lms[i].extend(feeds[i], hidden_layers)` returns (logits [n_i, V], hidden [L, n_i, D]), or with
    trees[i] = (positions [n_i], visible [n_i, start_i + n_i]) what `lms[i].extend_tree` returns."""
    if len(lms) != len(feeds):
        raise ValueError(f"need one feed per sequence: {len(lms)} sequences, {len(feeds)} feeds")
    trees = list(trees) if trees is not None else [None] * len(lms)
    if len(lms) == 1 or not can_batch(lms) or any(len(feed) == 0 for feed in feeds):
        return [lm.extend(feed, hidden_layers) if tree is None else lm.extend_tree(feed, *tree, hidden_layers)
                for lm, feed, tree in zip(lms, feeds, trees)]
    first: FastCachedLM = lms[0]  # type: ignore[assignment]
    if first.invariant:  # every row bit-identical to its own one-token decoding (models/invariant_pass.py)
        ids = [lm.as_tensor(feed).view(-1) for lm, feed in zip(lms, feeds)]
        return [StepOutput(*out) for out in invariant_extend(lms, ids, trees, hidden_layers)]
    layers = list(hidden_layers or ())
    for index in layers:
        if not 0 <= index <= first.num_layers:
            raise ValueError(f"layer {index} out of range (model has {first.num_layers} layers)")
    device = first.device
    ids = [lm.as_tensor(feed).view(-1) for lm, feed in zip(lms, feeds)]
    counts = [int(t.numel()) for t in ids]
    starts = [lm.length for lm in lms]
    for lm, start, n in zip(lms, starts, counts):
        lm._grow(start + n)
    total = sum(counts)
    hd, heads, kv_heads = first.head_dim, first.num_heads, first.num_kv_heads
    gqa = heads != kv_heads
    def rotary(table: str) -> Tensor:  # a tree's tokens sit at their depth, not at their slot
        return torch.cat([getattr(lm, table)[s : s + n] if tree is None else
                          getattr(lm, table).index_select(0, tree[0].to(device, torch.long))
                          for lm, s, n, tree in zip(lms, starts, counts, trees)]).view(total, 1, hd)

    cos, sin = rotary("_cos"), rotary("_sin")
    masks = [tree[1].to(device, torch.bool) if tree is not None else
             None if n == 1 else torch.ones(n, s + n, dtype=torch.bool, device=device).tril_(diagonal=s)
             for s, n, tree in zip(starts, counts, trees)]
    spans = []
    offset = 0
    for n in counts:
        spans.append((offset, offset + n))
        offset += n
    biases = row_biases(lms, [1] * len(lms))  # one row per sequence
    repeat = torch.tensor(counts, device=device)
    linear, rms_norm, sdpa = kernel_linear, rms_normalize, F.scaled_dot_product_attention
    x = F.embedding(torch.cat(ids).to(device), first._embed)  # [N, D]
    captured = {}
    plans, head = first.plans_for(total)
    for index, plan in enumerate(plans):
        if index in layers:
            captured[index] = x
        h = rms_norm(x, *plan.input_norm)
        q = linear(h, *plan.q).view(total, heads, hd)
        k = linear(h, *plan.k).view(total, kv_heads, hd)
        v = linear(h, *plan.v).view(total, kv_heads, hd)
        if plan.q_norm is not None:
            q, k = rms_norm(q, *plan.q_norm), rms_norm(k, *plan.k_norm)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        outs = []
        for row, (lm, start, (lo, hi)) in enumerate(zip(lms, starts, spans)):
            keys, values = lm._keys[index], lm._values[index]
            end = start + hi - lo
            keys[0, :, start:end] = k[lo:hi].transpose(0, 1)
            values[0, :, start:end] = v[lo:hi].transpose(0, 1)
            o = sdpa(q[lo:hi].transpose(0, 1).unsqueeze(0), keys[:, :, :end], values[:, :, :end],
                     attn_mask=masks[row], scale=first.scaling, enable_gqa=gqa)  # [1, H, n, hd]
            outs.append(o[0].transpose(0, 1).reshape(hi - lo, heads * hd))
        x = x + linear(torch.cat(outs), *plan.o)
        h = rms_norm(x, *plan.post_attention_norm)
        up = linear(h, *plan.up)
        if biases is not None and biases[index] is not None:  # one row per token already when every n_i = 1
            up = up + (biases[index] if total == len(lms) else biases[index].repeat_interleave(repeat, dim=0))
        x = x + linear(F.silu(linear(h, *plan.gate)) * up, *plan.down)
    for lm, start, n in zip(lms, starts, counts):  # only now: a failed pass leaves every cache as it was
        lm.length = start + n
    normed = rms_norm(x, *first._final_norm)
    if first.num_layers in layers:
        captured[first.num_layers] = normed
    logits = first.project(normed, head)
    hidden = torch.stack([captured[i] for i in layers]) if layers else None
    results = []
    for lm, (lo, hi) in zip(lms, spans):
        if lm.keep_last_hidden:
            lm.last_hidden = normed[hi - 1]
        results.append(StepOutput(logits[lo:hi], None if hidden is None else hidden[:, lo:hi]))
    return results


def first_logits(rows: Sequence, active: List[int]) -> Tensor:
    """Step-0 logits [A, V] of draft rows (`lm`, `committed`, `first_logits`): given ones as they are,
    one-token feeds in one batched pass, longer feeds alone first. Both draft loops start here."""
    logits: List[Optional[Tensor]] = [None] * len(active)
    single: List[int] = []
    for a, i in enumerate(active):
        row = rows[i]
        if row.first_logits is not None:
            logits[a] = row.first_logits
            continue
        feed = list(row.committed[row.lm.length:])
        if len(feed) == 1:
            single.append(a)
        else:
            logits[a] = row.lm.extend(feed, logits_to_keep=1).logits
    if single:
        device = rows[active[single[0]]].lm.device
        feed = torch.tensor([rows[active[a]].committed[-1] for a in single], dtype=torch.long, device=device)
        out = batched_extend([rows[active[a]].lm for a in single], feed)
        for r, a in enumerate(single):
            logits[a] = out[r : r + 1]
    return logits[0] if len(logits) == 1 else torch.cat(logits)  # type: ignore[arg-type]

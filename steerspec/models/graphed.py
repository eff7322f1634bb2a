"""A static KV cache shared by sessions, and CUDA graphs of the one-token step and the k+1 extend.

`StaticKVPool` preallocates K/V for `slots` sequences of `capacity` tokens of one model (plus
one scratch slot that padding rows write to). `GraphedLM` is a FastCachedLM bound to one slot:
rollback is a length change, its eager path is FastCachedLM's own forward over views of the
slot, and short feeds run `static_forward`, whose shapes depend only on (batch bucket, token
bucket): on CUDA that call is captured once per bucket as a CUDA graph and replayed; on a CPU it
runs eagerly (that is how the tests check it). SD²'s per-layer up-bias is a static input
[L, B, F] (zeros when a row is unsteered: adding 0 changes no bit).

`static_forward` attends over the whole capacity under a mask, so its logits equal
FastCachedLM's to float rounding (~1e-6 in fp32), not bit for bit; greedy tokens are the same
(tests/models/test_graphed.py). `cached_lm(model, "graphed")` builds one; `auto` picks it on CUDA.
Environment: STEERSPEC_GRAPH_SLOTS (sequences per pool, default 16), STEERSPEC_GRAPH_CAPACITY
(tokens per sequence, default 2048, at most the model's context: attention reads the whole capacity), STEERSPEC_CUDA_GRAPHS=0
(static cache without graph capture).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from steerspec.models.kv import FastCachedLM, StepOutput, TokenIds, has_global_hooks, rms_normalize, rotate_half

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TOKEN_BUCKETS = (1, 2, 3, 5, 9, 17, 33, 65)  # k + 1 for k = 0, 1, 2, 4, 8, 16, 32, 64


def upload(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor on `device` without waiting for the stream (pinned, non-blocking on CUDA)."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def bucket(n: int, buckets: Sequence[int]) -> Optional[int]:
    """The smallest bucket holding n, or None when n exceeds them all."""
    return next((b for b in buckets if b >= n), None)


class StaticKVPool:
    """Preallocated K/V [slots + 1, capacity, kv_heads, head_dim] per layer for one model, the rotary
    tables, and the CUDA graphs captured over them (slot `slots` is the scratch slot)."""

    def __init__(self, model, slots: int, capacity: int) -> None:
        probe = FastCachedLM.__new__(FastCachedLM)
        FastCachedLM.__init__(probe, model, capacity=0)  # plans and shapes only (a 16-token cache)
        self.model = model
        self.template = probe
        self.slots = int(slots)
        self.capacity = int(min(capacity, probe.max_positions))
        self.device = probe.device
        self.dtype = probe.dtype
        self.scratch = self.slots
        shape = (self.slots + 1, self.capacity, probe.num_kv_heads, probe.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(probe.num_layers)]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(probe.num_layers)]
        positions = torch.arange(self.capacity, device=self.device).unsqueeze(0)
        with torch.inference_mode():
            cos, sin = probe.decoder.rotary_emb(torch.zeros(1, dtype=self.dtype, device=self.device), positions)
        self.cos, self.sin = cos[0], sin[0]
        self.key_positions = torch.arange(self.capacity, device=self.device)
        self.intermediate = int(probe.layer_plans[0].up[0].shape[0])
        self._free = list(range(self.slots - 1, -1, -1))
        self._lock = threading.Lock()
        self.use_graphs = self.device.type == "cuda" and os.environ.get("STEERSPEC_CUDA_GRAPHS", "1") != "0"
        self._graphs: Dict[Tuple[int, int, Tuple[int, ...]], "_Graph"] = {}
        self.bias_cache: Optional[tuple] = None

    def acquire(self) -> Optional[int]:
        with self._lock:
            return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        with self._lock:
            if slot not in self._free:
                self._free.append(slot)

    def graph(self, batch: int, width: int, hidden_layers: Tuple[int, ...]) -> "_Graph":
        """The CUDA graph of static_forward for this bucket, captured on first use."""
        key = (batch, width, hidden_layers)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = _Graph(self, batch, width, hidden_layers)
        return graph


class _Graph:
    """One captured static_forward: its static inputs (tokens [B, W]; slots and starts as one
    [2, B] tensor; bias [L, B, F]), the graph, and its outputs (copied out on each replay, so a
    caller may hold them across the next replay)."""

    def __init__(self, pool: StaticKVPool, batch: int, width: int, hidden_layers: Tuple[int, ...]) -> None:
        device = pool.device
        self.tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
        self.meta = torch.zeros(2, batch, dtype=torch.long, device=device)
        self.meta[0] = pool.scratch
        self.bias = torch.zeros(pool.template.num_layers, batch, pool.intermediate, dtype=pool.dtype, device=device)
        self.bias_src: Optional[Tensor] = None  # the tensor last copied into self.bias (None: zeros)
        args = (pool, self.tokens, self.meta[0], self.meta[1], self.bias, hidden_layers)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for _ in range(2):  # warm-up on a side stream (writes only the scratch slot)
                static_forward(*args)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: other threads (gRPC handlers moving tensors) may use CUDA during a capture
        with torch.inference_mode(), torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.out = static_forward(*args)

    def replay(self, feeds: Tensor, meta: Tensor, bias: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
        rows, width = feeds.shape
        self.tokens[:rows, :width].copy_(feeds, non_blocking=True)  # padding keeps earlier (valid) ids
        self.meta.copy_(meta.pin_memory() if meta.device.type == "cpu" else meta, non_blocking=True)
        if bias is not self.bias_src:
            if bias is None:
                self.bias.zero_()
            else:
                self.bias.copy_(bias, non_blocking=True)
            self.bias_src = bias
        self.graph.replay()
        logits, hidden = self.out
        return logits.clone(), None if hidden is None else hidden.clone()


@torch.inference_mode()
def static_forward(pool: StaticKVPool, tokens: Tensor, slots: Tensor, starts: Tensor, bias: Optional[Tensor],
                   hidden_layers: Tuple[int, ...] = ()) -> Tuple[Tensor, Optional[Tensor]]:
    """Feed tokens [B, n] to sequences in `slots` [B] at positions starts[b] + i; write their K/V
    into the pool and return (logits [B, n, V], hidden states entering `hidden_layers` or None).

    Every shape depends on (B, n) only and no value reaches the host, so a CUDA graph can hold it.
    Row b, position i sees pool positions <= starts[b] + i of its slot. `bias` [L, B, F] is SD²'s
    up-branch bias per layer and row (None: unsteered).
    """
    lm = pool.template
    batch, n = tokens.shape
    hd, heads, kv_heads = lm.head_dim, lm.num_heads, lm.num_kv_heads
    positions = (starts.view(batch, 1) + torch.arange(n, device=tokens.device)).clamp_(max=pool.capacity - 1)
    cos = pool.cos[positions].unsqueeze(1)  # [B, 1, n, hd]
    sin = pool.sin[positions].unsqueeze(1)
    mask = (pool.key_positions.view(1, 1, -1) <= positions.unsqueeze(-1)).unsqueeze(1)  # [B, 1, n, cap]
    rows = slots.view(batch, 1).expand(batch, n)
    linear, rms_norm = F.linear, rms_normalize
    captured: Dict[int, Tensor] = {}
    x = F.embedding(tokens, lm._embed)  # [B, n, D]
    for index, plan in enumerate(lm.layer_plans):
        if index in hidden_layers:
            captured[index] = x
        h = rms_norm(x, *plan.input_norm)
        q = linear(h, *plan.q).view(batch, n, heads, hd)
        k = linear(h, *plan.k).view(batch, n, kv_heads, hd)
        v = linear(h, *plan.v).view(batch, n, kv_heads, hd)
        if plan.q_norm is not None:
            q, k = rms_norm(q, *plan.q_norm), rms_norm(k, *plan.k_norm)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        keys, values = pool.keys[index], pool.values[index]
        keys.index_put_((rows, positions), k.transpose(1, 2))
        values.index_put_((rows, positions), v)
        o = F.scaled_dot_product_attention(q, keys[slots].transpose(1, 2), values[slots].transpose(1, 2),
                                           attn_mask=mask, scale=lm.scaling, enable_gqa=heads != kv_heads)
        x = x + linear(o.transpose(1, 2).reshape(batch, n, heads * hd), *plan.o)
        h = rms_norm(x, *plan.post_attention_norm)
        up = linear(h, *plan.up)
        if bias is not None:
            up = up + bias[index].unsqueeze(1)
        x = x + linear(F.silu(linear(h, *plan.gate)) * up, *plan.down)
    logits = linear(rms_norm(x, *lm._final_norm), *lm._head)
    hidden = torch.stack([captured[i] for i in hidden_layers]) if hidden_layers else None
    return logits, hidden


_POOLS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_POOLS_LOCK = threading.Lock()


def shared_pool(model) -> StaticKVPool:
    """The model's pool with a free slot (a new pool when all are taken)."""
    slots = int(os.environ.get("STEERSPEC_GRAPH_SLOTS", "16"))
    capacity = int(os.environ.get("STEERSPEC_GRAPH_CAPACITY", "2048"))
    with _POOLS_LOCK:
        pools = _POOLS.setdefault(model, [])
        for pool in pools:
            if pool._free:
                return pool
        pool = StaticKVPool(model, slots, capacity)
        pools.append(pool)
        return pool


class GraphedLM(FastCachedLM):
    """One sequence in a slot of a StaticKVPool; short feeds (one-token steps, k+1 verification)
    go through `static_forward` (a CUDA graph on a GPU), long ones (prefill) through FastCachedLM's
    forward over the same slot. Same interface as every CachedLM."""

    def __init__(self, model, pool: Optional[StaticKVPool] = None) -> None:
        self.pool = pool if pool is not None else shared_pool(model)
        slot = self.pool.acquire()
        if slot is None:
            raise RuntimeError(f"static KV pool is full ({self.pool.slots} sequences): close a sequence or "
                               f"raise STEERSPEC_GRAPH_SLOTS")
        self.slot = slot
        self._scan: Optional[tuple] = None
        self._finalizer = weakref.finalize(self, self.pool.release, slot)
        super().__init__(model, capacity=self.pool.capacity)
        self._slot_tensor = torch.tensor([slot], dtype=torch.long, device=self.device)

    def __repr__(self) -> str:
        return f"GraphedLM({type(self.model).__name__}, slot={self.slot}, length={self.length})"

    def close(self) -> None:
        """Give the slot back to the pool (the sequence is unusable afterwards)."""
        self._finalizer()

    def _grow(self, needed: int) -> None:
        if self._keys:
            if needed > self.pool.capacity:
                raise ValueError(f"sequence of {needed} tokens exceeds the static cache ({self.pool.capacity}); "
                                 f"raise STEERSPEC_GRAPH_CAPACITY")
            return
        pool, slot = self.pool, self.slot
        self._keys = [k[slot : slot + 1].transpose(1, 2) for k in pool.keys]  # [1, kv_heads, cap, hd] views
        self._values = [v[slot : slot + 1].transpose(1, 2) for v in pool.values]
        self._capacity = pool.capacity
        self._cos, self._sin = pool.cos, pool.sin

    def _hook_scan(self) -> Tuple[bool, List[object]]:
        """(a foreign hook is on the model, SD² steering owner per layer or None), rescanned only when
        a hook was registered since (RemovableHandle.next_id) or a hook dict seen non-empty changed
        size: a full scan costs ~4 µs per layer, too much for every step. (A `forward` patched onto a
        module after the first call is not seen: call `refresh()` after patching.)"""
        cached = self._scan
        if cached is not None and cached[0] == RemovableHandle.next_id and all(len(d) == k for d, k in cached[3]):
            return cached[1], cached[2]
        foreign, owners, seen = False, [], []
        for plan in self.layer_plans:
            owner = None
            for m in plan.modules:
                for hooks in (m._forward_pre_hooks, m._forward_hooks):
                    if hooks:
                        seen.append((hooks, len(hooks)))
                if m._forward_pre_hooks or "forward" in m.__dict__:
                    foreign = True
                for hook in m._forward_hooks.values():
                    tag = getattr(hook, "steerspec_steering", None)
                    if tag is None or (owner is not None and tag is not owner):
                        foreign = True
                    owner = tag
            owners.append(owner)
        self._scan = (RemovableHandle.next_id, foreign, owners, seen)
        return foreign, owners

    def steering_bias(self, n: int) -> Tuple[bool, Optional[List[Optional[Tensor]]]]:
        """(static path allowed, per-layer up-bias [F] rows or None) for a feed of n tokens.

        Foreign hooks, a per-position or several-row steering bias, or a last-position-only bias
        over several tokens need the eager path.
        """
        if has_global_hooks():
            return False, None
        foreign, owners = self._hook_scan()
        if foreign:
            return False, None
        biases = None if self.up_bias is None else list(self.up_bias)
        for index, steering in enumerate(owners):
            if steering is None or steering._bias is None:
                continue
            if steering._bias.dim() != 3 or steering._bias.shape[0] != 1 or (steering._last_only and n > 1):
                return False, None
            add, _ = steering.fast_up_bias(index)
            if add is not None:
                biases = biases or [None] * self.num_layers
                add = add.reshape(-1)
                biases[index] = add if biases[index] is None else biases[index] + add
        return True, biases

    @torch.inference_mode()
    def extend(self, ids: TokenIds, hidden_layers: Optional[Sequence[int]] = None,
               logits_to_keep: int = 0) -> StepOutput:
        input_ids = self.as_tensor(ids)
        n = input_ids.shape[1]
        width = bucket(n, TOKEN_BUCKETS)
        if n == 0 or width is None or self.length + width > self.pool.capacity:
            return super().extend(input_ids, hidden_layers, logits_to_keep)
        layers = tuple(hidden_layers or ())
        if self.num_layers in layers:  # the final-normed state is not captured: the eager path returns it
            return super().extend(input_ids, hidden_layers, logits_to_keep)
        for index in layers:
            if not 0 <= index < self.num_layers:
                raise ValueError(f"layer {index} out of range (model has {self.num_layers} layers)")
        ok, biases = self.steering_bias(n)
        if not ok:
            return super().extend(input_ids, hidden_layers, logits_to_keep)
        logits, hidden = graphed_extend([self], input_ids, [n], layers, [biases])
        logits, hidden = logits[0, :n], None if hidden is None else hidden[:, 0, :n]
        if logits_to_keep:
            logits = logits[-logits_to_keep:]
        return StepOutput(logits, hidden)


def _stack_biases(lms: Sequence[GraphedLM], rows: Sequence[Optional[List[Optional[Tensor]]]],
                  batch: int) -> Optional[Tensor]:
    """Per-row per-layer biases as one [L, batch, F] tensor (zeros where absent), or None."""
    if all(r is None for r in rows):
        return None
    pool = lms[0].pool
    refs = tuple(tuple(row) if row is not None else None for row in rows)
    key = (batch, tuple(None if r is None else tuple(map(id, r)) for r in refs))
    cached = pool.bias_cache
    if cached is not None and cached[0] == key:
        return cached[2]  # the same bias tensors as last call (every step of a steered block)
    out = torch.zeros(lms[0].num_layers, batch, pool.intermediate, dtype=pool.dtype, device=pool.device)
    for b, row in enumerate(rows):
        for layer, value in enumerate(row or ()):
            if value is not None:
                out[layer, b] = value
    pool.bias_cache = (key, refs, out)  # refs keep the ids in the key alive
    return out


@torch.inference_mode()
def graphed_extend(lms: Sequence[GraphedLM], feeds: Tensor, counts: Sequence[int], hidden_layers: Tuple[int, ...] = (),
                   biases: Optional[Sequence[Optional[List[Optional[Tensor]]]]] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """Feed feeds[b, :counts[b]] to lms[b] (one pool) in one static pass padded to the (batch, token)
    buckets; returns (logits [B, W, V], hidden [L', B, W, D] or None), rows past counts[b] unused.

    The caller checks that the buckets exist and each sequence has room for the padded width.
    """
    pool = lms[0].pool
    if any(lm.pool is not pool for lm in lms):
        raise ValueError("graphed_extend needs sequences of one StaticKVPool")
    rows = len(lms)
    width = bucket(int(feeds.shape[1]), TOKEN_BUCKETS)
    batch = bucket(rows, BATCH_BUCKETS)
    if width is None or batch is None:
        raise ValueError(f"no bucket for {rows} sequences of {feeds.shape[1]} tokens")
    device = pool.device
    meta = torch.tensor([[lm.slot for lm in lms] + [pool.scratch] * (batch - rows),
                         [lm.length for lm in lms] + [0] * (batch - rows)], dtype=torch.long)
    bias = _stack_biases(lms, biases or [lm.up_bias for lm in lms], batch)
    if pool.use_graphs:
        logits, hidden = pool.graph(batch, width, hidden_layers).replay(upload(feeds, device), meta, bias)
    else:
        tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
        tokens[:rows, : feeds.shape[1]] = feeds.to(device)
        meta = meta.to(device)
        logits, hidden = static_forward(pool, tokens, meta[0], meta[1], bias, hidden_layers)
    for lm, count in zip(lms, counts):
        lm.length += int(count)
    return logits[:rows], None if hidden is None else hidden[:, :rows]


def can_graph(lms: Sequence, width: int) -> bool:
    """True when lms are GraphedLMs of one pool, unhooked, and each has room for `width` more tokens."""
    if not lms or not all(isinstance(lm, GraphedLM) for lm in lms):
        return False
    pool = lms[0].pool
    padded = bucket(width, TOKEN_BUCKETS)
    if padded is None or bucket(len(lms), BATCH_BUCKETS) is None:
        return False
    return all(lm.pool is pool and lm.length + padded <= pool.capacity for lm in lms) and all(
        lm.steering_bias(width)[0] and not _active_steering(lm) for lm in lms)


def _active_steering(lm: GraphedLM) -> bool:
    """Hook steering with a bias set (its bias is the model's, not one row's: batch only via up_bias)."""
    return any(owner is not None and owner._bias is not None for owner in lm._hook_scan()[1])


def graphed_step(lms: Sequence[GraphedLM], tokens: Tensor) -> Tensor:
    """One token per sequence (tokens [B]) in one static pass; logits [B, V] (batched drafting)."""
    logits, _ = graphed_extend(lms, tokens.view(-1, 1), [1] * len(lms))
    return logits[:, 0]

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
(tests/test_graphed.py). `cached_lm(model, "graphed")` builds one; `auto` picks it on CUDA.
Environment: STEERSPEC_GRAPH_SLOTS (sequences per pool, default 16), STEERSPEC_GRAPH_CAPACITY
(tokens per sequence, default 4096, at most the model's context), STEERSPEC_CUDA_GRAPHS=0
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

from steerspec.models.kv import FastCachedLM, StepOutput, TokenIds, _has_global_hooks, _hook_state, _rms_norm, _rotate_half

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TOKEN_BUCKETS = (1, 2, 3, 5, 9, 17, 33, 65)  # k + 1 for k = 0, 1, 2, 4, 8, 16, 32, 64


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
        self.intermediate = int(probe._plans[0][10][0].shape[0])
        self._free = list(range(self.slots - 1, -1, -1))
        self._lock = threading.Lock()
        self.use_graphs = self.device.type == "cuda" and os.environ.get("STEERSPEC_CUDA_GRAPHS", "1") != "0"
        self._graphs: Dict[Tuple[int, int, Tuple[int, ...]], "_Graph"] = {}
        self._mempool = None
        self.bias_cache: Optional[tuple] = None

    def acquire(self) -> Optional[int]:
        with self._lock:
            return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        with self._lock:
            if slot not in self._free:
                self._free.append(slot)

    def run(self, tokens: Tensor, slots: Tensor, starts: Tensor, bias: Optional[Tensor],
            hidden_layers: Tuple[int, ...]) -> Tuple[Tensor, Optional[Tensor]]:
        """static_forward over bucket-shaped inputs: replay its CUDA graph (captured on first
        use) or run it eagerly. Returns (logits [B, n, V], hidden [L', B, n, D] or None)."""
        if not self.use_graphs:
            return static_forward(self, tokens, slots, starts, bias, hidden_layers)
        key = (tokens.shape[0], tokens.shape[1], hidden_layers)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = _Graph(self, *key)
        return graph.replay(tokens, slots, starts, bias)


class _Graph:
    """One captured static_forward: static input buffers, the graph, its output tensors."""

    def __init__(self, pool: StaticKVPool, batch: int, width: int, hidden_layers: Tuple[int, ...]) -> None:
        device = pool.device
        self.tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
        self.slots = torch.full((batch,), pool.scratch, dtype=torch.long, device=device)
        self.starts = torch.zeros(batch, dtype=torch.long, device=device)
        self.bias = torch.zeros(pool.template.num_layers, batch, pool.intermediate, dtype=pool.dtype, device=device)
        self.bias_zero = True
        args = (pool, self.tokens, self.slots, self.starts, self.bias, hidden_layers)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for _ in range(2):  # warm-up on a side stream (writes only the scratch slot)
                static_forward(*args)
        torch.cuda.current_stream(device).wait_stream(stream)
        if pool._mempool is None:
            pool._mempool = torch.cuda.graph_pool_handle()
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph, pool=pool._mempool):
            self.out = static_forward(*args)

    def replay(self, tokens: Tensor, slots: Tensor, starts: Tensor, bias: Optional[Tensor]):
        self.tokens.copy_(tokens, non_blocking=True)
        self.slots.copy_(slots, non_blocking=True)
        self.starts.copy_(starts, non_blocking=True)
        if bias is not None:
            self.bias.copy_(bias, non_blocking=True)
            self.bias_zero = False
        elif not self.bias_zero:
            self.bias.zero_()
            self.bias_zero = True
        self.graph.replay()
        return self.out


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
    linear, rms_norm = F.linear, _rms_norm
    captured: Dict[int, Tensor] = {}
    x = F.embedding(tokens, lm._embed)  # [B, n, D]
    for index, plan in enumerate(lm._plans):
        if index in hidden_layers:
            captured[index] = x
        h = rms_norm(x, *plan[1])
        q = linear(h, *plan[3]).view(batch, n, heads, hd)
        k = linear(h, *plan[4]).view(batch, n, kv_heads, hd)
        v = linear(h, *plan[5]).view(batch, n, kv_heads, hd)
        if plan[7] is not None:
            q, k = rms_norm(q, *plan[7]), rms_norm(k, *plan[8])
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys, values = pool.keys[index], pool.values[index]
        keys.index_put_((rows, positions), k.transpose(1, 2))
        values.index_put_((rows, positions), v)
        o = F.scaled_dot_product_attention(q, keys[slots].transpose(1, 2), values[slots].transpose(1, 2),
                                           attn_mask=mask, scale=lm.scaling, enable_gqa=heads != kv_heads)
        x = x + linear(o.transpose(1, 2).reshape(batch, n, heads * hd), *plan[6])
        h = rms_norm(x, *plan[2])
        up = linear(h, *plan[10])
        if bias is not None:
            up = up + bias[index].unsqueeze(1)
        x = x + linear(F.silu(linear(h, *plan[9])) * up, *plan[11])
    logits = linear(rms_norm(x, *lm._final_norm), *lm._head)
    hidden = torch.stack([captured[i] for i in hidden_layers]) if hidden_layers else None
    return logits, hidden


_POOLS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_POOLS_LOCK = threading.Lock()


def shared_pool(model) -> StaticKVPool:
    """The model's pool with a free slot (a new pool when all are taken)."""
    slots = int(os.environ.get("STEERSPEC_GRAPH_SLOTS", "16"))
    capacity = int(os.environ.get("STEERSPEC_GRAPH_CAPACITY", "4096"))
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

    def steering_bias(self, n: int) -> Tuple[bool, Optional[List[Optional[Tensor]]]]:
        """(static path allowed, per-layer up-bias [F] rows or None) for a feed of n tokens.

        Foreign hooks, a per-position steering bias, or a last-position-only bias over several
        tokens need the eager path.
        """
        if _has_global_hooks():
            return False, None
        biases = None if self.up_bias is None else list(self.up_bias)
        for index, plan in enumerate(self._plans):
            hooked, steering = _hook_state(plan[0])
            if hooked:
                return False, None
            if steering is None:
                continue
            if steering._bias is not None and (steering._bias.shape[0] != 1 or (steering._last_only and n > 1)):
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
    tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
    tokens[:rows, : feeds.shape[1]] = feeds.to(device)
    starts = [lm.length for lm in lms] + [0] * (batch - rows)
    slots = [lm.slot for lm in lms] + [pool.scratch] * (batch - rows)
    slots_t = torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True)
    starts_t = torch.tensor(starts, dtype=torch.long).to(device, non_blocking=True)
    bias = _stack_biases(lms, biases or [lm.up_bias for lm in lms], batch)
    logits, hidden = pool.run(tokens, slots_t, starts_t, bias, hidden_layers)
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
    for plan in lm._plans:
        _, steering = _hook_state(plan[0])
        if steering is not None and steering._bias is not None:
            return True
    return False


def graphed_step(lms: Sequence[GraphedLM], tokens: Tensor) -> Tensor:
    """One token per sequence (tokens [B]) in one static pass; logits [B, V] (batched drafting)."""
    logits, _ = graphed_extend(lms, tokens.view(-1, 1), [1] * len(lms))
    return logits[:, 0]

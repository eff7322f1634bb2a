"""A causal LM with its own KV cache: extend by a block, roll back to an accepted length.

Both sides of speculative decoding hold one (batch 1). Two backends, one interface
(`length`, `extend(ids, hidden_layers=None, logits_to_keep=0) -> StepOutput`, `rollback(n)`,
`reset()`); `models/backends.py`'s `cached_lm(model)` picks the fast one when the architecture allows:

- `CachedLM`: the transformers forward with a `DynamicCache`; rollback crops it (transformers
  5.x `crop` takes a negative count to remove). Hidden states entering chosen decoder layers
  are captured by forward pre-hooks registered once, idle unless a call asks for them.
- `FastCachedLM`: a lean forward over the same parameters with preallocated per-layer K/V
  buffers (rollback moves an index); several times less per-call overhead on small models.

After any rollback the next-token logits equal a fresh full forward over the kept prefix
(tests/models/test_models_kv.py checks both backends to 1e-4).
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules import module as _module

from steerspec.models.layouts import (
    DEFAULT_ONEDNN_MIN_ROWS,
    ONEDNN_ENV,
    LayerPlan,
    LayoutPlans,
    is_input_major,
    is_packable,
    onednn_min_rows,
    out_major,
    out_major_rows,
    packed,
)
from steerspec.models.invariant_pass import invariant_extend, invariant_plan
from steerspec.models.invariant_ops import rms_norm_rows
from steerspec.models.layouts import linear as kernel_linear
from steerspec.models.layouts import onednn_available
from steerspec.models.loading import cache_kwarg

TokenIds = Union[Sequence[int], Tensor]
ONE_ROW_ATTR = "_steerspec_one_row_onednn"  # on the model: threads -> whether one-row passes read oneDNN copies
# (and ("retime", threads) -> how many more wrappers time it again, after a disturbed timing)


class CacheSlice(NamedTuple):
    """A lean cache's slots from `start` to `length` (keys and values per layer, copied): what a block drafted
    ahead of its result left in the cache after the committed prefix (drafter_service/ahead.py)."""

    start: int
    length: int
    keys: List[Tensor]
    values: List[Tensor]


class StepOutput(NamedTuple):
    """logits [n, V] for the fed positions (or the last ones kept); hidden [L, n, D] or None."""

    logits: Tensor
    hidden: Optional[Tensor]


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layer list of a Llama/Qwen/Mistral-style causal LM."""
    return model.get_decoder().layers


class CachedLM:
    """One sequence (batch 1) and its KV cache over a Hugging Face causal LM."""

    def __init__(self, model) -> None:
        # lazy: transformers takes seconds to import
        from transformers import DynamicCache

        self.model = model
        self.device = model.device
        self._cache_arg = cache_kwarg(model)
        self._cache_cls = DynamicCache
        self.cache = DynamicCache(config=model.config)
        self.length = 0
        self.layers = decoder_layers(model)
        self.num_layers = len(self.layers)
        self.hidden_size = int(model.config.hidden_size)
        self.vocab_size = int(model.config.vocab_size)
        self._want: frozenset = frozenset()  # layers to capture while a capturing call runs
        self._captured: dict = {}
        self.keep_last_hidden = False  # keep the final-normed hidden state of the last fed position
        self.last_hidden: Optional[Tensor] = None  # [D], set by extend when keep_last_hidden
        self._hooked: set = set()

    def __repr__(self) -> str:
        return f"CachedLM({type(self.model).__name__}, length={self.length})"

    def _hook(self, index: int):
        def pre_hook(module, args, kwargs):
            if index in self._want:
                self._captured[index] = args[0] if args else kwargs["hidden_states"]

        return pre_hook

    def _final_hook(self, module, args, output):
        if self.num_layers in self._want:
            self._captured[self.num_layers] = output

    def _ensure_hooks(self, layers: Sequence[int]) -> None:
        for index in layers:
            if index == self.num_layers and index not in self._hooked:  # the final-normed state
                self.model.get_decoder().norm.register_forward_hook(self._final_hook)
                self._hooked.add(index)
            if index not in self._hooked:
                if not 0 <= index < self.num_layers:
                    raise ValueError(f"layer {index} out of range (model has {self.num_layers} layers)")
                self.layers[index].register_forward_pre_hook(self._hook(index), with_kwargs=True)
                self._hooked.add(index)

    def as_tensor(self, ids: TokenIds) -> Tensor:
        """Token ids -> LongTensor [1, n] on the model's device (no copy when already so)."""
        if isinstance(ids, Tensor):
            t = ids.to(device=self.device, dtype=torch.long)
            return t.view(1, -1)
        return torch.tensor([list(ids)], dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def extend(self, ids: TokenIds, hidden_layers: Optional[Sequence[int]] = None,
               logits_to_keep: int = 0) -> StepOutput:
        """Feed `ids` after the cached prefix; return their logits (and hidden states entering
        `hidden_layers`, [L, n, D]; index num_layers is the final-normed state the LM head reads,
        used by draft-length policies). `logits_to_keep` > 0 keeps only the last rows (prefill)."""
        input_ids = self.as_tensor(ids)
        n = input_ids.shape[1]
        if n == 0:
            hidden = None
            if hidden_layers:
                hidden = torch.zeros(len(hidden_layers), 0, self.hidden_size, device=self.device)
            return StepOutput(torch.zeros(0, self.vocab_size, device=self.device), hidden)
        if hidden_layers:
            self._ensure_hooks(hidden_layers)
            self._want = frozenset(hidden_layers)
        try:
            out = self.model(input_ids=input_ids, use_cache=True, **{self._cache_arg: self.cache},
                             logits_to_keep=logits_to_keep, output_hidden_states=self.keep_last_hidden)
        except BaseException:
            # a failed forward may leave a partial cache behind: drop it to stay consistent
            self._want = frozenset()
            self._captured = {}
            self.reset()
            raise
        self.length += n
        if self.keep_last_hidden:
            self.last_hidden = out.hidden_states[-1][0, -1]  # after the final norm (what the LM head read)
        hidden = None
        if hidden_layers:
            self._want = frozenset()
            hidden = torch.stack([self._captured[layer][0] for layer in hidden_layers])
            self._captured = {}
        return StepOutput(out.logits[0], hidden)

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens."""
        if length < 0 or length > self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length} tokens")
        if length < self.length:
            self.cache.crop(length - self.length)
            self.length = length

    def reset(self) -> None:
        """Empty the cache (a new sequence)."""
        self.cache = self._cache_cls(config=self.model.config)
        self.length = 0


class FastCachedLM(CachedLM):
    """The same interface with a lean forward pass and a preallocated KV cache (gpt-fast style).

    It computes with the model's own parameters (shared, never copied, so in-place updates are
    seen) and skips transformers' per-call machinery (mask building, output recording, cache
    objects, module dispatch). Keys and values live in per-layer buffers that grow by doubling;
    rollback only moves `length`. Rotary tables come once from the model's own rotary module.
    A layer whose norms, projections or MLP carry forward hooks (or an overridden `forward`) is
    run through those modules instead, so hooks keep working. The SD² steering bias has a direct
    path: `set_up_bias([b_0 .. b_{L-1}])` adds b_l to the up branch of layer l's MLP.
    Used for Llama/Qwen2/Qwen3/Mistral without an active sliding window (`supports(model)`).
    If modules or parameters of the model are *replaced* after wrapping, call `refresh()`.
    """

    def __init__(self, model, capacity: int = 256) -> None:
        super().__init__(model)
        config = model.config
        self.cache = None
        first = self.layers[0].self_attn
        self.head_dim = int(first.head_dim)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.scaling = float(first.scaling)
        self.decoder = model.get_decoder()
        self.dtype = self.decoder.embed_tokens.weight.dtype
        self.max_positions = int(getattr(config, "max_position_embeddings", 0) or 4096)
        self.up_bias: Optional[List[Optional[Tensor]]] = None
        self._capacity = 0
        self._keys: List[Tensor] = []
        self._values: List[Tensor] = []
        self._cos = self._sin = None
        self.refresh()
        self._grow(min(capacity, self.max_positions))
        self._choose_one_row_layout()

    ONE_ROW_MARGIN = 0.97  # oneDNN for one row only where it is more than 3% faster (as `bench layouts` says)
    ONE_ROW_STEADY = 1.25  # an attempt whose slowest pass took over 25% longer than its fastest was disturbed
    ONE_ROW_RETIMES = 2  # after a disturbed timing, later wrappers of the same model time it again this often
    ONE_ROW_JITTER_S = 0.002  # passes faster than this spread by timer jitter, not contention: steady as they are

    def _choose_one_row_layout(self, repeats: int = 5, attempts: int = 3) -> None:
        """Time a one-row pass on the model's input-major weights and on the oneDNN-packed copies, and
        use the packed ones for one row too where they are faster: on AVX-512 EPYCs they are (SmolLM2:
        43 → 34 ms), on the AVX2 ones not. Measured once per model, thread count and process; a timing
        disturbed by other work on the cores (a process starting beside it flipped the verdict, costing
        every later one-row pass 25%) is retried, and redone by the model's next wrappers."""
        if (self.device.type != "cpu" or self._packed is None or os.environ.get(ONEDNN_ENV) is not None
                or self.invariant):
            return  # no copies, the environment decides, or invariant passes read one layout for every row count
        verdicts = self.model.__dict__.setdefault(ONE_ROW_ATTR, {})
        threads = torch.get_num_threads()
        retime = ("retime", threads)  # in the same dict, so that setting a verdict by hand clears it
        if threads not in verdicts or verdicts.get(retime, 0) > 0:
            verdict, steady = self._time_one_row_layouts(repeats, attempts, warm=threads not in verdicts)
            left = verdicts.pop(retime, self.ONE_ROW_RETIMES + 1) - 1
            verdicts[threads] = verdict
            if not steady and left > 0:
                verdicts[retime] = left
        self._packed_from = 1 if verdicts[threads] else DEFAULT_ONEDNN_MIN_ROWS

    def _time_one_row_layouts(self, repeats: int, attempts: int, warm: bool) -> Tuple[bool, bool]:
        """(packed copies faster for one row, whether an undisturbed attempt said so). Each attempt times
        `repeats` interleaved passes of each layout; the first whose passes all lie within ONE_ROW_STEADY
        of their fastest (or are too fast to tell: a tiny model, decided as before) decides by medians,
        else the fastest pass of each layout over every attempt does (other work only ever adds time)."""
        layouts = (1, DEFAULT_ONEDNN_MIN_ROWS)
        if warm:  # a first, untimed round warms both up
            for rows_from in layouts:
                self._time_one_row(rows_from)
        seen = {rows: [] for rows in layouts}
        for _ in range(attempts):
            times = {rows: [] for rows in layouts}
            for _ in range(repeats):
                for rows_from in layouts:
                    times[rows_from].append(self._time_one_row(rows_from))
            for rows in layouts:
                seen[rows] += times[rows]
            if all(max(t) <= self.ONE_ROW_STEADY * min(t) or min(t) < self.ONE_ROW_JITTER_S
                   for t in times.values()):
                one, default = (statistics.median(times[rows]) for rows in layouts)
                return one < self.ONE_ROW_MARGIN * default, True
        one, default = (min(seen[rows]) for rows in layouts)
        return one < self.ONE_ROW_MARGIN * default, False

    def _time_one_row(self, rows_from: int) -> float:
        """Seconds of one one-row pass with the packed copies read from `rows_from` rows; the cache is
        rolled back after it."""
        self._packed_from = rows_from
        length = self.length
        t0 = time.perf_counter()
        self.extend([0])
        elapsed = time.perf_counter() - t0
        self.rollback(length)
        return elapsed

    def refresh(self) -> None:
        """Re-read parameter references from the model (after replacing modules or parameters)."""
        self._embed = self.decoder.embed_tokens.weight
        norm = self.decoder.norm
        self._final_norm = (norm.weight, float(norm.variance_epsilon))
        head = self.model.lm_head
        self._head = (head.weight, head.bias)
        # A head with a `support` (models/reduced.py) scatters its rows' logits into the full vocabulary.
        self._head_module = head if isinstance(getattr(head, "support", None), torch.Tensor) else None
        self.layer_plans: List[LayerPlan] = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            watched = [layer.input_layernorm, layer.post_attention_layernorm, attn.q_proj, attn.k_proj,
                       attn.v_proj, attn.o_proj, mlp, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
            watched += [m for m in (q_norm, k_norm) if m is not None]
            self.layer_plans.append(LayerPlan(
                modules=watched,
                input_norm=(layer.input_layernorm.weight, float(layer.input_layernorm.variance_epsilon)),
                post_attention_norm=(layer.post_attention_layernorm.weight,
                                     float(layer.post_attention_layernorm.variance_epsilon)),
                q=(attn.q_proj.weight, attn.q_proj.bias), k=(attn.k_proj.weight, attn.k_proj.bias),
                v=(attn.v_proj.weight, attn.v_proj.bias), o=(attn.o_proj.weight, attn.o_proj.bias),
                q_norm=None if q_norm is None else (q_norm.weight, float(q_norm.variance_epsilon)),
                k_norm=None if k_norm is None else (k_norm.weight, float(k_norm.variance_epsilon)),
                gate=(mlp.gate_proj.weight, mlp.gate_proj.bias), up=(mlp.up_proj.weight, mlp.up_proj.bias),
                down=(mlp.down_proj.weight, mlp.down_proj.bias),
            ))
        cpu = self.device.type == "cpu"
        self.set_out_major_rows(out_major_rows() if cpu else frozenset())
        self.set_onednn_min_rows(onednn_min_rows() if cpu else 0)
        self._invariant_copies: Optional[LayoutPlans] = None  # made on the first invariant pass (`_copies_for`)
        if self._capacity:  # a refresh after construction keeps the measured one-row choice
            self._choose_one_row_layout()

    def set_out_major_rows(self, rows) -> None:
        """Use the out-major weight copies for passes of these row counts (see `plans_for`)."""
        self._out_rows = frozenset(rows)
        self._layouts = (LayoutPlans(self.model, self.layer_plans, self._head, out_major, is_input_major)
                         if self._out_rows else None)
        if self._layouts is not None and not self._layouts.useful:
            self._layouts = None

    def set_onednn_min_rows(self, rows: int) -> None:
        """Use oneDNN-packed weight copies for passes of at least `rows` rows (0: never; see `plans_for`)."""
        self._packed = LayoutPlans(self.model, self.layer_plans, self._head, packed, is_packable) if rows else None
        if self._packed is not None and not self._packed.useful:
            self._packed = None
        self._packed_from = rows if self._packed is not None else 0

    @property
    def out_major_rows(self) -> "frozenset[int]":
        """The row counts whose passes read the out-major copies (empty when none are in use)."""
        return self._out_rows if self._layouts is not None else frozenset()

    @property
    def onednn_min_rows(self) -> int:
        """The smallest pass that reads the oneDNN-packed copies (0 when none are in use)."""
        return self._packed_from

    @property
    def invariant(self) -> bool:
        """Whether this model's passes are batch-invariant (models/invariant_pass.py: `set_invariant`)."""
        return invariant_plan(self.model) is not None

    def _copies_for(self, rows: int) -> Optional[LayoutPlans]:
        """The weight copies a pass over `rows` rows reads: oneDNN-packed, else out-major, else None (invariant
        passes: one layout whatever the rows)."""
        plan = invariant_plan(self.model)
        if plan is not None:  # one layout for every row count: the packed copies, or the model's own weights
            if plan.layout != "packed" or self.device.type != "cpu" or not onednn_available():
                return None
            if self._invariant_copies is None:
                self._invariant_copies = LayoutPlans(self.model, self.layer_plans, self._head, packed, is_packable)
            return self._invariant_copies
        if self._packed is not None and rows >= self._packed_from:
            return self._packed
        if self._layouts is not None and rows in self._out_rows:
            return self._layouts
        return None

    def reads_copies(self, rows: int) -> bool:
        """Whether a pass over `rows` rows reads weight copies rather than the model's own weights."""
        return self._copies_for(rows) is not None

    def plans_for(self, rows: int) -> "tuple[list, tuple]":
        """(layer plans, head) for a pass over `rows` rows: oneDNN-packed or out-major weight copies
        where they are faster (`steerspec/models/layouts.py`), else the model's own weights. Run the
        plans' linears with `layouts.linear`, which reads either."""
        copies = self._copies_for(rows)
        if copies is None:
            return self.layer_plans, self._head
        current = copies.current()
        return current.plans, current.head

    def project(self, normed: Tensor, head: Optional[Tuple[Tensor, Optional[Tensor]]] = None) -> Tensor:
        """Final-normed hidden states -> full-vocabulary logits (`head`: this weight and bias instead, e.g.
        a layout copy). A reduced head's support logits come from the same copies, then scatter."""
        logits = kernel_linear(normed, *(head or self._head))
        return logits if self._head_module is None else self._head_module.scatter(logits)

    def set_up_bias(self, biases: Optional[Sequence[Optional[Tensor]]]) -> None:
        """SD² steering: add biases[l] ([intermediate]) to the up branch of layer l; None clears."""
        if biases is not None and len(biases) != self.num_layers:
            raise ValueError(f"need one bias per layer ({self.num_layers}), got {len(biases)}")
        self.up_bias = None if biases is None else list(biases)

    @staticmethod
    def supports_config(config) -> bool:
        """What a model's config alone says: an architecture the lean forward covers (before loading it)."""
        if config.model_type not in ("llama", "mistral", "qwen2", "qwen3"):
            return False
        if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
            return False
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None) or []
        if window and ("sliding_attention" in layer_types or config.model_type == "mistral"):
            if window < int(getattr(config, "max_position_embeddings", 0) or 0):
                return False
        return True

    @staticmethod
    def supports(model) -> bool:
        if not FastCachedLM.supports_config(model.config):
            return False
        attn = decoder_layers(model)[0].self_attn
        return all(hasattr(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"))

    def _grow(self, needed: int) -> None:
        if needed <= self._capacity:
            return
        capacity = max(needed, 2 * self._capacity, 16)
        shape = (1, self.num_kv_heads, capacity, self.head_dim)
        keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        for old, new in zip(self._keys + self._values, keys + values):
            new[:, :, : self.length] = old[:, :, : self.length]
        self._keys, self._values = keys, values
        self._capacity = capacity
        positions = torch.arange(capacity, device=self.device).unsqueeze(0)
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            cos, sin = self.decoder.rotary_emb(probe, positions)
        self._cos, self._sin = cos[0], sin[0]  # [capacity, head_dim]

    def extend(self, ids: TokenIds, hidden_layers: Optional[Sequence[int]] = None,
               logits_to_keep: int = 0) -> StepOutput:
        return self._extend(ids, hidden_layers, logits_to_keep)

    def extend_tree(self, ids: TokenIds, positions: Tensor, visible: Tensor,
                    hidden_layers: Optional[Sequence[int]] = None) -> StepOutput:
        """Feed tree tokens after the cached slots (steerspec/decoding/trees.py): token i sits at position
        `positions[i]` and attends where `visible` [n, length + n] is True (the committed prefix and
        its own ancestors, cached or fed in this call), not causally by slot."""
        return self._extend(ids, hidden_layers, 0, positions, visible)

    @torch.inference_mode()
    def keep(self, start: int, slots: Sequence[int]) -> None:
        """Keep the first `start` cached slots, then `slots` (absolute, increasing) packed right after
        them: the tree path a verifier accepted becomes a plain prefix of start + len(slots) tokens."""
        if any(s < start or s >= self.length for s in slots) or list(slots) != sorted(set(slots)):
            raise ValueError(f"cannot keep slots {list(slots)} of a cache of {self.length} from {start}")
        index = torch.tensor(list(slots), dtype=torch.long, device=self.device)
        end = start + index.numel()
        for keys, values in zip(self._keys, self._values):
            keys[:, :, start:end] = keys.index_select(2, index)
            values[:, :, start:end] = values.index_select(2, index)
        self.length = end

    @torch.inference_mode()
    def _extend(self, ids: TokenIds, hidden_layers: Optional[Sequence[int]] = None, logits_to_keep: int = 0,
                positions: Optional[Tensor] = None, visible: Optional[Tensor] = None) -> StepOutput:
        input_ids = self.as_tensor(ids)
        n = input_ids.shape[1]
        start = self.length
        end = start + n
        if n == 0:
            return super().extend(ids, hidden_layers, logits_to_keep)
        if hidden_layers:
            for index in hidden_layers:
                if not 0 <= index <= self.num_layers:
                    raise ValueError(f"layer {index} out of range (model has {self.num_layers} layers)")
        if self.invariant and self.lean_ok():
            tree = None if positions is None else (positions, visible)
            logits, hidden = invariant_extend([self], [input_ids.view(-1)], [tree], hidden_layers, logits_to_keep)[0]
            return StepOutput(logits, hidden)
        self._grow(end)
        want = frozenset(hidden_layers or ())
        captured = {}
        if positions is not None:  # a tree: positions by depth, attention by ancestry
            positions = positions.to(self.device, torch.long)
            cos = self._cos.index_select(0, positions).view(1, 1, n, self.head_dim)
            sin = self._sin.index_select(0, positions).view(1, 1, n, self.head_dim)
            mask = visible.to(self.device, torch.bool)
            if mask.shape != (n, end):
                raise ValueError(f"a tree of {n} tokens after {start} cached needs a mask of {(n, end)}, got {tuple(mask.shape)}")
        else:
            cos = self._cos[start:end].view(1, 1, n, self.head_dim)
            sin = self._sin[start:end].view(1, 1, n, self.head_dim)
            mask = None
        causal = n > 1 and positions is None and start == 0  # a prefill from empty: SDPA's causal kernel
        if n > 1 and positions is None and not causal:
            # new row i sees every cached token and new tokens 0..i
            mask = torch.ones(n, end, dtype=torch.bool, device=self.device).tril_(diagonal=start)
        hd, heads, kv_heads = self.head_dim, self.num_heads, self.num_kv_heads
        gqa = heads != kv_heads
        linear, rms_norm = kernel_linear, rms_normalize
        global_hooks = has_global_hooks()
        up_bias = self.up_bias
        x = F.embedding(input_ids, self._embed)  # [1, n, D]
        plans, head = self.plans_for(n)
        for index, layer in enumerate(self.layers):
            if index in want:
                captured[index] = x[0]
            plan = plans[index]
            hooked, steering = (True, None) if global_hooks else hook_state(plan.modules)
            bias = None if up_bias is None else up_bias[index]
            if hooked:
                attn = layer.self_attn
                h = layer.input_layernorm(x)
                q = attn.q_proj(h).view(1, n, heads, hd)
                k = attn.k_proj(h).view(1, n, kv_heads, hd)
                v = attn.v_proj(h).view(1, n, kv_heads, hd).transpose(1, 2)
                if plan.q_norm is not None:
                    q, k = attn.q_norm(q), attn.k_norm(k)
            else:
                h = rms_norm(x, *plan.input_norm)
                q = linear(h, *plan.q).view(1, n, heads, hd)
                k = linear(h, *plan.k).view(1, n, kv_heads, hd)
                v = linear(h, *plan.v).view(1, n, kv_heads, hd).transpose(1, 2)
                if plan.q_norm is not None:
                    q, k = rms_norm(q, *plan.q_norm), rms_norm(k, *plan.k_norm)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            keys, values = self._keys[index], self._values[index]
            keys[:, :, start:end] = k
            values[:, :, start:end] = v
            o = F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end], attn_mask=mask,
                                               is_causal=causal, scale=self.scaling, enable_gqa=gqa)
            o = o.transpose(1, 2).reshape(1, n, heads * hd)
            if hooked:
                mlp = layer.mlp
                x = x + layer.self_attn.o_proj(o)
                h = layer.post_attention_layernorm(x)
                if bias is None:
                    x = x + mlp(h)
                else:
                    x = x + mlp.down_proj(mlp.act_fn(mlp.gate_proj(h)) * (mlp.up_proj(h) + bias))
            else:
                x = x + linear(o, *plan.o)
                h = rms_norm(x, *plan.post_attention_norm)
                up = linear(h, *plan.up)  # a fresh tensor: the SD² biases are added in place
                if bias is not None:
                    up += bias
                if steering is not None:  # SD² hooks on up_proj, applied here instead of through the module
                    add, last_only = steering.fast_up_bias(index)
                    if add is not None:
                        if last_only and n > 1:
                            up[:, -1:] += add
                        else:
                            up += add
                x = x + linear(F.silu(linear(h, *plan.gate)) * up, *plan.down)
        self.length = end
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        normed = rms_norm(x, *self._final_norm)
        if self.keep_last_hidden:
            self.last_hidden = normed[0, -1]
        if normed.shape[1] != n:  # logits_to_keep: the head's pass has fewer rows than the layers'
            head = self.plans_for(normed.shape[1])[1]
        logits = self.project(normed, head)[0]
        if self.num_layers in want:
            captured[self.num_layers] = normed[0]
        hidden = torch.stack([captured[i] for i in hidden_layers]) if hidden_layers else None
        return StepOutput(logits, hidden)

    def lean_ok(self) -> bool:
        """Whether the lean forward may skip every module (no hook of any kind, no SD² steering to apply)."""
        if has_global_hooks():
            return False
        for plan in self.layer_plans:
            hooked, steering = hook_state(plan.modules)
            if hooked or steering is not None:
                return False
        return True

    def rollback(self, length: int) -> None:
        if length < 0 or length > self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length} tokens")
        self.length = length

    @torch.inference_mode()
    def fork(self, spare: int = 64) -> "FastCachedLM":
        """A second cache over the same model and layouts holding a copy of this one's slots (room for `spare` more):
        drafting ahead drafts a block per verdict in forks, batched, leaving this cache as it is. Cheap for a small
        drafter (a 2-layer drafter keeps a few KB per token)."""
        twin = copy.copy(self)
        twin._keys, twin._values = [], []
        for keys, values in zip(self._keys, self._values):
            twin._keys.append(torch.empty_like(keys))
            twin._values.append(torch.empty_like(values))
            twin._keys[-1][:, :, : self.length] = keys[:, :, : self.length]
            twin._values[-1][:, :, : self.length] = values[:, :, : self.length]
        twin._grow(self.length + spare)  # doubles, keeping the slots, where `spare` does not fit
        twin.up_bias = None
        twin.keep_last_hidden = False
        twin.last_hidden = None
        return twin

    @torch.inference_mode()
    def save(self, start: int) -> CacheSlice:
        """A copy of the slots from `start` to the end (the part a prepared block changes)."""
        start = max(0, min(int(start), self.length))
        return CacheSlice(start, self.length, [k[:, :, start:self.length].clone() for k in self._keys],
                          [v[:, :, start:self.length].clone() for v in self._values])

    @torch.inference_mode()
    def load(self, piece: CacheSlice) -> None:
        """Put a saved slice back: slots `piece.start` onwards hold it and the cache ends where it ended (the
        slots before `start` must hold what they held when it was saved)."""
        if piece.start > self.length:
            raise ValueError(f"cannot load slots from {piece.start}: cache holds {self.length} tokens")
        self._grow(piece.length)
        for keys, values, k, v in zip(self._keys, self._values, piece.keys, piece.values):
            keys[:, :, piece.start:piece.length] = k
            values[:, :, piece.start:piece.length] = v
        self.length = piece.length

    def reset(self) -> None:
        self.length = 0


rms_normalize = rms_norm_rows  # transformers' RMSNorm (float32 statistics, weight applied in the input dtype)


def hook_state(modules) -> Tuple[bool, object]:
    """(must run through the modules, SD² steering to apply on the fast path).

    Hooks tagged `steerspec_steering` (steerspec.steering.SteeringHooks on up_proj) do not force
    the slow path: their per-block bias is added directly. Any other hook does.
    """
    steering = None
    for m in modules:
        if m._forward_pre_hooks or "forward" in m.__dict__:
            return True, None
        for hook in m._forward_hooks.values():
            owner = getattr(hook, "steerspec_steering", None)
            if owner is None or (steering is not None and owner is not steering):
                return True, None
            steering = owner
    if steering is not None and not steering.fast_path_ok():
        return True, None
    return False, steering


def has_global_hooks() -> bool:
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def prepare_weight_copies(model) -> int:
    """Make now the weight copies that multi-row CPU passes of `model` read (models/layouts.py), and
    time its one-row layout, so that a server's first block does not pay for them (2-3 s for
    SmolLM2-135M); call it on the thread that runs the passes (steerspec/serving/compute.py: a second
    computing thread slows every pass). Returns how many row-count plans were prepared (0 off the
    CPU, for other architectures or with the copies off)."""
    if model.device.type != "cpu" or not FastCachedLM.supports(model):
        return 0
    lm = FastCachedLM(model, capacity=1)
    rows = {lm.onednn_min_rows} | set(lm.out_major_rows)
    for n in sorted(r for r in rows if r):
        lm.plans_for(n)
    return len(rows - {0})

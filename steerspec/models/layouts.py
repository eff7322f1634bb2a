"""CPU weight layouts for a pass of a few rows: input-major for one row, oneDNN-packed (or out-major) for more.

`use_input_major_weights` stores every CPU linear weight transposed because BLAS streams a one-row
product (a decoding step) fastest that way. A pass of more rows (a verify pass of k + 1 tokens, a
drafter's catch-up feed, a batch of sessions) is another matter: MKL's small-M sgemm does not reuse a
weight across rows on every CPU, so such a pass costs close to one step per row. The lean forwards
therefore keep oneDNN-packed copies of the weights (`torch.ops.mkldnn._linear_pointwise`, what
inductor's CPU freezing uses) for passes of at least `STEERSPEC_ONEDNN_MIN_ROWS` rows (default 2; 0 turns
them off; float32, and bfloat16 on a CPU with native bf16 instructions). Measured by `steerspec bench layouts` (docs/results/engine.md, "CPU kernels").
Where oneDNN is off, out-major copies serve the row counts in `STEERSPEC_OUT_MAJOR_ROWS` (default 2,3;
empty: none), as measured on the 2-core VM of earlier sessions, SmolLM2-135M, fp32, one thread: 2 rows 63.4 → 49.0 ms,
3 rows 64.3 → 54.1 ms, one row 43.8 against 47.4. Each copy is made on first use, once per model and
shared by every sequence that wraps it, and remade when its weight changes (a new tensor, or an
in-place update that bumps its version counter).
"""

from __future__ import annotations

import os
from typing import Callable, Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

ENV = "STEERSPEC_OUT_MAJOR_ROWS"
DEFAULT_ROWS: Tuple[int, ...] = (2, 3)
CACHE_ATTR = "_steerspec_out_major"  # on the model: id(weight) -> (fingerprint, out-major copy)
ONEDNN_ENV = "STEERSPEC_ONEDNN_MIN_ROWS"
DEFAULT_ONEDNN_MIN_ROWS = 2
PACKED_ATTR = "_steerspec_onednn"  # on the model: id(weight) -> (fingerprint, oneDNN-packed copy)
Linear = Tuple[Tensor, Optional[Tensor]]  # (weight, bias)
Norm = Tuple[Tensor, float]  # (weight, eps)


class LayerPlan(NamedTuple):
    """One decoder layer's parameters as a FastCachedLM's lean forward reads them (references, not copies)."""

    modules: List[torch.nn.Module]  # watched for hooks (kv.hook_state)
    input_norm: Norm
    post_attention_norm: Norm
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    q_norm: Optional[Norm]  # Qwen3's per-head norms; None elsewhere
    k_norm: Optional[Norm]
    gate: Linear
    up: Linear
    down: Linear


WEIGHTS = ("q", "k", "v", "o", "gate", "up", "down")  # the LayerPlan fields whose weights a layout copies


def out_major_rows() -> FrozenSet[int]:
    """The row counts that use the out-major copies: $STEERSPEC_OUT_MAJOR_ROWS, else DEFAULT_ROWS."""
    text = os.environ.get(ENV)
    if text is None:
        return frozenset(DEFAULT_ROWS)
    try:
        rows = frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{ENV} must be comma-separated row counts (e.g. 2,3) or empty, got {text!r}") from None
    if any(r < 1 for r in rows):
        raise ValueError(f"{ENV} row counts must be at least 1, got {text!r}")
    return rows


def onednn_min_rows() -> int:
    """The smallest pass (in rows) that reads oneDNN-packed weights: $STEERSPEC_ONEDNN_MIN_ROWS, else 2;
    0 when they are off or this torch has no oneDNN linear."""
    text = os.environ.get(ONEDNN_ENV)
    try:
        rows = DEFAULT_ONEDNN_MIN_ROWS if text is None or not text.strip() else int(text)
    except ValueError:
        raise ValueError(f"{ONEDNN_ENV} must be a row count (e.g. 4) or 0 for off, got {text!r}") from None
    if rows < 0:
        raise ValueError(f"{ONEDNN_ENV} must be at least 0 (0 turns oneDNN off), got {text!r}")
    return rows if rows and onednn_available() else 0


def onednn_available() -> bool:
    """Whether this torch build packs and runs oneDNN linear weights on the CPU."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """F.linear, or oneDNN's linear when `weight` is a packed copy (`packed`)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def is_packable(weight: Tensor) -> bool:
    """A 2-D float32 CPU weight, or a bfloat16 one where the CPU has native bf16 (what oneDNN packing takes here)."""
    return (weight.dim() == 2 and weight.device.type == "cpu" and not weight.is_mkldnn and min(weight.shape) > 1
            and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and native_bf16())))


_NATIVE_BF16: Dict[str, bool] = {}


def native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX-BF16) and oneDNN uses it: there a
    packed bf16 linear streams half the bytes of a float32 one (SmolLM2's drafter: a pass 3.6 -> 2.2 ms);
    elsewhere oneDNN emulates bf16 (an AVX2 VM: 10x slower than float32). Read once per process."""
    if "cpu" not in _NATIVE_BF16:
        flags: set = set()
        try:
            with open("/proc/cpuinfo") as handle:
                for line in handle:
                    if line.startswith("flags"):
                        flags = set(line.split(":", 1)[1].split())
                        break
        except OSError:
            pass
        ops = torch.ops.mkldnn
        _NATIVE_BF16["cpu"] = bool(flags & {"avx512_bf16", "amx_bf16"}) and onednn_available() and \
            hasattr(ops, "_is_mkldnn_bf16_supported") and bool(ops._is_mkldnn_bf16_supported())
    return _NATIVE_BF16["cpu"]


DRAFTER_DTYPES = ("auto", "float32", "float16", "bfloat16")


def drafter_dtype(requested: Optional[str], dtype: str, device: str = "cpu") -> str:
    """The dtype a drafter loads in: `requested`, or the verifier's `dtype` when None; "auto" is bfloat16 on a CPU
    with native bf16 when the verifier runs in float32 (the drafter's precision only moves its acceptance, never
    the output, which stays the verifier's), else the verifier's dtype."""
    if dtype == "auto":  # the verifier's dtype is the machine's choice, float32 or (native CPUs) bfloat16: either way
        requested, dtype = (requested or "auto"), "float32"  # a drafter on a native CPU computes in bfloat16
    if requested is None or requested == dtype:
        return dtype
    if requested == "auto":
        where = str(device).split(":")[0]
        cpu = where == "cpu" or (where == "auto" and not torch.cuda.is_available())
        return "bfloat16" if cpu and dtype == "float32" and native_bf16() else dtype
    return requested


def is_input_major(weight: Tensor) -> bool:
    """A 2-D CPU weight stored transposed (what `use_input_major_weights` makes)."""
    return (weight.dim() == 2 and weight.device.type == "cpu" and not weight.is_contiguous()
            and weight.t().is_contiguous() and min(weight.shape) > 1)


def _fingerprint(weight: Tensor) -> Tuple[int, int]:
    return weight.data_ptr(), weight._version


class CopyCache(dict):
    """id(weight) -> (fingerprint, copy), kept on the model. It copies and pickles as empty: packed
    tensors cannot be deep-copied or saved, and a copied model's weights are new tensors anyway, so
    `copy.deepcopy(model)`, `torch.save(model)` and Ray's pickling keep working and remake on use."""

    def __deepcopy__(self, memo) -> "CopyCache":
        return CopyCache()

    def __reduce__(self):
        return CopyCache, ()


def _cached_copy(model, attr: str, weight: Tensor, make: Callable[[Tensor], Tensor]) -> Tensor:
    """make(weight), cached on `model` under `attr` by the weight's identity and remade when the
    weight changes (a new tensor, or an in-place update that bumps its version counter)."""
    cache: Dict[int, Tuple[Tuple[int, int], Tensor]] = model.__dict__.get(attr)
    if cache is None:
        cache = model.__dict__[attr] = CopyCache()
    key, stamp = id(weight), _fingerprint(weight)
    hit = cache.get(key)
    if hit is None or hit[0] != stamp:
        with torch.inference_mode(False), torch.no_grad():  # a normal tensor, even when made inside a pass
            hit = (stamp, make(weight.detach()))
        cache[key] = hit
    return hit[1]


def out_major(model, weight: Tensor) -> Tensor:
    """The out-major contiguous copy of an input-major `weight` of `model` (same values), cached on
    the model; `weight` itself when it is not input-major."""
    if not is_input_major(weight):
        return weight
    return _cached_copy(model, CACHE_ATTR, weight, Tensor.contiguous)


def packed(model, weight: Tensor) -> Tensor:
    """The oneDNN-packed copy of a float32 CPU `weight` of `model` (same values, read by `linear`),
    cached on the model and remade when the weight changes; `weight` itself when it cannot be packed."""
    if not is_packable(weight):
        return weight
    return _cached_copy(model, PACKED_ATTR, weight,
                        lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None))  # any strides


class LayoutPlans:
    """A FastCachedLM's layer plans and head with copies of their weights swapped in (`convert`:
    `out_major` or `packed`, with `copies`: the weights it copies), rebuilt when a source weight changes."""

    def __init__(self, model, plans: Sequence[LayerPlan], head: Linear,
                 convert: Callable[[object, Tensor], Tensor], copies: Callable[[Tensor], bool]) -> None:
        self.model = model
        self.convert = convert
        self.sources = [getattr(plan, name)[0] for plan in plans for name in WEIGHTS] + [head[0]]
        self.useful = any(copies(w) for w in self.sources)
        self._plans, self._head = list(plans), head
        self._stamp: Optional[tuple] = None
        self.plans: List[LayerPlan] = []
        self.head: Linear = head

    def current(self) -> "LayoutPlans":
        """Self, with its plans and head up to date with the source weights."""
        stamp = tuple(_fingerprint(w) for w in self.sources)
        if stamp != self._stamp:
            swap = lambda pair: (self.convert(self.model, pair[0]), pair[1])  # noqa: E731
            self.plans = [plan._replace(**{name: swap(getattr(plan, name)) for name in WEIGHTS}) for plan in self._plans]
            self.head = swap(self._head)
            self._stamp = stamp
        return self

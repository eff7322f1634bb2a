"""The faster CPU weight layout for a product of a few rows: input-major for one row, out-major for 2–3.

`use_input_major_weights` stores every CPU linear weight transposed because BLAS streams a one-row
product (a decoding step) fastest that way. For two or three rows (a verify pass of k + 1 tokens at
k = 1 or 2, a drafter's catch-up feed) the original out-major storage is faster: SmolLM2-135M on this
project's 2-core machine, fp32, one thread, medians of 7: 2 rows 63.4 → 49.0 ms, 3 rows 64.3 → 54.1 ms,
while one row is 43.8 against 47.4 and four rows 68.6 against 89.3 (`steerspec bench layouts`).
So the lean forwards keep one out-major copy of each input-major weight per model, shared by every
sequence that wraps it, and use it for those row counts. The copy is remade when its weight changes
(a new tensor, or an in-place update that bumps its version counter). `STEERSPEC_OUT_MAJOR_ROWS`
(comma-separated row counts) overrides the default; an empty value turns the copies off.
"""

from __future__ import annotations

import os
from typing import Dict, FrozenSet, Optional, Sequence, Tuple

import torch
from torch import Tensor

ENV = "STEERSPEC_OUT_MAJOR_ROWS"
DEFAULT_ROWS: Tuple[int, ...] = (2, 3)
CACHE_ATTR = "_steerspec_out_major"  # on the model: id(weight) -> (fingerprint, out-major copy)
WEIGHT_SLOTS = (3, 4, 5, 6, 9, 10, 11)  # the (weight, bias) entries of a FastCachedLM layer plan


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


def is_input_major(weight: Tensor) -> bool:
    """A 2-D CPU weight stored transposed (what `use_input_major_weights` makes)."""
    return (weight.dim() == 2 and weight.device.type == "cpu" and not weight.is_contiguous()
            and weight.t().is_contiguous() and min(weight.shape) > 1)


def _fingerprint(weight: Tensor) -> Tuple[int, int]:
    return weight.data_ptr(), weight._version


def out_major(model, weight: Tensor) -> Tensor:
    """The out-major contiguous copy of an input-major `weight` of `model` (same values), cached on
    the model; `weight` itself when it is not input-major."""
    if not is_input_major(weight):
        return weight
    cache: Dict[int, Tuple[Tuple[int, int], Tensor]] = model.__dict__.setdefault(CACHE_ATTR, {})
    key, stamp = id(weight), _fingerprint(weight)
    hit = cache.get(key)
    if hit is None or hit[0] != stamp:
        with torch.inference_mode(False), torch.no_grad():  # a normal tensor, even when made inside a pass
            hit = (stamp, weight.detach().contiguous())
        cache[key] = hit
    return hit[1]


class LayoutPlans:
    """A FastCachedLM's layer plans and head with the out-major copies swapped in, rebuilt when a
    source weight changes."""

    def __init__(self, model, plans: Sequence[tuple], head: Tuple[Tensor, Optional[Tensor]]) -> None:
        self.model = model
        self.sources = [plan[slot][0] for plan in plans for slot in WEIGHT_SLOTS] + [head[0]]
        self.useful = any(is_input_major(w) for w in self.sources)
        self._plans, self._head = list(plans), head
        self._stamp: Optional[tuple] = None
        self.plans: list = []
        self.head: Tuple[Tensor, Optional[Tensor]] = head

    def current(self) -> "LayoutPlans":
        """Self, with its plans and head up to date with the source weights."""
        stamp = tuple(_fingerprint(w) for w in self.sources)
        if stamp != self._stamp:
            swap = lambda pair: (out_major(self.model, pair[0]), pair[1])  # noqa: E731
            self.plans = [tuple(swap(entry) if slot in WEIGHT_SLOTS else entry for slot, entry in enumerate(plan))
                          for plan in self._plans]
            self.head = swap(self._head)
            self._stamp = stamp
        return self

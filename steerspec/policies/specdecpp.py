"""SpecDec++: a trained head on the drafter's last hidden state decides when to stop drafting.

For draft i the head gives r_i = P(draft i is rejected | drafts 1..i-1 accepted). The probability
that the block already holds a rejection is 1 - Π_{j≤i}(1 - r_j); the block stops as soon as it
exceeds h (SpecDec++'s stopping rule, its Section 4). Blocks are at most k long. The head is
trained by `steerspec train specdecpp` (labels as in Pacer's Section 3.3) and lives in
<drafter>/policy_heads/specdecpp.safetensors unless head=PATH is given.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from steerspec.policies.base import DraftStep, PolicyBase, check_k, check_open_unit
from steerspec.policies.catalog import Key, register
from steerspec.policies.heads import context_hidden_size, head_path, load_head


@register("specdecpp", {"h": Key(float, 0.7, "stop when P(block holds a rejection) > h"),
                        "k": Key(int, 20, "most tokens per block"),
                        "head": Key(str, "", "head file (default: <drafter>/policy_heads/specdecpp.safetensors)")},
          doc="SpecDec++: trained rejection head")
class SpecDecPP(PolicyBase):
    """Stop when 1 - Π(1 - r_i) > h, r_i from the trained head on the drafter's hidden state."""

    name = "specdecpp"
    stops_early = True
    needs_hidden = True

    def __init__(self, h: float = 0.7, k: int = 20, head: str = "", context: Optional[Any] = None) -> None:
        self.h = check_open_unit(h, "h")
        self.max_k = check_k(k)
        path = head or head_path("specdecpp", getattr(context, "drafter_dir", None))
        self.head = load_head("specdecpp", path, context_hidden_size(context))
        self._survive = 1.0

    def next_k(self) -> int:
        self._survive = 1.0
        return self.max_k

    @torch.inference_mode()
    def reject_probability(self, hidden: torch.Tensor) -> float:
        param = next(self.head.parameters())
        return float(torch.sigmoid(self.head(hidden.to(param.device, param.dtype))))

    def observe(self, step: DraftStep) -> bool:
        if step.hidden is None:
            raise RuntimeError("specdecpp needs the drafter's hidden states (the draft loop gave none)")
        self._survive *= 1.0 - self.reject_probability(step.hidden)
        return 1.0 - self._survive > self.h

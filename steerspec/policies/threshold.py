"""AssistantThreshold: stop a block when the drafter's top probability falls below p.

transformers' `assistant_confidence_threshold` (default 0.4): after each drafted token, if the
drafter's probability of its most likely token is below p, the block ends there (that token is
still proposed). Blocks are at most k long; no adaptive state.
"""

from __future__ import annotations

from typing import Any, Optional

from steerspec.policies.base import DraftStep, PolicyBase, check_k, check_open_unit
from steerspec.policies.catalog import Key, register


@register("threshold", {"p": Key(float, 0.4, "stop below this top probability"),
                        "k": Key(int, 20, "most tokens per block")},
          doc="AssistantThreshold: confidence stop")
class AssistantThreshold(PolicyBase):
    """Draft up to k tokens, stopping after the first whose top drafter probability is < p."""

    name = "threshold"
    stops_early = True

    def __init__(self, p: float = 0.4, k: int = 20, context: Optional[Any] = None) -> None:
        self.p = check_open_unit(p, "p")
        self.max_k = check_k(k)

    def next_k(self) -> int:
        return self.max_k

    def observe(self, step: DraftStep) -> bool:
        return float(step.probs.max()) < self.p

"""transformers' assisted-generation schedule (the papers' HFHeuristic).

Exactly `AssistedCandidateGenerator.update_candidate_strategy` with the "heuristic" schedule:
start at the initial k; after a block whose drafts were all accepted k += 2, otherwise
k = max(1, k - 1). The state is k.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from steerspec.policies.base import MAX_K, BlockFeedback, PolicyBase, check_k
from steerspec.policies.catalog import Key, register


@register("heuristic", {"k": Key(int, 5, "initial tokens per block"), "max": Key(int, MAX_K, "cap on k")},
          doc="HF assisted generation: +2 when all accepted, -1 otherwise", length_keys=("max",))
class Heuristic(PolicyBase):
    """k grows by 2 after a fully accepted block and shrinks by 1 (never below 1) otherwise."""

    name = "heuristic"

    def __init__(self, k: int = 5, max: int = MAX_K, context: Optional[Any] = None) -> None:
        self.initial = check_k(k)
        self.max_k = check_k(max, "max")
        if self.initial > self.max_k:
            raise ValueError(f"initial k={k} exceeds max={max}")
        self.k = self.initial

    def next_k(self) -> int:
        return self.k

    def update(self, feedback: BlockFeedback) -> None:
        if feedback.drafted <= 0:
            return
        if feedback.accepted >= feedback.drafted:
            self.k = min(self.max_k, self.k + 2)
        else:
            self.k = max(1, self.k - 1)

    def reset(self) -> None:
        self.k = self.initial

    def state_dict(self) -> Dict[str, Any]:
        return {"k": self.k}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.k = check_k(int(state["k"]))

"""Fixed draft length (the papers' SpecDecode): every block proposes exactly k tokens."""

from __future__ import annotations

from typing import Any, Optional

from steerspec.policies.base import PolicyBase, check_k
from steerspec.policies.catalog import Key, register


@register("fixed", {"k": Key(int, 8, "tokens per block")}, doc="standard speculative decoding", trees=True)
class FixedK(PolicyBase):
    """k tokens per block, always."""

    name = "fixed"

    def __init__(self, k: int = 8, context: Optional[Any] = None) -> None:
        self.k = check_k(k)
        self.max_k = self.k

    def next_k(self) -> int:
        return self.k

    def __repr__(self) -> str:
        return f"FixedK(k={self.k})"

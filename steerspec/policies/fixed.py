"""Fixed draft length: every block proposes exactly k tokens."""

from __future__ import annotations

from steerspec.policies.base import PolicyBase, check_k


class FixedK(PolicyBase):
    """k tokens per block, always."""

    def __init__(self, k: int = 8) -> None:
        self.k = check_k(k)

    def next_k(self) -> int:
        return self.k

    def __repr__(self) -> str:
        return f"FixedK(k={self.k})"

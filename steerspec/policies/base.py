"""The draft-length policy interface.

The engine asks `next_k()` before each block, may consult `should_stop(...)` after every draft
token (only when `stops_early` is True, so fixed policies cost nothing per token), and reports
the verifier's verdict with `update(accepted, drafted)` after each block.
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

from torch import Tensor

MIN_K, MAX_K = 1, 64


@runtime_checkable
class DraftLengthPolicy(Protocol):
    """What the engine needs from a policy."""

    stops_early: bool

    def next_k(self) -> int:
        """Draft length for the next block (1..64)."""

    def update(self, accepted: int, drafted: int) -> None:
        """The verifier accepted `accepted` of `drafted` tokens of the last block."""

    def should_stop(self, draft_probs: Tensor, position: int, hidden: Optional[Tensor] = None) -> bool:
        """After drafting token `position` (0-based) from `draft_probs` [V]: stop the block here?"""

    def reset(self) -> None:
        """A new sequence starts."""


class PolicyBase:
    """Defaults: never stop early, keep no state."""

    stops_early = False

    def next_k(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def update(self, accepted: int, drafted: int) -> None:
        return None

    def should_stop(self, draft_probs: Tensor, position: int, hidden: Optional[Tensor] = None) -> bool:
        return False

    def reset(self) -> None:
        return None


def check_k(k: int) -> int:
    """Validate a draft length."""
    if not (MIN_K <= int(k) <= MAX_K):
        raise ValueError(f"k (draft length) must be in [{MIN_K}, {MAX_K}], got {k}")
    return int(k)

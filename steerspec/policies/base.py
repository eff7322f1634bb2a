"""The draft-length policy contract: what a policy sees per drafted token and per block.

The draft loop asks `next_k()` before each block. When `stops_early` is True it calls
`observe(step)` after every drafted token (fixed policies cost nothing per token) and stops
the block when it returns True. After the verifier answers, `update(feedback)` reports the
verdict and the block's measured stage times. A policy's state is part of the session:
`state_dict()` is JSON-serialisable and `load_state_dict` restores it after a failover.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Protocol, Tuple, runtime_checkable

from torch import Tensor

MIN_K, MAX_K = 1, 64


@dataclass(frozen=True)
class DraftStep:
    """One drafted token as the sampler saw it.

    `position` is 0-based in the block; `probs` [V] is the drafter's distribution exactly as the
    sampler used it (temperature, top-k and top-p applied; for greedy blocks the temperature-1
    softmax under the same top-k/top-p); `hidden` [D] is the drafter's final hidden state (after
    its final norm, what the LM head read) at the position that produced this token, present
    only when the policy declares `needs_hidden`.
    """

    position: int
    token: int
    probs: Tensor
    hidden: Optional[Tensor] = None


@dataclass(frozen=True)
class BlockFeedback:
    """The verifier's verdict on one block, its measured cost (milliseconds; 0 when unknown) and the verifier's load.

    `overhead_ms` is the rest of the block's cycle that drafting, verify, queue and network do not
    explain: through the services the verifier hop's RPC and the coordinator's work; in process the
    rollback, commit, steering and accounting between blocks (each block carries the previous one's)."""

    accepted: int
    drafted: int
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    queue_ms: float = 0.0
    network_ms: float = 0.0
    overhead_ms: float = 0.0
    path: Tuple[int, ...] = ()  # a tree block's accepted nodes (slots), root to leaf; () for a chain
    shape: Tuple[Tuple[int, ...], ...] = ()  # a tree block's nodes as rank paths, breadth-first; () for a chain
    draft_compute_ms: float = 0.0  # the drafter's own compute for the block (draft_ms also holds the hop; 0: unknown)
    # the verifier's load as it reports it with the result (0 when unknown: in process, an older verifier)
    batch_size: int = 0  # blocks in the pass that verified this one
    pass_rows: int = 0  # rows that pass scored
    blocks_waiting: int = 0  # blocks queued for the next pass
    cost_fixed_ms: float = 0.0  # its pass cost: cost_fixed_ms + cost_per_block_ms * blocks + cost_per_row_ms * rows
    cost_per_row_ms: float = 0.0
    cost_per_block_ms: float = 0.0
    cost_per_branched_row_ms: float = 0.0  # + this * the rows of blocks that are branching trees
    cost_row_bucket: int = 0  # the units of that cost (steerspec/models/pass_shape.py; 0s: plain counts)
    cost_block_rows: float = 0.0


@runtime_checkable
class DraftLengthPolicy(Protocol):
    """What the draft loop needs from a policy."""

    name: str
    stops_early: bool
    needs_hidden: bool
    max_k: int

    def next_k(self) -> int:
        """Draft length for the next block (1..max_k; 0 for a policy whose `min_k` is 0: a block of no drafts)."""

    def observe(self, step: DraftStep) -> bool:
        """After drafting `step`: True stops the block here (called only when `stops_early`)."""

    def update(self, feedback: BlockFeedback) -> None:
        """The verifier's verdict on the last block."""

    def reset(self) -> None:
        """A new sequence starts."""

    def state_dict(self) -> Dict[str, Any]:
        """The policy's adaptive state (JSON-serialisable), carried with the session."""

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore the state `state_dict` returned (after a drafter failover)."""


class PolicyBase:
    """Defaults: never stop early, need no hidden state, keep no adaptive state."""

    name = "base"
    stops_early = False
    needs_hidden = False
    # True when the state describes the pair and the link, not a sequence: a drafter service then starts
    # each new session of the same spec from its latest session's state, as one policy object in process
    # carries it from sequence to sequence
    warm_start = False
    max_k = MAX_K
    min_k = MIN_K  # 0: the policy may send blocks of no drafts (the verifier alone's round trip)

    def next_k(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def observe(self, step: DraftStep) -> bool:
        return False

    def update(self, feedback: BlockFeedback) -> None:
        return None

    def reset(self) -> None:
        return None

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        return None


def check_k(k: int, name: str = "k") -> int:
    """Validate a draft length."""
    if not (MIN_K <= int(k) <= MAX_K) or int(k) != k:
        raise ValueError(f"{name} (draft length) must be an integer in [{MIN_K}, {MAX_K}], got {k}")
    return int(k)


def check_open_unit(value: float, name: str) -> float:
    """Validate a threshold in (0, 1)."""
    value = float(value)
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {value}")
    return value

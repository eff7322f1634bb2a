"""What the verifier's batch carries: a session's submitted block (`VerifyJob`, with a tree session's checked
`TreeBlock`) and its verdict (`JobResult`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from torch import Tensor

from steerspec.decoding.sampling import SparseDist
from steerspec.decoding.trees import TreeShape
from steerspec.serving.wire import WireBlock
from verifier_service.verify_sessions import VerifierSession


@dataclass(frozen=True)
class TreeBlock:
    """A tree session's block as checked once on arrival: the nodes it carries and the distribution each
    parent's children were drawn from (None when greedy), so the batch reuses them instead of redoing both."""

    shape: TreeShape
    q_at: Optional[Dict[int, SparseDist]]


@dataclass
class VerifyJob:
    """One session's block waiting for (or in) a batch."""

    session: VerifierSession
    block: WireBlock
    tree: Optional[TreeBlock] = None  # set for every tree session's block: `tree_verify.check_block` (None: a chain)
    submitted: float = field(default_factory=time.perf_counter)
    future: Optional[asyncio.Future] = None


@dataclass
class JobResult:
    accepted: int
    next_token: int
    is_bonus: bool
    steering: Optional[Tensor]
    queue_ms: float
    verify_ms: float
    batch_size: int
    error: Optional[BaseException] = None
    labels: Optional[object] = None  # SPRINTER runs: steerspec.sprinter.labels.RunLabels of the run's tokens
    path: Optional[List[int]] = None  # tree sessions: the accepted nodes, root to leaf (verifier_service/tree_verify.py)

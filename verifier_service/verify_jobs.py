"""What the verifier's batch carries: a session's submitted block (`VerifyJob`, with what its kind checked on
arrival) and its verdict (`JobResult`, the block kinds' own: steerspec/blocks/block_kind.py)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Optional

from steerspec.blocks.block_kind import JobResult
from steerspec.serving.wire import WireBlock
from verifier_service.verify_sessions import VerifierSession

__all__ = ["JobResult", "VerifyJob"]


@dataclass
class VerifyJob:
    """One session's block waiting for (or in) a batch."""

    session: VerifierSession
    block: WireBlock
    checked: Optional[object] = None  # what the session's kind checked on arrival (`BlockKind.admit`), for `verify`
    submitted: float = field(default_factory=time.perf_counter)
    future: Optional[asyncio.Future] = None

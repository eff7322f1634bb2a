"""Batched drafting on the server: draft requests of concurrent sessions share one compute call.

`DraftBatcher` collects the sessions that ask for a block for at most `window_s` (ending early
once every active session has asked) and hands them to `draft_many` (Drafter.draft_many: one
batched forward pass per draft step), so the per-step Python cost is paid once per batch: for a CPU model on
the drafter's `PriorityWorker` (the one thread that owns the model, urgent before drafting ahead:
steerspec/serving/priority_worker.py), else on a single compute thread, where a lone session drafts inline on the
event loop (no thread hop, no wait).
Requests that arrive while a batch computes form the next batch.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

from drafter_service.draft_sessions import DrafterSession, DraftOutput
from steerspec.serving.batching import WindowBatcher

DraftMany = Callable[[Sequence[DrafterSession]], List[DraftOutput]]


@dataclass
class DraftJob:
    """One session waiting for its next block."""

    session: DrafterSession
    submitted: float = field(default_factory=time.perf_counter)
    future: Optional[asyncio.Future] = None


class DraftBatcher(WindowBatcher[DraftJob, DraftOutput]):
    """Draft requests of concurrent sessions served by one `draft_many` call on one compute thread."""

    def __init__(self, draft_many: DraftMany, window_s: float, expected: Callable[[], int],
                 max_batch: int = 64, inline: bool = False, executor=None) -> None:
        super().__init__(lambda jobs: draft_many([job.session for job in jobs]), window_s, expected,
                         max_batch=max_batch, thread_name="draft", inline=inline, executor=executor)

    async def submit(self, session: DrafterSession) -> DraftOutput:  # type: ignore[override]
        """Draft the session's next block, batched with whoever asks at about the same time."""
        return await super().submit(DraftJob(session=session))

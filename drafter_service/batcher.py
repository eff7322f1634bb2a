"""Batched drafting on the server: draft requests of concurrent sessions share one compute call.

`DraftBatcher` collects the sessions that ask for a block for at most `window_s` (ending early
once every active session has asked) and hands them to `draft_many` (Drafter.draft_many: one
batched forward pass per draft step) on a single compute thread, so the per-step Python cost is
paid once per batch. A lone session drafts inline on the event loop (no thread hop, no wait).
Requests that arrive while a batch computes form the next batch.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

from drafter_service.sessions import DrafterSession, DraftOutput

DraftMany = Callable[[Sequence[DrafterSession]], List[DraftOutput]]


@dataclass
class DraftJob:
    """One session waiting for its next block."""

    session: DrafterSession
    submitted: float = field(default_factory=time.perf_counter)
    future: Optional[asyncio.Future] = None


class DraftBatcher:
    """Collects draft requests for at most `window_s`, or until every active session has asked."""

    def __init__(self, draft_many: DraftMany, window_s: float, expected: Callable[[], int],
                 max_batch: int = 64) -> None:
        self.draft_many = draft_many
        self.window_s = max(0.0, float(window_s))
        self.expected = expected
        self.max_batch = max(1, int(max_batch))
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft")
        self._pending: List[DraftJob] = []
        self._wake: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self._busy = 0  # batches running on the compute thread
        self.batches = 0  # compute calls made
        self.batched_blocks = 0  # blocks drafted by them (batched_blocks / batches = mean batch size)
        self.max_batch_seen = 0

    def _count(self, size: int) -> None:
        self.batches += 1
        self.batched_blocks += size
        self.max_batch_seen = max(self.max_batch_seen, size)

    async def submit(self, session: DrafterSession) -> DraftOutput:
        """Draft the session's next block, batched with whoever asks at about the same time."""
        if self.expected() <= 1 and not self._pending and not self._busy:
            self._count(1)  # a lone session: draft right here
            return self.draft_many([session])[0]
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())
        job = DraftJob(session=session, future=asyncio.get_running_loop().create_future())
        self._pending.append(job)
        self._wake.set()
        return await job.future

    async def _collect(self) -> List[DraftJob]:
        """Wait for a first job, then up to the window for the other active sessions."""
        while not self._pending:
            self._wake.clear()
            await self._wake.wait()
        deadline = self._pending[0].submitted + self.window_s
        while len(self._pending) < min(self.expected(), self.max_batch):
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except asyncio.TimeoutError:
                break
        jobs, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
        return [j for j in jobs if not j.future.done() and not j.session.closed]

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            jobs = await self._collect()
            if not jobs:
                continue
            self._busy += 1
            try:
                outputs = await loop.run_in_executor(self.executor, self.draft_many, [j.session for j in jobs])
            except Exception as exc:  # the forward failed: every session in it gets the error
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(exc)
                continue
            finally:
                self._busy -= 1
            self._count(len(jobs))
            for job, output in zip(jobs, outputs):
                if not job.future.done():
                    job.future.set_result(output)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for job in self._pending:
            if job.future is not None and not job.future.done():
                job.future.cancel()
        self._pending = []
        self.executor.shutdown(wait=False, cancel_futures=True)

"""Window batching shared by the verifier and the drafter services.

`WindowBatcher.submit(job)` hands concurrent sessions' jobs to one `compute(jobs) -> results`
call: it collects for at most `window_s` after the first job (ending early once every active
session has submitted) and runs the batch. With `inline` (a CPU model: steerspec/serving/compute.py says
why) every call runs on the event loop's thread; otherwise batches run on a single compute thread,
so the loop keeps reading other streams, and a lone session computes inline (no thread hop, no
wait). Given an `executor` (a `PriorityWorker` that owns the model: steerspec/serving/priority_worker.py), every
call runs there, a lone session's too, so no other thread ever uses the model. A job is any object with `session` (with `closed`, `in_compute` and `lm`), `submitted` and
`future` attributes.

It also keeps the load it has served, which GetStats reports: compute calls, the rows they scored (`rows_of`
a job: a block of k drafts is k + 1 rows), and the seconds spent computing (batches, lone jobs and
`run_compute` calls such as prefills).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Generic, List, Optional, Sequence, TypeVar

J = TypeVar("J")
R = TypeVar("R")


def free_cache(session) -> None:
    """Empty a closed session's KV cache, unless a compute call still uses it: that call's end does it
    (closing a stream must not pull a cache from under a batch that other sessions share)."""
    if session.closed and not session.in_compute:
        session.lm.reset()
        if hasattr(session.lm, "close"):  # a GraphedLM gives its static-pool slot back
            session.lm.close()


class WindowBatcher(Generic[J, R]):
    """Collects jobs for at most `window_s`, or until `expected()` sessions have submitted."""

    def __init__(self, compute: Callable[[List[J]], Sequence[R]], window_s: float, expected: Callable[[], int],
                 max_batch: int = 64, thread_name: str = "compute", inline: bool = False,
                 rows_of: Callable[[J], int] = lambda job: 1, executor=None) -> None:
        self.compute = compute
        self.rows_of = rows_of
        self.inline = bool(inline) and executor is None
        self.shortcut = executor is None  # a lone session may compute inline on the loop
        self.window_s = max(0.0, float(window_s))
        self.expected = expected
        self.max_batch = max(1, int(max_batch))
        self.executor = executor if executor is not None else (
            None if self.inline else ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name))
        self._pending: List[J] = []
        self._wake: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self._busy = 0  # calls running on the compute thread
        self.batches = 0  # compute calls made
        self.batched_blocks = 0  # jobs they served (batched_blocks / batches = mean batch size)
        self.max_batch_seen = 0
        self.rows = 0  # rows the compute calls scored (rows / batches = mean rows per pass)
        self.busy_s = 0.0  # seconds spent in compute calls and run_compute
        self.on_pass: Optional[Callable[[int, int], None]] = None  # (blocks, rows) of each pass: metrics

    def start(self) -> None:
        """Start the collecting task (done on the first queued job otherwise)."""
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def _count(self, jobs: Sequence[J]) -> None:
        self.batches += 1
        self.batched_blocks += len(jobs)
        self.max_batch_seen = max(self.max_batch_seen, len(jobs))
        rows = sum(self.rows_of(job) for job in jobs)
        self.rows += rows
        if self.on_pass is not None:
            self.on_pass(len(jobs), rows)

    @property
    def queue_depth(self) -> int:
        """Jobs waiting for a compute pass."""
        return len(self._pending)

    @property
    def queue_depth(self) -> int:
        """Jobs waiting for a compute pass."""
        return len(self._pending)

    def _timed(self, fn, *args):
        """`fn(*args)`, its seconds added to `busy_s` (one compute call runs at a time)."""
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.busy_s += time.perf_counter() - start

    async def run_compute(self, fn, *args, hold: Sequence = ()):
        """Run `fn(*args)` on the compute thread (serialised with batches), or inline on the event
        loop when the batcher is inline or at most one session is active (a thread hop costs
        milliseconds on a loaded host).

        The sessions in `hold` keep their caches until `fn` has returned on that thread, even when
        they close (or this call is cancelled) meanwhile: see `free_cache`.
        """
        if self.inline or (self.shortcut and self.expected() <= 1 and not self._busy):
            return self._timed(fn, *args)
        loop = asyncio.get_running_loop()
        self._busy += 1
        for session in hold:
            session.in_compute += 1

        def release(_future) -> None:  # on the event loop, once fn has really finished (or never started)
            self._busy -= 1
            for session in hold:
                session.in_compute -= 1
                free_cache(session)

        def done(future) -> None:  # on the compute thread
            try:
                loop.call_soon_threadsafe(release, future)
            except RuntimeError:  # the loop has closed (shutdown): nothing is left to free
                pass

        work = self.executor.submit(self._timed, fn, *args)
        work.add_done_callback(done)
        return await asyncio.wrap_future(work, loop=loop)

    async def submit(self, job: J) -> R:
        """The job's result, computed alone (a lone session) or batched with concurrent ones."""
        job.submitted = time.perf_counter()
        if (self.inline or self.shortcut) and self.expected() <= 1 and not self._pending and not self._busy:
            self._count([job])
            return self._timed(self.compute, [job])[0]
        self.start()
        job.future = asyncio.get_running_loop().create_future()
        self._pending.append(job)
        self._wake.set()
        return await job.future

    async def _collect(self) -> List[J]:
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
        while True:
            jobs = await self._collect()
            if not jobs:
                continue
            try:
                results = await self.run_compute(self.compute, jobs, hold=[job.session for job in jobs])
            except Exception as exc:  # the forward failed: every job in it gets the error
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(exc)
                continue
            self._count(jobs)
            for job, result in zip(jobs, results):
                if not job.future.done():
                    job.future.set_result(result)

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
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)

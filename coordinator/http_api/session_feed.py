"""One generation run in its own task, read through a queue: the HTTP handler waits for its first response
(so a refusal still gets its status code), the stream drains the rest, and closing the feed (the client went
away, the deadline passed) cancels the task, which ends the session on every service and frees its caches."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator, Optional

import grpc

from coordinator.streams import SessionError

_END = object()


class SessionFeed:
    """The responses of `responses` (an async iterator of GenerateResponse) as a task feeding a queue."""

    def __init__(self, responses: AsyncIterator, deadline: Optional[float] = None) -> None:
        self.deadline = deadline  # time.monotonic() value: SessionError DEADLINE_EXCEEDED past it
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.create_task(self._run(responses))

    async def _run(self, responses: AsyncIterator) -> None:
        try:
            async with contextlib.aclosing(responses) as items:
                async for item in items:
                    self.queue.put_nowait(item)
            self.queue.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which maps it to an HTTP status
            self.queue.put_nowait(exc)

    async def next(self):
        """The next GenerateResponse, or None at the end; raises what the generation raised."""
        timeout = None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)
        try:
            item = await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            await self.close()
            raise SessionError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               "the generation's deadline (its 'timeout') passed before it finished") from None
        if item is _END:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    async def close(self) -> None:
        """Cancel the generation if it still runs, and wait until its session is closed."""
        if not self.task.done():
            self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.task

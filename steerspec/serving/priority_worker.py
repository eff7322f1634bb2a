"""One compute thread that owns a model, with two priorities: urgent work (real requests) runs before background
work (drafting ahead) that is still queued, so background work delays a real request by at most the one job that
is running when it arrives.

The drafter service runs every pass of its CPU model here (drafter_service/server.py): real drafting, and the
steps of drafting ahead, each step a job of its own. The model and every session's cache are used by this thread
only, one job at a time; torch releases the GIL inside its ops, so the event loop keeps reading streams and
firing timers while a pass computes (on a CPU the services otherwise compute on the loop's thread:
steerspec/serving/compute.py). Jobs run under `torch.inference_mode` with the thread's torch thread count set to
the process's (torch keeps it per OpenMP thread).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from concurrent.futures import Future
from typing import Any, Callable, List, Optional, Tuple

import torch

URGENT, BACKGROUND = 0, 1


class PriorityWorker:
    """A single compute thread taking jobs by priority (URGENT before BACKGROUND), first come first served within
    one; `submit` returns a concurrent.futures.Future, so `asyncio.wrap_future` awaits it (and cancelling that
    cancels a job that has not started)."""

    def __init__(self, name: str = "compute") -> None:
        self._heap: List[Tuple[int, int, Future, Callable, tuple]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._threads = torch.get_num_threads()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, priority: int = URGENT) -> Future:
        """Queue `fn(*args)` at `priority`; its Future (RuntimeError once shut down)."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the compute worker has shut down")
            heapq.heappush(self._heap, (int(priority), next(self._order), future, fn, args))
            self._cond.notify()
        return future

    @property
    def closed(self) -> bool:
        """Whether it has shut down (it takes no more jobs)."""
        return self._closed

    def waiting(self, priority: int = URGENT) -> int:
        """Jobs queued (not running) at `priority`."""
        with self._cond:
            return sum(1 for item in self._heap if item[0] == priority)

    def _next(self) -> Optional[Tuple[Future, Callable, tuple]]:
        with self._cond:
            while not self._heap and not self._closed:
                self._cond.wait()
            if not self._heap:
                return None
            _, _, future, fn, args = heapq.heappop(self._heap)
            return future, fn, args

    def _run(self) -> None:
        torch.set_num_threads(self._threads)  # this thread's OpenMP team, as the process was configured
        with torch.inference_mode():
            while True:
                item = self._next()
                if item is None:
                    return
                future, fn, args = item
                if not future.set_running_or_notify_cancel():  # cancelled while queued
                    continue
                try:
                    result = fn(*args)
                except BaseException as exc:  # the caller's error, raised where it awaits the future
                    future.set_exception(exc)
                else:
                    future.set_result(result)
                del future, fn, args, item

    def shutdown(self, wait: bool = False, cancel_futures: bool = True) -> None:
        """Stop taking jobs; queued ones are cancelled (`cancel_futures`) or still run; `wait` joins the thread."""
        with self._cond:
            self._closed = True
            if cancel_futures:
                for _, _, future, _, _ in self._heap:
                    future.cancel()
                self._heap.clear()
            self._cond.notify_all()
        if wait:
            self.thread.join()

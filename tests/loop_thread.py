"""An asyncio event loop in a background thread: servers run there while a test drives them with blocking
clients (the official openai client, the sync SDK) from its own thread."""

from __future__ import annotations

import asyncio
import threading


class LoopThread:
    """`run(coro)` runs a coroutine on the background loop and returns its result (bounded by `timeout`)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-servers", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.loop.is_running():
            self.loop.close()

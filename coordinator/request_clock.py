"""One request's timing as the OpenTelemetry GenAI server metrics see it: time to first token, time per output
token after the first, and the request's duration (with its error type when it failed)."""

from __future__ import annotations

import time
from typing import Optional


class RequestClock:
    """When one request's tokens came: its GenAI server metrics (TTFT, TPOT, duration) at its end."""

    def __init__(self, operation: str, model: str) -> None:
        self.operation, self.model = operation, model
        self.started = time.perf_counter()
        self.first: Optional[float] = None
        self.last = self.started
        self.count = 0
        self.error = ""  # the status code's name when the request failed

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        self.last = time.perf_counter()
        if self.first is None:
            self.first = self.last
        self.count += n

    def observe(self, metrics) -> None:
        ttft = None if self.first is None else self.first - self.started
        tpot = (self.last - self.first) / (self.count - 1) if self.first is not None and self.count > 1 else None
        metrics.observe_request(self.operation, self.model, ttft, tpot, time.perf_counter() - self.started,
                                self.error.lower())

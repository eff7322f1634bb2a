"""Per-identity session quotas: at most N generations of one identity run at once on a coordinator.

    quota = SessionQuota(limit=4)          # 0 = no limit
    with quota.hold(identity):             # SessionError RESOURCE_EXHAUSTED when that identity is at N
        ... run the session ...

The identity is the call's (`steerspec.serving.security.identity_of`: its token, else its client
certificate, else "" for every unauthenticated caller together). Counted in this process: each
coordinator of a deployment enforces its own limit.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import grpc

from coordinator import counters
from coordinator.streams import SessionError


class SessionQuota:
    """Concurrent sessions per identity, bounded by `limit` (0: unbounded)."""

    def __init__(self, limit: int = 0) -> None:
        if limit < 0:
            raise ValueError(f"the per-identity session limit must be >= 0, got {limit}")
        self.limit = int(limit)
        self.running: Counter = Counter()

    @contextlib.contextmanager
    def hold(self, identity: str) -> Iterator[None]:
        """Count one running session of `identity` for the block (RESOURCE_EXHAUSTED when at the limit)."""
        if self.limit and self.running[identity] >= self.limit:
            counters.count("steerspec_quota_refusals")
            who = identity or "unauthenticated callers"
            raise SessionError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{who} already run {self.running[identity]} sessions on this coordinator "
                               f"(--max-sessions-per-identity {self.limit}): wait for one to end, then retry")
        self.running[identity] += 1
        try:
            yield
        finally:
            self.running[identity] -= 1
            if self.running[identity] <= 0:
                del self.running[identity]

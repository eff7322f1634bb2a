"""Session ownership and exclusive use: a session_id belongs to the identity that created it, and
only one call at a time may run it.

    async with ownership.claim(session_id, identity):   # PERMISSION_DENIED / ABORTED
        ... run or resume the session ...

The owner is recorded on first use (Redis `SET NX`, shared by coordinators on one Redis; else in
this process) and kept as long as the session's checkpoint (`SESSION_TTL_S`). The live lease is a
key with a short TTL renewed while the call runs, so a coordinator that dies frees it within
`lease_ttl_s`; a second concurrent call gets ABORTED and never interleaves checkpoint writes (the
SDK retries ABORTED with backoff, so a client's own resume after a restart gets through).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import AsyncIterator, Dict, Optional, Set, Tuple

import grpc

from steerspec.serving.store import SESSION_TTL_S, RedisStore, Store

DEFAULT_LEASE_TTL_S = 10.0


class ClaimError(Exception):
    """A call may not run this session: `code` is PERMISSION_DENIED or ABORTED."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _describe(identity: str) -> str:
    return identity or "an unauthenticated caller"


class Ownership:
    """Owners and live leases of sessions, in Redis when the store is a RedisStore, else in this process."""

    def __init__(self, store: Store, lease_ttl_s: float = DEFAULT_LEASE_TTL_S) -> None:
        self.store = store
        self.lease_ttl_s = float(lease_ttl_s)
        self._owners: Dict[str, str] = {}
        self._live: Dict[str, str] = {}
        self._held: Dict[str, Tuple[str, Optional[asyncio.Task]]] = {}  # session -> (token, renewer) of our calls
        self._releasing: Set[asyncio.Future] = set()

    @property
    def _redis(self):
        return self.store._redis if isinstance(self.store, RedisStore) else None

    def _key(self, kind: str, session_id: str) -> str:
        return f"{self.store.prefix}{kind}:{session_id}"

    async def _set_owner(self, session_id: str, identity: str) -> str:
        """Record `identity` as the owner unless one is recorded; the owner."""
        redis = self._redis
        if redis is None:
            return self._owners.setdefault(session_id, identity)
        key = self._key("owner", session_id)
        if await redis.set(key, identity, nx=True, ex=SESSION_TTL_S):
            return identity
        owner = await redis.get(key)
        return identity if owner is None else owner

    async def _acquire(self, session_id: str, token: str) -> bool:
        redis = self._redis
        if redis is None:
            return self._live.setdefault(session_id, token) == token
        return bool(await redis.set(self._key("live", session_id), token, nx=True,
                                    px=max(1, int(self.lease_ttl_s * 1000))))

    async def _renew(self, session_id: str) -> None:
        while True:
            await asyncio.sleep(self.lease_ttl_s / 3)
            with contextlib.suppress(Exception):  # Redis away: the lease lapses, the session goes on
                await self._redis.pexpire(self._key("live", session_id), max(1, int(self.lease_ttl_s * 1000)))

    async def _release(self, session_id: str, token: str) -> None:
        redis = self._redis
        if redis is None:
            if self._live.get(session_id) == token:
                del self._live[session_id]
            return
        key = self._key("live", session_id)
        with contextlib.suppress(Exception):
            if await redis.get(key) == token:
                await redis.delete(key)

    @contextlib.asynccontextmanager
    async def claim(self, session_id: str, identity: str) -> AsyncIterator[None]:
        """Hold `session_id` for one call by `identity` (see module docstring)."""
        token = uuid.uuid4().hex
        if not await self._acquire(session_id, token):
            raise ClaimError(grpc.StatusCode.ABORTED,
                               f"session {session_id} is running in another call: wait for it to end (then "
                               "resume with the same session_id) or use a new session_id")
        renewer: Optional[asyncio.Task] = None
        try:
            owner = await self._set_owner(session_id, identity)
            if owner != identity:
                raise ClaimError(grpc.StatusCode.PERMISSION_DENIED,
                                   f"session {session_id} belongs to another identity than "
                                   f"{_describe(identity)}: use your own session_id")
            if self._redis is not None:
                renewer = asyncio.create_task(self._renew(session_id))
            self._held[session_id] = (token, renewer)
            yield
        finally:
            if renewer is not None:
                renewer.cancel()
            self._held.pop(session_id, None)
            # its own task, shielded: a call cancelled by a stopping server still frees its lease (`close`
            # waits for it), so a restarted coordinator resumes the session at once, not after lease_ttl_s
            release = asyncio.ensure_future(self._release(session_id, token))
            self._releasing.add(release)
            release.add_done_callback(self._releasing.discard)
            await asyncio.shield(release)

    async def close(self, wait_s: float = 2.0) -> None:
        """Free the leases of this process's calls (releases under way, and calls a stopping server
        dropped without unwinding), so another coordinator can resume them at once, not after `lease_ttl_s`."""
        if self._releasing:
            await asyncio.wait(list(self._releasing), timeout=wait_s)
        held, self._held = self._held, {}
        for session_id, (token, renewer) in held.items():
            if renewer is not None:
                renewer.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._release(session_id, token), wait_s)

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
import functools
import uuid
from typing import AsyncIterator, Callable, Dict, Optional

import grpc

from steerspec.store import SESSION_TTL_S, RedisStore, Store

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

    def _call_done(self, session_id: str, token: str, renewer: Optional[asyncio.Task], *_) -> None:
        """The call ended: stop renewing and free the lease (idempotent with claim's own release)."""
        if renewer is not None:
            renewer.cancel()
        with contextlib.suppress(RuntimeError):  # no running loop: the lease lapses on its own
            asyncio.get_running_loop().create_task(self._release(session_id, token))

    @contextlib.asynccontextmanager
    async def claim(self, session_id: str, identity: str,
                    on_call_done: Optional[Callable[[Callable[..., None]], None]] = None) -> AsyncIterator[None]:
        """Hold `session_id` for one call by `identity` (see module docstring). `on_call_done` (e.g. a
        gRPC context's add_done_callback) frees the lease when the call ends even if the handler, an
        async generator parked at a `yield`, is never closed (a server stopped with grace 0)."""
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
            if on_call_done is not None:
                on_call_done(functools.partial(self._call_done, session_id, token, renewer))
            yield
        finally:
            if renewer is not None:
                renewer.cancel()
            # shielded: a server stopping with grace=0 cancels the handler again while it releases,
            # which would leave the lease to lapse (lease_ttl_s) and ABORT the client's resume meanwhile
            await asyncio.shield(self._release(session_id, token))

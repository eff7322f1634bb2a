"""State store: a registry of service endpoints with TTL heartbeats, and per-session checkpoints.

One interface (`Store`), two implementations:
- `InProcessStore()`: dictionaries in this process (the embedded default when --redis-url is unset);
- `RedisStore(url)`: redis-py asyncio, shareable by several coordinators.

Registry: `register(kind, address, ttl_s, meta)` makes an endpoint live for `ttl_s`;
`heartbeat(...)` extends it (False when it had already expired: register again); `live(kind)` lists
the endpoints not yet expired; `expire(kind, address)` drops one at once (a replica seen to fail).

Sessions: `create_session(id, params, placement)`, `set_placement`, `append_tokens(id, ids)`,
`finish_session(id, reason)`, `get_session(id)`. `append_tokens` is synchronous and returns at
once: the write goes out from a background task (one per session, coalescing whatever was appended
while the previous write was in flight), so checkpointing adds no round trip to the critical path.
`flush(id)` waits for those writes (the coordinator calls it when a session ends).

A checkpoint write that still fails after its retries (Redis down) leaves the session without
checkpoints from then on (`checkpoint_lost(id)`): later tokens are not written (a gap would replay
wrong tokens on a resume) and `finish_session` does not mark it done, so the stored prefix stays
valid and a resume continues from it. The generation itself goes on.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

from steerspec.errors import UsageError

log = logging.getLogger(__name__)

SESSION_TTL_S = 24 * 3600
WRITE_ATTEMPTS = 4  # a checkpoint write is retried over ~0.7 s (a Redis restart, a stale connection)
# HSET only on a session hash that exists (after a Redis restart a partial hash would break resumes)
_HSET_IF_EXISTS = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.call('HSET', KEYS[1], unpack(ARGV))
end
return -1
"""
# RPUSH at a known offset: a retried write whose first try landed is a no-op, an out-of-order one an error
_APPEND_AT = """
local n = redis.call('LLEN', KEYS[1])
local base = tonumber(ARGV[1])
local count = #ARGV - 2
if base < 0 or n == base then
  redis.call('RPUSH', KEYS[1], unpack(ARGV, 3))
elseif n ~= base + count then
  return redis.error_reply('checkpoint of ' .. KEYS[1] .. ' holds ' .. n .. ' tokens, expected ' .. base)
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return n
"""


@dataclass
class Endpoint:
    kind: str  # "verifier" | "drafter" | "coordinator"
    address: str  # host:port
    meta: Dict[str, object] = field(default_factory=dict)


@dataclass
class SessionRecord:
    session_id: str
    params: Dict[str, object]
    placement: Dict[str, str]
    token_ids: List[int]  # generated (committed) tokens, prompt excluded
    status: str = "running"  # running | done | failed
    finish_reason: str = ""


class Store(abc.ABC):
    """Registry + session checkpoints (see module docstring)."""

    def __init__(self) -> None:
        self._pending: Dict[str, List[int]] = {}
        self._writers: Dict[str, asyncio.Task] = {}
        self._lost: Set[str] = set()  # sessions whose checkpoint stopped (see module docstring)
        self._offsets: Dict[str, int] = {}  # tokens checkpointed per session (idempotent writes)
        self.write_errors = 0

    # -- registry ---------------------------------------------------------------------------
    @abc.abstractmethod
    async def register(self, kind: str, address: str, ttl_s: float, meta: Optional[dict] = None) -> None: ...

    @abc.abstractmethod
    async def heartbeat(self, kind: str, address: str, ttl_s: float, meta: Optional[dict] = None) -> bool: ...

    @abc.abstractmethod
    async def expire(self, kind: str, address: str) -> None: ...

    @abc.abstractmethod
    async def live(self, kind: str) -> List[Endpoint]: ...

    # -- sessions ---------------------------------------------------------------------------
    @abc.abstractmethod
    async def create_session(self, session_id: str, params: dict, placement: dict) -> None: ...

    @abc.abstractmethod
    async def set_placement(self, session_id: str, placement: dict) -> None: ...

    @abc.abstractmethod
    async def get_session(self, session_id: str) -> Optional[SessionRecord]: ...

    @abc.abstractmethod
    async def _finish(self, session_id: str, status: str, reason: str) -> None: ...

    @abc.abstractmethod
    async def _write_tokens(self, session_id: str, token_ids: List[int]) -> None: ...

    def checkpoint_lost(self, session_id: str) -> bool:
        """True when the session goes on without checkpoints (a write failed for good)."""
        return session_id in self._lost

    def mark_lost(self, session_id: str) -> None:
        """Stop checkpointing this session (its stored prefix stays as it is)."""
        self._lost.add(session_id)
        self._pending.pop(session_id, None)

    def append_tokens(self, session_id: str, token_ids: List[int]) -> None:
        """Checkpoint committed tokens without waiting (needs a running event loop)."""
        if not token_ids or session_id in self._lost:
            return
        self._pending.setdefault(session_id, []).extend(int(t) for t in token_ids)
        writer = self._writers.get(session_id)
        if writer is None or writer.done():
            self._writers[session_id] = asyncio.get_running_loop().create_task(self._drain(session_id))

    async def _drain(self, session_id: str) -> None:
        while self._pending.get(session_id):
            batch = self._pending.pop(session_id)
            for attempt in range(WRITE_ATTEMPTS):  # writes are idempotent (RedisStore): a retry never repeats
                try:
                    await self._write_tokens(session_id, batch)
                    break
                except Exception as exc:  # a checkpoint failure must not end the generation
                    if attempt + 1 < WRITE_ATTEMPTS:
                        await asyncio.sleep(0.1 * 2 ** attempt)
                        continue
                    self.write_errors += 1
                    self.mark_lost(session_id)
                    log.warning("checkpoint write for session %s failed (the session goes on without "
                                "checkpoints): %s", session_id, exc)
        if self._writers.get(session_id) is asyncio.current_task():  # done: nothing left for flush to wait on
            del self._writers[session_id]

    async def flush(self, session_id: Optional[str] = None) -> None:
        """Wait until the checkpoint writes of one session (or all) are done."""
        ids = [session_id] if session_id is not None else list(self._writers)
        for sid in ids:
            writer = self._writers.get(sid)
            if writer is not None:
                await asyncio.shield(writer)
            if self._writers.get(sid) is writer:
                self._writers.pop(sid, None)

    async def finish_session(self, session_id: str, status: str = "done", reason: str = "") -> bool:
        """Record how the session ended; False (nothing written) when it went on without checkpoints."""
        await self.flush(session_id)
        if session_id in self._lost:
            self._lost.discard(session_id)
            self._offsets.pop(session_id, None)
            return False
        await self._finish(session_id, status, reason)
        return True

    async def close(self) -> None:
        await self.flush()


class InProcessStore(Store):
    """The embedded default: everything in this process's memory. Session records expire
    SESSION_TTL_S after their last write, as they do in Redis, so a long-lived coordinator stays bounded."""

    def __init__(self, clock=time.monotonic) -> None:
        super().__init__()
        self._clock = clock
        self._endpoints: Dict[tuple, tuple] = {}  # (kind, address) -> (expires_at, meta)
        self._sessions: Dict[str, SessionRecord] = {}
        self._session_expiry: Dict[str, float] = {}
        self._next_prune = 0.0

    def _prune(self, now: float) -> None:
        """Drop expired session records (at most once a minute)."""
        if now >= self._next_prune:
            for sid in [sid for sid, exp in self._session_expiry.items() if exp <= now]:
                self._sessions.pop(sid, None)
                del self._session_expiry[sid]
            self._next_prune = now + 60.0

    def _record(self, session_id: str, write: bool = True) -> Optional[SessionRecord]:
        """The live record (a write pushes its expiry back, as in Redis), or None."""
        now = self._clock()
        self._prune(now)
        rec = self._sessions.get(session_id)
        if rec is not None:
            if self._session_expiry[session_id] <= now:
                del self._sessions[session_id], self._session_expiry[session_id]
                return None
            if write:
                self._session_expiry[session_id] = now + SESSION_TTL_S
        return rec

    async def register(self, kind, address, ttl_s, meta=None):
        self._endpoints[(kind, address)] = (self._clock() + ttl_s, dict(meta or {}))

    async def heartbeat(self, kind, address, ttl_s, meta=None):
        entry = self._endpoints.get((kind, address))
        if entry is None or entry[0] <= self._clock():
            self._endpoints.pop((kind, address), None)
            return False
        self._endpoints[(kind, address)] = (self._clock() + ttl_s, dict(meta) if meta is not None else entry[1])
        return True

    async def expire(self, kind, address):
        self._endpoints.pop((kind, address), None)

    async def live(self, kind):
        now = self._clock()
        for key in [k for k, (exp, _) in self._endpoints.items() if exp <= now]:
            del self._endpoints[key]
        return sorted((Endpoint(k, a, dict(m)) for (k, a), (_, m) in self._endpoints.items() if k == kind),
                      key=lambda e: e.address)

    async def create_session(self, session_id, params, placement):
        now = self._clock()
        self._prune(now)
        self._sessions[session_id] = SessionRecord(session_id, dict(params), dict(placement), [])
        self._session_expiry[session_id] = now + SESSION_TTL_S

    async def set_placement(self, session_id, placement):
        rec = self._record(session_id)
        if rec is not None:
            rec.placement = dict(placement)

    async def get_session(self, session_id):
        rec = self._record(session_id, write=False)
        if rec is None:
            return None
        return SessionRecord(rec.session_id, dict(rec.params), dict(rec.placement), list(rec.token_ids),
                             rec.status, rec.finish_reason)

    async def _write_tokens(self, session_id, token_ids):
        rec = self._record(session_id)
        if rec is not None:
            rec.token_ids.extend(token_ids)

    async def _finish(self, session_id, status, reason):
        rec = self._record(session_id)
        if rec is not None:
            rec.status, rec.finish_reason = status, reason


class RedisStore(Store):
    """Redis-backed store (redis-py asyncio). Keys live under `prefix` (default `steerspec:`).

    - endpoint `{p}svc:{kind}:{address}` -> JSON meta, with a PX expiry (the heartbeat TTL);
      the set `{p}svc:{kind}` indexes addresses (stale members are pruned by `live`);
    - session hash `{p}session:{id}` (params, placement, status, finish_reason) and list
      `{p}session:{id}:tokens` (RPUSHed committed tokens), both expiring after a day.
    """

    def __init__(self, url: str, prefix: str = "steerspec:") -> None:
        super().__init__()
        # lazy: redis only for a redis:// store
        import redis.asyncio as aioredis

        self.url = url
        self.prefix = prefix
        # lazy: redis only for a redis:// store
        from redis.backoff import ExponentialBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError
        from redis.retry import Retry

        # a connection broken by a Redis restart is retried on a fresh one (not handed to the next
        # session); while Redis is down a command fails within ~2 s (the coordinator answers UNAVAILABLE)
        self._redis = aioredis.from_url(url, decode_responses=True, socket_connect_timeout=1.0, socket_timeout=5.0,
                                        health_check_interval=5,
                                        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 2),
                                        retry_on_error=[RedisConnectionError, RedisTimeoutError])

    def _svc(self, kind: str, address: Optional[str] = None) -> str:
        return f"{self.prefix}svc:{kind}" + (f":{address}" if address is not None else "")

    def _sess(self, session_id: str) -> str:
        return f"{self.prefix}session:{session_id}"

    async def ping(self) -> bool:
        return bool(await self._redis.ping())

    async def register(self, kind, address, ttl_s, meta=None):
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._svc(kind, address), json.dumps(meta or {}), px=max(1, int(ttl_s * 1000)))
            pipe.sadd(self._svc(kind), address)
            await pipe.execute()

    async def heartbeat(self, kind, address, ttl_s, meta=None):
        key = self._svc(kind, address)
        ttl = max(1, int(ttl_s * 1000))
        if meta is None:
            return bool(await self._redis.pexpire(key, ttl))
        return bool(await self._redis.set(key, json.dumps(meta), px=ttl, xx=True))

    async def expire(self, kind, address):
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._svc(kind, address))
            pipe.srem(self._svc(kind), address)
            await pipe.execute()

    async def live(self, kind):
        addresses = sorted(await self._redis.smembers(self._svc(kind)))
        if not addresses:
            return []
        metas = await self._redis.mget([self._svc(kind, a) for a in addresses])
        dead = [a for a, m in zip(addresses, metas) if m is None]
        if dead:
            await self._redis.srem(self._svc(kind), *dead)
        return [Endpoint(kind, a, json.loads(m)) for a, m in zip(addresses, metas) if m is not None]

    async def create_session(self, session_id, params, placement):
        self._lost.discard(session_id)
        key = self._sess(session_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(key, key + ":tokens")
            pipe.hset(key, mapping={"params": json.dumps(params), "placement": json.dumps(placement),
                                    "status": "running", "finish_reason": ""})
            pipe.expire(key, SESSION_TTL_S)
            await pipe.execute()
        self._offsets[session_id] = 0

    async def set_placement(self, session_id, placement):
        await self._redis.eval(_HSET_IF_EXISTS, 1, self._sess(session_id), "placement", json.dumps(placement))

    async def get_session(self, session_id):
        key = self._sess(session_id)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(key)
            pipe.lrange(key + ":tokens", 0, -1)
            fields, tokens = await pipe.execute()
        if not fields:
            return None
        self._offsets[session_id] = len(tokens)
        return SessionRecord(session_id, json.loads(fields.get("params", "{}")),
                             json.loads(fields.get("placement", "{}")), [int(t) for t in tokens],
                             fields.get("status", "running"), fields.get("finish_reason", ""))

    async def _write_tokens(self, session_id, token_ids):
        key = self._sess(session_id) + ":tokens"
        base = self._offsets.get(session_id, -1)  # -1: unknown here, plain append
        await self._redis.eval(_APPEND_AT, 1, key, base, SESSION_TTL_S, *token_ids)
        if base >= 0:
            self._offsets[session_id] = base + len(token_ids)

    async def _finish(self, session_id, status, reason):
        self._offsets.pop(session_id, None)
        await self._redis.eval(_HSET_IF_EXISTS, 1, self._sess(session_id), "status", status, "finish_reason", reason)

    async def close(self):
        await super().close()
        await self._redis.aclose()


async def connect_redis(url: str, prefix: str = "steerspec:", timeout_s: float = 5.0) -> RedisStore:
    """A `RedisStore` that answered PING; UsageError (one line) when the URL is bad or Redis does not answer."""
    try:
        store = RedisStore(url, prefix=prefix)
    except ValueError as exc:
        raise UsageError(f"bad --redis-url '{url}': {exc}") from None
    try:
        await asyncio.wait_for(store.ping(), timeout_s)
    except Exception as exc:  # refused, unresolvable, auth, or no answer in time
        await store.close()
        reason = (str(exc).splitlines() or [""])[0] or f"no answer within {timeout_s:g}s"
        raise UsageError(f"cannot reach Redis at {url}: {reason} (start redis-server there or fix --redis-url)") \
            from None
    return store


async def open_store(redis_url: Optional[str]) -> Store:
    """`connect_redis(url)` (answered PING) when a URL is given, else the embedded `InProcessStore`."""
    return await connect_redis(redis_url) if redis_url else InProcessStore()


async def keep_registered(store: Store, kind: str, address: str, ttl_s: float = 5.0,
                          probe=None, meta_fn=None) -> None:
    """Heartbeat forever every ttl_s/3 (cancel the task to stop).

    `probe` (async () -> bool) is checked first: a replica that fails it is not renewed and
    expires after `ttl_s`. `meta_fn` (async () -> dict) refreshes the endpoint's metadata (load).
    """
    while True:
        try:
            alive = True if probe is None else await probe()
            if alive:
                meta = None if meta_fn is None else await meta_fn()
                if not await store.heartbeat(kind, address, ttl_s, meta):
                    await store.register(kind, address, ttl_s, meta)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("heartbeat for %s %s failed: %s", kind, address, exc)
        await asyncio.sleep(ttl_s / 3.0)

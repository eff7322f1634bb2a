"""Replica self-registration: a verifier or drafter announces itself in the Redis endpoint registry.

    check_args(args)                       # in run(): flag values, before anything loads
    await check_reachable(args.redis_url)  # before the model loads: an unreachable Redis is a UsageError
    running, servicer = await serve(...)
    await announce(running, "verifier", load=lambda: len(servicer.table), redis_url=args.redis_url,
                   identity=servicer.identity, ...)

`announce` registers the advertised address with a TTL and renews it every ttl/3 with the replica's
`active_sessions` (coordinator placement reads it), so a coordinator started with only
`--redis-url` finds the replica and a replica that dies expires after its TTL. It hooks
`running.stop` so that the entry is dropped *before* the graceful stop (coordinators place no new
session here while in-flight ones finish) and the Redis connection is closed after it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import socket
from typing import TYPE_CHECKING, Callable, Optional

from steerspec.errors import UsageError
from steerspec.serving.identity import ModelIdentity
from steerspec.serving.store import Store, connect_redis, keep_registered
from steerspec.serving.targets import parse_targets

if TYPE_CHECKING:
    from steerspec.serving.grpc_common import RunningServer

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 5.0
WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The registration flags shared by `steerspec serve verifier` and `steerspec serve drafter`."""
    parser.add_argument("--redis-url", default=None,
                        help="register this replica in the coordinators' Redis endpoint registry "
                             "(default: no registration; give it to the coordinator with --verifier/--drafter)")
    parser.add_argument("--advertise", default=None, metavar="HOST:PORT",
                        help="address coordinators dial (default: the bound host:port; the hostname when "
                             "bound to 0.0.0.0 or ::)")
    parser.add_argument("--heartbeat-ttl-s", type=float, default=DEFAULT_TTL_S,
                        help="registry TTL, renewed every ttl/3: a replica that dies expires after it")


def check_args(args: argparse.Namespace) -> None:
    """UsageError for a bad --heartbeat-ttl-s or --advertise (checked before any model loads)."""
    ttl = args.heartbeat_ttl_s
    if not (ttl > 0 and math.isfinite(ttl)):
        raise UsageError(f"--heartbeat-ttl-s must be a positive number of seconds, got {ttl}")
    if args.advertise is not None:
        if not args.redis_url:
            raise UsageError("--advertise needs --redis-url (the registry the address is advertised in)")
        if len(parse_targets(args.advertise, "--advertise")) != 1:
            raise UsageError(f"--advertise expects one HOST:PORT, got '{args.advertise}'")


async def check_reachable(redis_url: Optional[str]) -> None:
    """PING Redis once (no-op without a URL): an unreachable registry fails fast, not after the model loads."""
    if redis_url:
        store = await connect_redis(redis_url)
        await store.close()


def advertised_address(host: str, port: int, advertise: Optional[str] = None) -> str:
    """`advertise`, else host:port with a wildcard bind host replaced by this machine's hostname."""
    if advertise:
        return advertise
    if host in WILDCARD_HOSTS:
        host = socket.gethostname()
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"{host}:{port}"


class Registration:
    """One replica's registry entry: registered, renewed with its load, withdrawn on shutdown."""

    def __init__(self, store: Store, kind: str, address: str, ttl_s: float = DEFAULT_TTL_S,
                 load: Callable[[], int] = lambda: 0, identity: Optional[ModelIdentity] = None) -> None:
        self.store = store
        self.identity = identity  # what the replica serves: coordinators place sessions only where it pairs
        self.kind = kind
        self.address = address
        self.ttl_s = ttl_s
        self.load = load
        self.task: Optional[asyncio.Task] = None  # the heartbeat

    async def _meta(self) -> dict:
        meta: dict = {"active_sessions": int(self.load())}
        if self.identity is not None:
            meta["identity"] = self.identity.to_dict()
        return meta

    async def start(self) -> None:
        """Register now and heartbeat every ttl/3 from a background task."""
        await self.store.register(self.kind, self.address, self.ttl_s, await self._meta())
        self.task = asyncio.get_running_loop().create_task(
            keep_registered(self.store, self.kind, self.address, self.ttl_s, meta_fn=self._meta))

    async def withdraw(self) -> None:
        """Stop heartbeating and drop the entry at once, so coordinators place no new session here."""
        task, self.task = self.task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        try:
            await asyncio.wait_for(self.store.expire(self.kind, self.address), self.ttl_s)
        except Exception as exc:  # Redis gone: the entry still expires after its TTL
            log.warning("could not leave the registry (%s); %s %s expires in %gs", exc, self.kind, self.address,
                        self.ttl_s)

    async def close(self) -> None:
        """Withdraw (if still registered) and close the store."""
        await self.withdraw()
        await self.store.close()

    def attach(self, running: RunningServer) -> None:
        """Withdraw first when `running` stops (before its graceful stop); close the store after it."""
        running.on_drain.append(self.withdraw)
        running.on_stop.append(self.close)


async def announce(running: RunningServer, kind: str, *, load: Callable[[], int], redis_url: Optional[str],
                   advertise: Optional[str] = None, ttl_s: float = DEFAULT_TTL_S,
                   prefix: str = "steerspec:", identity: Optional[ModelIdentity] = None) -> Optional[Registration]:
    """Register `running` as a `kind` replica in Redis and hook its stop; None (nothing done) without a URL."""
    if not redis_url:
        return None
    store = await connect_redis(redis_url, prefix=prefix)
    registration = Registration(store, kind, advertised_address(running.host, running.port, advertise), ttl_s, load,
                                identity)
    try:
        await registration.start()
    except BaseException:
        await registration.close()
        raise
    registration.attach(running)
    return registration

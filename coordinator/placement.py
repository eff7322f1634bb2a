"""Placement: pick a drafter and a verifier replica for a session from the registry.

Least loaded first: load is the larger of the number of sessions this coordinator has on the
replica and the `active_sessions` the replica last reported in its registry metadata (when it
reports it: that count includes ours, so adding would count them twice); ties go
round robin, so equal replicas share sessions evenly. Replicas that are not live in the registry,
and those the caller excludes (seen failing), are skipped. A kind can be pinned to preferred
addresses: a coordinator given its edge-local drafters drafts on those while one is live, even
when a shared registry also lists other edges' drafters (the only remote hop stays the
verifier's), and falls back to any other live one when none of its own is left. A session places only on
replicas whose model pairs with its own (`fits`, from the identity each replica registers).

While the registry (Redis) fails, placement goes on from the replicas it listed last (less those
seen failing since), so running sessions can still fail over; a log line says so.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from typing import Callable, Collection, Dict, Iterable, List, Optional

from redis.exceptions import RedisError

from steerspec.serving.identity import ModelIdentity
from steerspec.serving.store import Endpoint, Store

log = logging.getLogger(__name__)


def registered_identity(endpoint: Endpoint,
                        known: Optional[Dict[str, ModelIdentity]] = None) -> Optional[ModelIdentity]:
    """What a replica serves: its registry entry's identity, else what it answered to GetStats (`known`)."""
    meta = endpoint.meta if isinstance(endpoint.meta, dict) else {}
    return ModelIdentity.from_dict(meta.get("identity")) or (known or {}).get(endpoint.address)


class NoReplica(RuntimeError):
    """No live replica of the requested kind (the coordinator answers UNAVAILABLE)."""


class Placer:
    def __init__(self, store: Store, pinned: Optional[Dict[str, Collection[str]]] = None) -> None:
        self.store = store
        self.pinned = {kind: frozenset(addresses) for kind, addresses in (pinned or {}).items() if addresses}
        self.in_use: Counter = Counter()  # (kind, address) -> sessions placed by this coordinator
        self._turns: Dict[str, itertools.count] = {}  # per kind: a shared count made one kind's ties always
        # land on the same replica when sessions alternate kinds (verifier, drafter, verifier, ...)
        self._known: Dict[str, List[Endpoint]] = {}  # kind -> what the registry listed last

    async def live(self, kind: str) -> List[Endpoint]:
        """The registry's live replicas of `kind`; while it fails, those it listed last."""
        try:
            live = await self.store.live(kind)
        except RedisError as exc:
            known = self._known.get(kind, [])
            log.warning("the registry failed (%s): placing on the %d %s replicas it listed last",
                        (str(exc).splitlines() or [""])[0], len(known), kind)
            return list(known)
        self._known[kind] = list(live)
        return live

    async def choose(self, kind: str, exclude: Iterable[str] = (),
                     fits: Optional[Callable[[Endpoint], bool]] = None) -> Optional[str]:
        """The least loaded live replica of `kind` not in `exclude` (and, given `fits`, serving a model that
        pairs with the session's), or None."""
        skip = set(exclude)
        live = [e for e in await self.live(kind) if e.address not in skip and (fits is None or fits(e))]
        preferred = [e for e in live if e.address in self.pinned.get(kind, ())]
        live = preferred or live
        if not live:
            return None

        def load(endpoint) -> int:
            # a self-registered replica reports every session it holds, ours included, as of its last
            # heartbeat; our own count is current: the larger counts nothing twice
            reported = endpoint.meta.get("active_sessions", 0) if isinstance(endpoint.meta, dict) else 0
            return max(self.in_use[(kind, endpoint.address)], int(reported or 0))

        least = min(load(e) for e in live)
        tied = [e.address for e in live if load(e) == least]
        turn = self._turns.setdefault(kind, itertools.count())
        return tied[next(turn) % len(tied)]

    async def require(self, kind: str, exclude: Iterable[str] = ()) -> str:
        address = await self.choose(kind, exclude)
        if address is None:
            raise NoReplica(f"no live {kind} replica (registered replicas failed or expired); "
                            f"start one with `steerspec serve {kind} --port ...`")
        return address

    def acquire(self, kind: str, address: str) -> None:
        self.in_use[(kind, address)] += 1

    def release(self, kind: str, address: str) -> None:
        key = (kind, address)
        self.in_use[key] -= 1
        if self.in_use[key] <= 0:
            del self.in_use[key]

    async def mark_failed(self, kind: str, address: str) -> None:
        """A replica that failed mid-session: drop it from the registry until it heartbeats again."""
        self._known[kind] = [e for e in self._known.get(kind, []) if e.address != address]
        try:
            await self.store.expire(kind, address)
        except RedisError as exc:
            log.warning("could not drop %s %s from the registry: %s", kind, address, (str(exc).splitlines() or [""])[0])

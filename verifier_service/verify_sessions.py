"""Verifier sessions: one per Verify stream, each with its own KV cache (a CachedLM) and limits.

A session's committed sequence has `committed` tokens; the last one (`pending`) is not in the
cache, so the cache always holds `committed - 1` tokens between blocks (the protocol in steerspec/decoding/engine.py).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import grpc
import torch

from steerspec.decoding import fastpath
from steerspec.decoding.sampling import SamplingParams
from steerspec.models.backends import cached_lm
from steerspec.models.kv import CachedLM, FastCachedLM
from steerspec.models.loading import kv_bytes_per_token
from steerspec.serving.batching import free_cache
from steerspec.blocks.block_kind import BlockKind
from steerspec.blocks.block_mode import EXACT_CHAIN, BlockMode
from steerspec.blocks.kinds import kind_of
from steerspec.serving.wire import ProtocolError

KV_BACKENDS = ("auto", "fast", "hf")


def check_backend(backend: str) -> str:
    """`backend` if it names a session cache (`--kv-backend`), else ValueError naming the choices."""
    if backend not in KV_BACKENDS:
        raise ValueError(f"unknown KV backend {backend!r}: use one of {', '.join(KV_BACKENDS)}")
    return backend


def session_lm(model, backend: str = "auto", lean: bool = False) -> CachedLM:
    """A session's verifier cache (`--kv-backend`). auto: graphed/fast when the device path serves
    this model, the lean FastCachedLM on the host path (a CPU; `VerifyRunner.run` packs its
    batches), the transformers cache for architectures the fast forward does not cover. fast: a
    FastCachedLM on either path. hf: the transformers cache (its padded batched pass). A session whose
    block kind needs the lean cache (`lean`: draft trees) gets a FastCachedLM on any device: the graphed static pool
    takes no tree."""
    if check_backend(backend) == "hf" or not FastCachedLM.supports(model):
        return CachedLM(model)
    if lean:
        return FastCachedLM(model)
    return cached_lm(model) if backend == "auto" and fastpath.enabled(model.device) else FastCachedLM(model)


@dataclass
class VerifierSession:
    """State of one session on this replica."""

    session_id: str
    lm: CachedLM
    committed: int
    pending: int
    params: SamplingParams
    generator: torch.Generator
    max_k: int
    steering: bool
    mode: BlockMode = EXACT_CHAIN  # the session's kind and verification rule, parsed from its VerifyOpen
    last_seq: Optional[int] = None
    blocks: int = 0
    ready: bool = False
    closed: bool = False
    in_compute: int = 0  # compute-thread calls using the cache now (steerspec.serving.batching.free_cache)
    last_active: float = field(default_factory=time.monotonic)

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def kind(self) -> BlockKind:
        """The session's block kind (steerspec/blocks/): how its blocks are admitted, verified and answered."""
        return kind_of(self.mode)

    @property
    def acceptance(self) -> str:
        """At T > 0: "token" (speculative sampling) or "block" (block_verify.py; trees: traversal.py)."""
        return self.mode.acceptance

    def touch(self) -> None:
        self.last_active = time.monotonic()


class SessionTable:
    """Open sessions with the replica's limits (sessions, KV-cache memory)."""

    def __init__(self, model, max_sessions: int, max_cache_bytes: int, kv_backend: str = "auto") -> None:
        self.model = model
        self.kv_backend = check_backend(kv_backend)  # refused at start, not at the first session
        self.max_sessions = int(max_sessions)
        self.max_cache_bytes = int(max_cache_bytes)
        self.bytes_per_token = kv_bytes_per_token(model)
        self.sessions: Dict[str, VerifierSession] = {}
        self.reserved: Dict[str, int] = {}  # session id -> tokens of cache accounted for
        self.blocks_total = 0

    def __len__(self) -> int:
        return len(self.sessions)

    @property
    def ready_count(self) -> int:
        return sum(1 for s in self.sessions.values() if s.ready and not s.closed)

    def cache_bytes(self) -> int:
        return sum(s.lm.length for s in self.sessions.values()) * self.bytes_per_token

    def reserved_bytes(self) -> int:
        return sum(self.reserved.values()) * self.bytes_per_token

    def check_room(self, session_id: Optional[str], tokens: int) -> None:
        """RESOURCE_EXHAUSTED if growing `session_id`'s cache to `tokens` passes --max-cache-mb."""
        if self.max_cache_bytes <= 0:
            return
        current = self.reserved.get(session_id, 0) if session_id else 0
        need = self.reserved_bytes() + (tokens - current) * self.bytes_per_token
        if need > self.max_cache_bytes:
            raise ProtocolError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"KV-cache memory limit reached: {need / 2**20:.2f} MiB needed of --max-cache-mb "
                f"{self.max_cache_bytes / 2**20:.2f}; retry later, use another replica, or raise --max-cache-mb",
            )

    def open(self, session_id: str, prompt_len: int, max_k: int, **fields) -> VerifierSession:
        """Register a session (limits checked); its cache is filled by the caller's prefill."""
        if not session_id:
            session_id = uuid.uuid4().hex
        if session_id in self.sessions:
            raise ProtocolError(grpc.StatusCode.ALREADY_EXISTS,
                                f"session {session_id!r} is already open on this replica; close its stream first "
                                "or use a new session id")
        if len(self.sessions) >= self.max_sessions:
            raise ProtocolError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this verifier already serves --max-sessions {self.max_sessions} sessions; retry "
                                "later or use another replica")
        self.check_room(None, prompt_len + max_k)
        lm = session_lm(self.model, self.kv_backend, lean=kind_of(fields.get("mode", EXACT_CHAIN)).lean_cache)
        session = VerifierSession(session_id=session_id, lm=lm, committed=prompt_len, max_k=max_k, **fields)
        self.sessions[session_id] = session
        self.reserved[session_id] = prompt_len + max_k
        return session

    def reserve(self, session: VerifierSession, tokens: int) -> None:
        """Account for a cache of up to `tokens` tokens (checked against the memory limit)."""
        if tokens > self.reserved.get(session.session_id, 0):
            self.check_room(session.session_id, tokens)
            self.reserved[session.session_id] = tokens

    def close(self, session: VerifierSession) -> None:
        """Free the session's cache (stream end, cancel, deadline, idle expiry): now, or when the batch
        using it ends."""
        session.closed = True
        session.ready = False
        if self.sessions.get(session.session_id) is session:
            del self.sessions[session.session_id]
            self.reserved.pop(session.session_id, None)
        free_cache(session)

    def active(self) -> List[VerifierSession]:
        return list(self.sessions.values())

"""Drafter sessions: the committed sequence, a KV cache (CachedLM), a draft-length policy, steering.

Drafting is `steerspec.decoding.engine.draft_block` (the decoding protocol of steerspec/decoding/engine.py): feed
committed[cache_len:] (ends with the pending token) -> q_1, sample d_1, feed d_1 -> q_2, ... d_k.
Greedy takes argmaxes; sampling
draws from the wire distribution `draft_distribution(probs, draft_top_k)`, exactly
what the verifier decodes, so speculative sampling stays exact across the network.
Sessions that ask at the same time are drafted together (`Drafter.draft_many`): each block kind's sessions by
its own `BlockKind.draft` (steerspec/blocks/: a chain's one batched forward pass per draft step, a tree's per
depth), each session as if alone. The kinds use the drafter's machinery here: its SD² hooks, block length, rows.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import grpc
import torch
from torch import Tensor

from steerspec.blocks.block_kind import BlockKind, DraftOutput, Verdict
from steerspec.blocks.kinds import kind_of
from steerspec.decoding import rounds
from steerspec.decoding.drafting import DraftRow
from steerspec.decoding.engine import DecodeConfig
from steerspec.decoding.sampling import SamplingParams
from steerspec.errors import UsageError
from steerspec.models.backends import cached_lm
from steerspec.models.kv import CachedLM, FastCachedLM
from steerspec.models.loading import context_length, kv_bytes_per_token
from steerspec.policies import BlockFeedback, PolicyContext, PolicyError, make_policy
from steerspec.serving.batching import free_cache
from steerspec.blocks.block_mode import EXACT_CHAIN, BlockMode
from steerspec.serving.wire import ProtocolError, invalid
from steerspec.sprinter.classifier import resolve_head

__all__ = ["DraftOutput", "Drafter", "DrafterSession", "DrafterSessionTable", "Proposal"]


def resolve_policy(spec: str, k: int, model=None):
    """The draft-length policy a registry spec names (`name:key=value,...`); a bare or empty
    spec is `fixed` with the session's k. A bad spec is INVALID_ARGUMENT with the known names.
    `model` (the drafter) lets trained policies find their heads in its directory."""
    spec = (spec or "fixed").strip()
    if spec == "fixed":
        spec = f"fixed:k={k}"
    context = None
    if model is not None:
        context = PolicyContext(drafter_dir=getattr(model, "name_or_path", None) or None,
                                hidden_size=int(model.config.hidden_size))
    try:
        return make_policy(spec, context)
    except PolicyError as exc:
        raise invalid(str(exc)) from None


def policy_state(policy) -> str:
    """The policy's state as JSON for the wire ("" when it keeps none, so fixed policies cost no bytes)."""
    state = policy.state_dict()
    return json.dumps(state, separators=(",", ":")) if state else ""


def load_policy_state(policy, text: str) -> None:
    """Restore a policy's state sent by the coordinator after a failover (INVALID_ARGUMENT if unusable)."""
    try:
        state = json.loads(text)
        if not isinstance(state, dict):
            raise ValueError("not a JSON object")
        policy.load_state_dict(state)
    except (ValueError, TypeError, KeyError) as exc:
        raise invalid(f"DraftOpen.policy_state is not a state of policy {getattr(policy, 'name', '?')}: {exc}") from None


@dataclass
class Proposal:
    """The block drafted last and not yet answered by feedback."""

    seq: int
    committed_length: int
    draft_ids: List[int]
    draft_ms: float = 0.0
    sent_at: float = field(default_factory=time.perf_counter)  # feedback - sent_at: verify + queue + network
    fed: Optional[List[int]] = None  # a tree's: the nodes in the drafter's cache after the committed tokens, in order
    shape: Optional[object] = None  # a tree's: the block's shape (decoding.trees.TreeShape), not always a prefix


@dataclass
class DrafterSession:
    session_id: str
    lm: CachedLM
    committed: List[int]
    open_length: int
    params: SamplingParams
    generator: torch.Generator
    k: int
    draft_top_k: int
    policy: object
    max_new_tokens: int  # 0 = no limit
    steering: Optional[Tensor] = None
    policy_spec: str = ""  # the registry spec the policy was built from (key of the warm-start state)
    kind_state: Optional[object] = None  # what the session's kind keeps while drafting (SPRINTER's classifier)
    mode: BlockMode = EXACT_CHAIN  # the session's kind, verification rule and policy, parsed from its DraftOpen
    seed: int = 0  # the stream's seed: each block's generator is reseeded from it and the committed length
    ahead: Optional[bool] = None  # drafting ahead (drafter_service/ahead.py): None = the drafter's default
    ahead_outcomes: Optional[int] = None  # verdicts prepared per block (None = the drafter's default)
    ahead_budget_ms: Optional[float] = None  # drafter time preparing per block (None = default; 0 = no limit)
    seq: int = 0
    proposal: Optional[Proposal] = None
    closed: bool = False
    in_compute: int = 0  # compute-thread calls using the cache now (steerspec.serving.batching.free_cache)
    last_active: float = field(default_factory=time.monotonic)

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def kind(self) -> BlockKind:
        """The session's block kind (steerspec/blocks/): how its blocks are drafted and its results committed."""
        return kind_of(self.mode)

    def touch(self) -> None:
        self.last_active = time.monotonic()

    @property
    def generated(self) -> int:
        return len(self.committed) - self.open_length

    def budget(self) -> Optional[int]:
        """Tokens still allowed (None = no limit)."""
        return None if self.max_new_tokens <= 0 else self.max_new_tokens - self.generated


class Drafter:
    """The compute side: drafts blocks for sessions over one model (called on one thread). The block kinds
    (steerspec/blocks/) draft with its machinery: `block_length`, `steer` / `unsteer`, `steer_first_feed`,
    `chain_row`, `output`, `sync` and `sprinter_head`."""

    def __init__(self, model, hooks=None, sprinter_head: Optional[str] = None, model_name: str = "") -> None:
        self.model = model
        self.hooks = hooks  # steerspec.steering.SteeringHooks when the drafter has SD² weights
        self.vocab_size = int(model.config.vocab_size)
        self.context = context_length(model)
        self.sprinter_head_dir = sprinter_head  # SPRINTER head directory (default: the drafter's own)
        self.model_name = model_name
        self._head = None  # the SPRINTER head, loaded by the first lossy session

    @property
    def steer_dim(self) -> Optional[int]:
        return None if self.hooks is None else int(self.hooks.steering.steer_dim)

    def block_length(self, session: DrafterSession) -> int:
        """k for the next block: the policy's choice, capped by the session's k, budget and context."""
        k = min(int(session.policy.next_k()), session.k, self.context - len(session.committed))
        budget = session.budget()  # the verifier adds one token (recovered or bonus) itself
        return max(k, 0) if budget is None else rounds.block_k(k, budget)

    def steer(self, session: DrafterSession) -> None:
        """Put the session's vector on the hooks for its next forward call (or clear them); no-op without SD²."""
        if self.hooks is None:
            return
        if session.steering is not None:
            # first block: the drafter feeds the whole prompt; prompt[:-1] stays unsteered (as in training)
            self.hooks.set_vector(session.steering.to(self.model.device).unsqueeze(0),
                                  steer_prefix=session.lm.length > 0)
        else:
            self.hooks.clear()

    def unsteer(self) -> None:
        """Clear the hooks after a steered call."""
        if self.hooks is not None:
            self.hooks.clear()

    def output(self, block, start: float, batch_size: int = 1) -> DraftOutput:
        """A drafted batch-1 DraftBlock as the service sends it, timed from `start`."""
        q = None if block.q is None else block.q.map(lambda t: t[0])
        return DraftOutput(draft_ids=block.tokens[0].tolist(), q=q, draft_ms=(time.perf_counter() - start) * 1e3,
                           batch_size=batch_size)

    def sync(self) -> None:
        """Wait for the device (CUDA) so a block's draft time is its own."""
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    def sprinter_head(self):
        """The SPRINTER head of this drafter (loaded once); FAILED_PRECONDITION naming the drafter without one."""
        if self._head is None:
            drafter_dir = getattr(self.model, "name_or_path", "") or self.model_name
            try:
                self._head = resolve_head(drafter_dir, self.sprinter_head_dir, device=self.model.device)
            except UsageError as exc:
                raise ProtocolError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        return self._head

    @torch.inference_mode()
    def draft(self, session: DrafterSession) -> DraftOutput:
        """Propose one session's next block alone (its kind's draft, steered when SD² is on)."""
        return session.kind.draft(self, [session])[0]

    @torch.inference_mode()
    def draft_many(self, sessions: Sequence[DrafterSession]) -> List[DraftOutput]:
        """Propose every session's next block together: each kind's sessions in one `BlockKind.draft` call
        (batched passes where the kind batches), each session getting what `draft` gives it alone."""
        groups: Dict[str, List[int]] = {}
        for i, session in enumerate(sessions):
            groups.setdefault(session.kind.name, []).append(i)
        outs: List[Optional[DraftOutput]] = [None] * len(sessions)
        for indices in groups.values():
            kind = sessions[indices[0]].kind
            for i, out in zip(indices, kind.draft(self, [sessions[i] for i in indices])):
                outs[i] = out
        return outs

    def steer_first_feed(self, session: DrafterSession, row) -> None:
        """A steered session in a batch: a feed longer than one token runs here alone through the hooks
        (as `draft` runs it; the first block keeps the prompt's prefix unsteered), later passes carry the
        session's bias as the cache's up_bias. No-op for an unsteered session or a drafter without SD²."""
        if self.hooks is None or session.steering is None:
            return
        lm = session.lm
        if len(session.committed) - lm.length != 1:
            self.steer(session)
            try:
                row.first_logits = lm.extend(session.committed[lm.length:], logits_to_keep=1).logits
            finally:
                self.hooks.clear()
        lm.set_up_bias(self.hooks.up_biases(session.steering.to(self.model.device)))

    @torch.inference_mode()
    def rescore(self, session: DrafterSession, ids: Sequence[int], positions: Optional[Tensor] = None,
                visible: Optional[Tensor] = None) -> Optional[Tensor]:
        """The drafter's logits [len(ids), V] over the pending token and the block in flight (a tree's with
        `positions` and `visible`, `FastCachedLM.extend_tree`), its cache put back as the block left it; None
        for a cache that cannot be put back (not the lean one). Steered sessions pass with their vector."""
        lm = session.lm
        n = session.proposal.committed_length if session.proposal is not None else len(session.committed)
        if not isinstance(lm, FastCachedLM) or lm.length < n:
            return None
        saved = lm.save(n - 1)
        try:
            lm.rollback(n - 1)
            if self.hooks is not None and session.steering is not None:
                lm.set_up_bias(self.hooks.up_biases(session.steering.to(self.model.device)))
            if positions is None:
                return lm.extend(list(ids)).logits
            return lm.extend_tree(list(ids), positions, visible).logits
        finally:
            lm.set_up_bias(None)
            lm.load(saved)

    def chain_row(self, session: DrafterSession) -> DraftRow:
        """The session's DraftRow for a batched chain draft. Steered: a feed longer than one token runs here
        alone through the hooks (as `draft` runs it), later steps carry the session's bias as the cache's up_bias."""
        k = self.block_length(session)
        config = DecodeConfig(sampling=session.params, draft_top_k=session.draft_top_k)
        row = DraftRow(session.lm, session.committed, k, config, session.generator, session.policy)
        if self.hooks is None or session.steering is None:
            return row
        lm = session.lm
        lm.keep_last_hidden = bool(getattr(session.policy, "stops_early", False)
                                   and getattr(session.policy, "needs_hidden", False))
        if k > 0:
            self.steer_first_feed(session, row)
        else:
            lm.set_up_bias(self.hooks.up_biases(session.steering.to(self.model.device)))
        return row

    def apply_feedback(self, session: DrafterSession, accepted: int, next_token: int,
                       steering: Optional[Tensor], timing: Optional[BlockFeedback] = None,
                       path: Sequence[int] = ()) -> None:
        """Commit the block's accepted drafts (a chain's d_1..d_a, a tree's `path`) and the next token, keeping
        what the cache holds of them (`BlockKind.feedback`); take the next block's steering vector."""
        proposal = session.proposal
        if timing is None and proposal.draft_ids:  # no coordinator timings: the time the block was away
            away_ms = (time.perf_counter() - proposal.sent_at) * 1e3
            timing = BlockFeedback(accepted, len(proposal.draft_ids), draft_ms=proposal.draft_ms, network_ms=away_ms)
        session.kind.feedback(self, session, Verdict(int(accepted), int(next_token), steering, list(path), timing))
        if steering is not None:
            session.steering = steering
        session.proposal = None


class DrafterSessionTable:
    def __init__(self, model, max_sessions: int) -> None:
        self.model = model
        self.max_sessions = int(max_sessions)
        self.sessions: Dict[str, DrafterSession] = {}
        self.blocks_total = 0
        self.bytes_per_token = kv_bytes_per_token(model)

    def __len__(self) -> int:
        return len(self.sessions)

    def cache_bytes(self) -> int:
        return sum(s.lm.length for s in self.sessions.values()) * self.bytes_per_token

    def open(self, session_id: str, **fields) -> DrafterSession:
        session_id = session_id or uuid.uuid4().hex
        if session_id in self.sessions:
            raise ProtocolError(grpc.StatusCode.ALREADY_EXISTS,
                                f"session {session_id!r} is already open on this drafter; close its stream first")
        if len(self.sessions) >= self.max_sessions:
            raise ProtocolError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this drafter already serves --max-sessions {self.max_sessions} sessions; retry "
                                "later or use another replica")
        # some kinds need the lean cache on any device (the graphed static pool takes no tree)
        lean = kind_of(fields.get("mode", EXACT_CHAIN)).lean_cache
        lm = FastCachedLM(self.model) if lean else cached_lm(self.model)
        session = DrafterSession(session_id=session_id, lm=lm, **fields)
        self.sessions[session_id] = session
        return session

    def close(self, session: DrafterSession) -> None:
        """Free the session's cache: now, or when the batch using it ends."""
        session.closed = True
        if self.sessions.get(session.session_id) is session:
            del self.sessions[session.session_id]
        free_cache(session)

"""Drafter sessions: the committed sequence, a KV cache (CachedLM), a draft-length policy, steering.

Drafting is `steerspec.decoding.engine.draft_block` (the decoding protocol of steerspec/decoding/engine.py): feed
committed[cache_len:] (ends with the pending token) -> q_1, sample d_1, feed d_1 -> q_2, ... d_k.
Greedy takes argmaxes; sampling
draws from the wire distribution `draft_distribution(probs, draft_top_k)`, exactly
what the verifier decodes, so speculative sampling stays exact across the network.
Sessions that ask at the same time are drafted together (`Drafter.draft_many`,
steerspec/decoding/drafting.py; draft trees by `tree_decoding.draft_trees`): one batched forward pass per draft
step (per tree depth), each session as if alone.
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

from steerspec.decoding import rounds
from steerspec.decoding.drafting import DraftRow, draft_blocks
from steerspec.decoding.engine import DecodeConfig, draft_block
from steerspec.decoding.sampling import SamplingParams, SparseDist
from steerspec.decoding.tree_decoding import TreeRow, cached_path, draft_tree, draft_trees
from steerspec.decoding.trees import TreeShape, cut_to_depth, prefix, q_parents
from steerspec.models.backends import cached_lm
from steerspec.models.batched import can_batch
from steerspec.models.kv import CachedLM, FastCachedLM
from steerspec.models.loading import context_length, kv_bytes_per_token
from steerspec.policies import BlockFeedback, PolicyContext, PolicyError, make_policy
from steerspec.serving.batching import free_cache
from steerspec.serving.block_mode import EXACT_CHAIN, BlockMode
from steerspec.serving.wire import ProtocolError, invalid
from steerspec.sprinter.decoding import draft_run


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


@dataclass
class DraftOutput:
    draft_ids: List[int]
    q: Optional[SparseDist]  # ids/probs [k, S] and floor [k], exactly as the wire decodes them
    draft_ms: float
    batch_size: int = 1  # sessions drafted in the same batched passes
    kept: int = 0  # SPRINTER: leading drafts committed without verification (DraftBlock.kept)
    head_kept: int = 0  # SPRINTER: drafts the classifier kept, the run's last one included (DraftBlock.head_kept)
    fed: Optional[List[int]] = None  # a tree's nodes in the drafter's cache, in order (Proposal.fed)


@dataclass
class SprinterRun:
    """A lossy SPRINTER session's classifier: runs end at its first predicted rejection."""

    scorer: object  # steerspec.sprinter.decoding.SprinterScorer over the session's cache
    threshold: float
    lam: float = 1.0  # the λ the head was trained with: the verifier labels the run's tokens with it


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
    sprinter: Optional[SprinterRun] = None  # lossy SPRINTER session (None: exact)
    mode: BlockMode = EXACT_CHAIN  # the session's kind, verification rule and policy, parsed from its DraftOpen
    seq: int = 0
    proposal: Optional[Proposal] = None
    closed: bool = False
    in_compute: int = 0  # compute-thread calls using the cache now (steerspec.serving.batching.free_cache)
    last_active: float = field(default_factory=time.monotonic)

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def tree(self) -> Optional[TreeShape]:
        """A draft-tree session's tree (blocks carry its nodes breadth-first); None: chains."""
        return self.mode.tree

    def touch(self) -> None:
        self.last_active = time.monotonic()

    @property
    def generated(self) -> int:
        return len(self.committed) - self.open_length

    def budget(self) -> Optional[int]:
        """Tokens still allowed (None = no limit)."""
        return None if self.max_new_tokens <= 0 else self.max_new_tokens - self.generated


class Drafter:
    """The compute side: drafts blocks for sessions over one model (called on one thread)."""

    def __init__(self, model, hooks=None) -> None:
        self.model = model
        self.hooks = hooks  # steerspec.steering.SteeringHooks when the drafter has SD² weights
        self.vocab_size = int(model.config.vocab_size)

        self.context = context_length(model)

    @property
    def steer_dim(self) -> Optional[int]:
        return None if self.hooks is None else int(self.hooks.steering.steer_dim)

    def block_length(self, session: DrafterSession) -> int:
        """k for the next block: the policy's choice, capped by the session's k, budget and context."""
        k = min(int(session.policy.next_k()), session.k, self.context - len(session.committed))
        budget = session.budget()  # the verifier adds one token (recovered or bonus) itself
        return max(k, 0) if budget is None else rounds.block_k(k, budget)

    def _steer(self, session: DrafterSession) -> None:
        """Put the session's vector on the hooks for its next forward call (or clear them)."""
        if session.steering is not None:
            # first block: the drafter feeds the whole prompt; prompt[:-1] stays unsteered (as in training)
            self.hooks.set_vector(session.steering.to(self.model.device).unsqueeze(0),
                                  steer_prefix=session.lm.length > 0)
        else:
            self.hooks.clear()

    def _output(self, block, start: float, batch_size: int = 1) -> DraftOutput:
        q = None if block.q is None else block.q.map(lambda t: t[0])
        return DraftOutput(draft_ids=block.tokens[0].tolist(), q=q, draft_ms=(time.perf_counter() - start) * 1e3,
                           batch_size=batch_size)

    @torch.inference_mode()
    def draft(self, session: DrafterSession) -> DraftOutput:
        """Propose the session's next block with the engine's `draft_block` (steered when SD² is on)."""
        start = time.perf_counter()
        k = self.block_length(session)
        if self.hooks is not None:
            self._steer(session)
        kept = head_kept = 0
        try:
            config = DecodeConfig(sampling=session.params, draft_top_k=session.draft_top_k)
            if session.tree is not None:
                out = self._draft_tree(session, k, config)
                out.draft_ms = (time.perf_counter() - start) * 1e3
                return out
            if session.sprinter is not None:  # a run: token by token until the head predicts a rejection
                block, flags = draft_run(session.lm, session.committed, k, config, session.generator,
                                         session.sprinter.scorer, session.sprinter.threshold)
                kept = max(len(flags) - 1, 0)  # the run's last token is always checked by the verifier
                head_kept = sum(flags)  # ... but the head kept it too when the run ended at max_run or the budget
            else:
                block = draft_block(session.lm, session.committed, k, config, session.generator, session.policy)
        finally:
            if self.hooks is not None:
                self.hooks.clear()
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        out = self._output(block, start)
        out.kept, out.head_kept = kept, head_kept
        return out

    def _tree_shape(self, session: DrafterSession, depth: int) -> TreeShape:
        """The session's tree down to `depth` (the budget's cap) and within the context."""
        return prefix(cut_to_depth(session.tree, depth), self.context - len(session.committed))

    def _draft_tree(self, session: DrafterSession, depth: int, config: DecodeConfig) -> DraftOutput:
        """The session's tree, drafted by `tree_decoding.draft_tree`."""
        shape = self._tree_shape(session, depth)
        out = self._tree_output(shape, draft_tree(session.lm, session.committed, shape, config, session.generator))
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        return out

    @staticmethod
    def _tree_output(shape: TreeShape, drafted, batch_size: int = 1) -> DraftOutput:
        """A drafted tree as a block: its nodes breadth-first and one q row per parent, the distribution its
        children were drawn from (what the verifier tests; `trees.q_parents` order)."""
        tokens, fed, q_at = drafted
        q = None
        if q_at and shape.size:
            rows = [q_at[parent] for parent in q_parents(shape)]
            q = SparseDist(ids=torch.cat([r.ids for r in rows]), probs=torch.cat([r.probs for r in rows]),
                           floor=None if rows[0].floor is None else torch.cat([r.floor for r in rows]),
                           vocab=rows[0].vocab)
        return DraftOutput(draft_ids=tokens, q=q, draft_ms=0.0, fed=fed, batch_size=batch_size)

    def _draft_trees(self, sessions: Sequence[DrafterSession]) -> List[DraftOutput]:
        """Every tree session's next block together (`tree_decoding.draft_trees`: one packed pass per
        depth); each gets what `draft` gives it alone. Steered as `_row` steers a chain."""
        start = time.perf_counter()
        rows, shapes = [], []
        try:
            for session in sessions:
                shape = self._tree_shape(session, self.block_length(session))
                config = DecodeConfig(sampling=session.params, draft_top_k=session.draft_top_k)
                row = TreeRow(session.lm, session.committed, shape, config, session.generator)
                if self.hooks is not None and session.steering is not None:
                    self._steer_first_feed(session, row)
                rows.append(row)
                shapes.append(shape)
            drafted = draft_trees(rows)
        finally:
            for session in sessions:
                session.lm.set_up_bias(None)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        outs = [self._tree_output(shape, d, len(sessions)) for shape, d in zip(shapes, drafted)]
        for out in outs:
            out.draft_ms = (time.perf_counter() - start) * 1e3
        return outs

    def _steer_first_feed(self, session: DrafterSession, row) -> None:
        """A steered session in a batch: a feed longer than one token runs here alone through the hooks
        (as `draft` runs it; the first block keeps the prompt's prefix unsteered), later passes carry the
        session's bias as the cache's up_bias."""
        lm = session.lm
        if len(session.committed) - lm.length != 1:
            self._steer(session)
            try:
                row.first_logits = lm.extend(session.committed[lm.length:], logits_to_keep=1).logits
            finally:
                self.hooks.clear()
        lm.set_up_bias(self.hooks.up_biases(session.steering.to(self.model.device)))

    @torch.inference_mode()
    def draft_many(self, sessions: Sequence[DrafterSession]) -> List[DraftOutput]:
        """Propose every session's next block together: one batched forward pass per draft step
        (steerspec.decoding.drafting.draft_blocks); each session gets what `draft` gives it alone."""
        if len(sessions) == 1 or any(s.sprinter is not None for s in sessions) or \
                not can_batch([s.lm for s in sessions]):
            return [self.draft(session) for session in sessions]
        trees = [s for s in sessions if s.tree is not None]
        if trees and len(trees) < len(sessions):  # trees and chains: each kind batched on its own
            chains = [s for s in sessions if s.tree is None]
            got = dict(zip(map(id, trees), self.draft_many(trees)))
            got.update(zip(map(id, chains), self.draft_many(chains)))
            return [got[id(s)] for s in sessions]
        if trees:
            return self._draft_trees(sessions)
        start = time.perf_counter()
        try:
            blocks = draft_blocks([self._row(session) for session in sessions])
        finally:
            for session in sessions:
                session.lm.set_up_bias(None)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        return [self._output(block, start, len(sessions)) for block in blocks]

    def _row(self, session: DrafterSession) -> DraftRow:
        """The session's DraftRow. Steered: a feed longer than one token runs here alone through the
        hooks (as `draft` runs it), later steps carry the session's bias as the cache's up_bias."""
        k = self.block_length(session)
        config = DecodeConfig(sampling=session.params, draft_top_k=session.draft_top_k)
        row = DraftRow(session.lm, session.committed, k, config, session.generator, session.policy)
        if self.hooks is None or session.steering is None:
            return row
        lm = session.lm
        lm.keep_last_hidden = bool(getattr(session.policy, "stops_early", False)
                                   and getattr(session.policy, "needs_hidden", False))
        if k > 0:
            self._steer_first_feed(session, row)
        else:
            lm.set_up_bias(self.hooks.up_biases(session.steering.to(self.model.device)))
        return row

    def apply_feedback(self, session: DrafterSession, accepted: int, next_token: int,
                       steering: Optional[Tensor], timing: Optional[BlockFeedback] = None,
                       path: Sequence[int] = ()) -> None:
        """Commit d_1..d_a and the next token; roll the cache back to min(len, n + a). A tree session
        commits the accepted `path`'s nodes and keeps those its cache holds."""
        proposal = session.proposal
        n = proposal.committed_length
        if proposal.fed is not None:
            self._keep_path(session, list(path), int(next_token), steering)
            return
        session.committed.extend(proposal.draft_ids[:accepted])
        session.committed.append(int(next_token))
        if session.lm.length > n + accepted:
            session.lm.rollback(n + accepted)
        if proposal.draft_ids:
            if timing is None:  # no coordinator timings: the time the block was away, not split further
                away_ms = (time.perf_counter() - proposal.sent_at) * 1e3
                timing = BlockFeedback(accepted, len(proposal.draft_ids), draft_ms=proposal.draft_ms,
                                       network_ms=away_ms)
            session.policy.update(timing)
        if steering is not None:
            session.steering = steering
        session.proposal = None

    def _keep_path(self, session: DrafterSession, path: List[int], next_token: int, steering: Optional[Tensor]) -> None:
        """A tree block's feedback: commit the path's tokens and the next one; the cache keeps the path."""
        proposal = session.proposal
        n = proposal.committed_length
        session.committed.extend(proposal.draft_ids[node] for node in path)
        session.committed.append(next_token)
        session.lm.keep(n, cached_path(path, proposal.fed, n))
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
        # a draft tree needs the lean cache on any device (the graphed static pool takes no tree)
        lm = FastCachedLM(self.model) if fields.get("mode", EXACT_CHAIN).tree is not None else cached_lm(self.model)
        session = DrafterSession(session_id=session_id, lm=lm, **fields)
        self.sessions[session_id] = session
        return session

    def close(self, session: DrafterSession) -> None:
        """Free the session's cache: now, or when the batch using it ends."""
        session.closed = True
        if self.sessions.get(session.session_id) is session:
            del self.sessions[session.session_id]
        free_cache(session)

"""A draft tree: the session's static tree (`decoding.trees`), its nodes breadth-first on the wire, verified by the
in-process `tree_decoding` steps, so a seeded session draws what `tree_generate` draws in one process.

Drafting: `tree_decoding.draft_tree` alone, `draft_trees` for a batch (one packed pass per depth). A block carries
one q row per parent (`trees.q_parents`: siblings are drawn from one distribution). Verification: every tree of the
batch scored in one packed pass (each row with its own positions and ancestor mask), then each session's own walk
(greedy; recursive rejection sampling over siblings drawn without replacement; traversal verification for block-
verified sessions); the caches keep the accepted path. Near the budget a tree is cut to a breadth-first prefix.

A policy with `next_shape` (the load-aware one) may draft another shape than a breadth-first prefix of the session's
tree (its chain-first cuts, of at most the tree's nodes): the block then carries it as DraftBlock.parents, and
the coordinator, the verifier and the drafter's feedback all read the block's shape from there (`block_shape`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

import grpc
import torch

from steerspec.blocks.block_kind import BlockKind, DraftOutput, JobResult, Verdict, cut_rows, refuse_kept, \
    register_kind
from steerspec.decoding import rounds
from steerspec.decoding.engine import DecodeConfig
from steerspec.decoding.outcomes import Outcome, log_probs, tree_outcomes
from steerspec.decoding.sampling import SparseDist
from steerspec.decoding.tree_decoding import TreeRow, cached_path, draft_tree, draft_tree_steps, draft_trees, \
    finish_tree, policy_tree, tree_feed, tree_generate
from steerspec.decoding.trees import TreeShape, cut_to_depth, from_parents, node_q_rows, prefix, q_parents
from steerspec.models.batched import can_batch, packed_extend
from steerspec.models.kv import FastCachedLM
from steerspec.serving import wire
from steerspec.serving.wire import ProtocolError, WireBlock, invalid
from steerspec.v1 import common_pb2


@dataclass(frozen=True)
class TreeBlock:
    """A tree block as checked once on arrival: the nodes it carries and the distribution each parent's children
    were drawn from (None when greedy), so the batch reuses them instead of redoing both."""

    shape: TreeShape
    q_at: Optional[Dict[int, SparseDist]]


@register_kind
class TreeKind(BlockKind):
    """The session's draft tree (`BlockMode.tree`), cut to a breadth-first prefix near the budget."""

    name = "tree"
    lean_cache = True  # positions and ancestor masks per row: the graphed static pool takes no tree

    # -- the coordinator's round -------------------------------------------------------------------------
    def room(self, mode, room: int) -> int:
        """The deepest level a block may keep when `room` tokens are left (a path commits its nodes + 1): room - 1.
        `cut` takes a depth, since a block's shape may be deeper than the session's tree (a chain)."""
        return room - 1

    def cut(self, mode, block: common_pb2.DraftBlock, keep: int) -> None:
        """Keep the block's nodes down to depth `keep` (a breadth-first prefix) and the q rows of their parents
        (which come first) or of each node."""
        shape = block_shape(mode.tree, len(block.draft_ids), int(block.seq), block.parents)
        kept = cut_to_depth(shape, max(keep, 0))
        nodes = rows = kept.size
        if nodes >= shape.size:
            return
        if block.HasField("q") and block.q.support:
            if len(block.q.ids) != len(block.draft_ids) * block.q.support:  # one row per parent
                rows = len(q_parents(kept))
        cut_rows(block, nodes, rows)
        if block.parents:
            del block.parents[nodes:]

    def accepted_drafts(self, mode, block: common_pb2.DraftBlock, result: common_pb2.VerifyResult) -> List[int]:
        """The nodes along the accepted path (checked against the block's tree)."""
        wire.check_path(block_shape(mode.tree, len(block.draft_ids), int(block.seq), block.parents),
                        list(result.path), int(result.accepted), int(block.seq))
        return [int(block.draft_ids[node]) for node in result.path]

    # -- the drafter service -----------------------------------------------------------------------------
    def open_drafter(self, drafter, session) -> None:
        if not FastCachedLM.supports(drafter.model):
            raise ProtocolError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this drafter's architecture ({type(drafter.model).__name__}) has no lean KV cache, "
                                "which a draft tree needs: open the session without a tree")

    def draft(self, drafter, sessions: Sequence) -> List[DraftOutput]:
        if len(sessions) == 1 or not can_batch([s.lm for s in sessions]):
            return [self.draft_one(drafter, session) for session in sessions]
        start = time.perf_counter()
        shapes = [self.shape(drafter, session) for session in sessions]
        try:
            rows = self.rows(drafter, sessions, shapes)
            drafted = draft_trees(rows)
        finally:
            for session in sessions:
                session.lm.set_up_bias(None)
        return self.outputs(drafter, shapes, drafted, start)

    @staticmethod
    def rows(drafter, sessions: Sequence, shapes: Sequence[TreeShape]) -> List[TreeRow]:
        """Each session's TreeRow for its shape, its first feed steered (`Drafter.steer_first_feed`)."""
        rows = []
        for session, shape in zip(sessions, shapes):
            row = TreeRow(session.lm, session.committed, shape,
                          DecodeConfig(sampling=session.params, draft_top_k=session.draft_top_k), session.generator)
            if shape.size:  # a block of no drafts feeds nothing (`draft_tree_steps`)
                drafter.steer_first_feed(session, row)
            rows.append(row)
        return rows

    @staticmethod
    def outputs(drafter, shapes: Sequence[TreeShape], drafted, start: float) -> List[DraftOutput]:
        """The batch's DraftOutputs, each timed from the batch's start."""
        drafter.sync()
        outs = [output(shape, d, len(shapes)) for shape, d in zip(shapes, drafted)]
        for out in outs:
            out.draft_ms = (time.perf_counter() - start) * 1e3
        return outs

    def draft_one(self, drafter, session) -> DraftOutput:
        """One session's tree alone (`tree_decoding.draft_tree`, steered through the drafter's hooks)."""
        start = time.perf_counter()
        shape = self.shape(drafter, session)
        drafter.steer(session)
        try:
            out = output(shape, draft_tree(session.lm, session.committed, shape,
                                           DecodeConfig(sampling=session.params, draft_top_k=session.draft_top_k),
                                           session.generator))
        finally:
            drafter.unsteer()
        drafter.sync()
        out.draft_ms = (time.perf_counter() - start) * 1e3
        return out

    def draft_steps(self, drafter, sessions):
        """The trees `draft` drafts, one packed forward pass per step (steered through each cache's up_bias, so no
        global hook stays set across a yield)."""
        if not can_batch([s.lm for s in sessions]):
            return self.draft(drafter, sessions)
        start = time.perf_counter()
        shapes = [self.shape(drafter, session) for session in sessions]
        try:
            rows = self.rows(drafter, sessions, shapes)
            drafted = yield from draft_tree_steps(rows)
        finally:
            for session in sessions:
                session.lm.set_up_bias(None)
        return self.outputs(drafter, shapes, drafted, start)

    @staticmethod
    def shape(drafter, session) -> TreeShape:
        """The block's tree (`tree_decoding.policy_tree`), down to the depth its budget allows, within the drafter's
        context."""
        chosen = policy_tree(session.policy, session.mode.tree)
        chosen = prefix(chosen, max(min(chosen.size, int(session.k)), 0))
        budget = session.budget()  # the verifier adds one token (recovered or bonus) after the path itself
        depth = chosen.depth if budget is None else rounds.block_k(chosen.depth, budget)
        return prefix(cut_to_depth(chosen, depth), drafter.context - len(session.committed))

    def encode_block(self, session, out: DraftOutput, block: common_pb2.DraftBlock) -> None:
        """A shape that is not the first nodes of the session's tree travels as its parents."""
        if out.shape is not None and out.shape != prefix(session.mode.tree, out.shape.size):
            block.parents.extend(out.shape.parents)

    def outcomes(self, drafter, session, limit: int) -> List[Outcome]:
        """The likeliest (path, next token) of the tree in flight, from one drafter pass over [pending, nodes...]
        with the tree's ancestor mask (`Drafter.rescore`)."""
        tokens = session.proposal.draft_ids
        shape = proposal_shape(session)
        n = session.proposal.committed_length
        feed, positions, visible = tree_feed(session.committed[-1], tokens, shape, n - 1)
        logits = drafter.rescore(session, feed, positions, visible)
        if logits is None:
            return []
        return tree_outcomes(log_probs(logits, session.params.temperature), tokens, shape, limit)

    def check_feedback(self, session, result: common_pb2.VerifyResult) -> None:
        proposal = session.proposal
        wire.check_path(proposal_shape(session), list(result.path), int(result.accepted), proposal.seq)

    def feedback(self, drafter, session, verdict: Verdict) -> None:
        """Commit the path's tokens and the next one; the cache keeps the path's nodes it holds."""
        proposal = session.proposal
        n = proposal.committed_length
        path = list(verdict.path)
        session.committed.extend(proposal.draft_ids[node] for node in path)
        session.committed.append(int(verdict.next_token))
        if session.lm.length >= n:  # a block of no drafts fed nothing: the next block feeds the tail
            session.lm.keep(n, cached_path(path, proposal.fed, n))
        if verdict.timing is not None and (proposal.draft_ids or getattr(session.policy, "min_k", 1) == 0):
            session.policy.update(replace(verdict.timing, path=tuple(path), shape=proposal_shape(session).paths))

    # -- the verifier service ----------------------------------------------------------------------------
    def max_block(self, mode, max_k: int) -> int:
        return max(max_k, mode.tree.size)

    def open_verifier(self, session) -> None:
        if not isinstance(session.lm, FastCachedLM):
            raise ProtocolError(grpc.StatusCode.FAILED_PRECONDITION,
                                "draft trees need the lean KV cache, which this replica's model or --kv-backend hf "
                                "does not give: start the verifier with --kv-backend auto or fast, or open the "
                                "session without a tree")

    def admit(self, session, msg: common_pb2.DraftBlock, vocab_size: int) -> Tuple[WireBlock, TreeBlock]:
        shape = block_shape(session.mode.tree, len(msg.draft_ids), msg.seq, msg.parents)
        block = wire.decode_block(msg, vocab_size, session.greedy, shape)
        checked = TreeBlock(shape, None if (block.q is None or session.greedy) else parents_q(shape, block.q))
        refuse_kept(block)
        return block, checked

    def branched(self, job) -> bool:
        shape = job.checked.shape  # a TreeBlock (`admit`): a path is verified on the chain's layout
        return shape.depth < shape.size

    @torch.inference_mode()
    def verify(self, runner, jobs: Sequence) -> List[JobResult]:
        """Every tree of the batch scored in ONE packed pass, then each session's own walk."""
        start = time.perf_counter()
        sessions = [job.session for job in jobs]
        trees = [job.checked for job in jobs]  # TreeBlocks, checked on arrival (`admit`)
        starts = [s.lm.length for s in sessions]
        fed = [tree_feed(s.pending, job.block.draft_ids.tolist(), tree.shape, at)
               for s, job, tree, at in zip(sessions, jobs, trees, starts)]
        want_hidden = runner.head is not None and any(s.steering for s in sessions)
        outs = packed_extend([s.lm for s in sessions], [f[0] for f in fed],
                             runner.head_layers() if want_hidden else None, [(f[1], f[2]) for f in fed])
        walked = [finish_tree(session.lm, at, tree.shape, job.block.draft_ids.tolist(), out,
                              DecodeConfig(sampling=session.params, acceptance=session.acceptance), tree.q_at,
                              session.generator)
                  for session, job, tree, at, out in zip(sessions, jobs, trees, starts, outs)]
        steering = [None] * len(jobs)
        if want_hidden:
            g = runner.steering_vectors(torch.stack([hidden for _, _, hidden in walked]))
            steering = [g[i] if s.steering else None for i, s in enumerate(sessions)]
        runner.sync()
        verify_ms = (time.perf_counter() - start) * 1e3
        results = []
        for i, (job, tree, (path, next_token, _)) in enumerate(zip(jobs, trees, walked)):
            leaf = not (tree.shape.children(path[-1]) if path else tree.shape.children(-1))
            results.append(JobResult(accepted=len(path), next_token=next_token, is_bonus=leaf, steering=steering[i],
                                     queue_ms=(start - job.submitted) * 1e3, verify_ms=verify_ms,
                                     batch_size=len(jobs), path=path))
        return results

    def encode_result(self, result: JobResult, out: common_pb2.VerifyResult) -> None:
        out.path.extend(result.path or [])

    # -- in process --------------------------------------------------------------------------------------
    def generate(self, verifier, drafter, prompt_ids, config, mode, *, policy=None, steering=None, tokenizer=None,
                 on_round=None, head=None):
        return tree_generate(verifier, drafter, prompt_ids, config, mode.tree, steering=steering,
                             tokenizer=tokenizer, on_round=on_round, policy=policy)


def output(shape: TreeShape, drafted, batch_size: int = 1) -> DraftOutput:
    """A drafted tree as a block: its nodes breadth-first and one q row per parent, the distribution its children
    were drawn from (what the verifier tests; `trees.q_parents` order)."""
    tokens, fed, q_at = drafted
    q = None
    if q_at and shape.size:
        rows = [q_at[parent] for parent in q_parents(shape)]
        q = SparseDist(ids=torch.cat([r.ids for r in rows]), probs=torch.cat([r.probs for r in rows]),
                       floor=None if rows[0].floor is None else torch.cat([r.floor for r in rows]),
                       vocab=rows[0].vocab)
    return DraftOutput(draft_ids=tokens, q=q, draft_ms=0.0, fed=fed, batch_size=batch_size, shape=shape)


def parents_q(shape: TreeShape, q: SparseDist) -> Dict[int, SparseDist]:
    """The distribution [1, S] each parent's children were drawn from, from the block's rows: one per parent
    (`trees.q_parents` order), or one per node (its parent's q; INVALID_ARGUMENT when siblings' rows differ)."""
    if node_q_rows(shape, int(q.ids.shape[0])) is not None:  # rows checked by wire.decode_block
        return {parent: q.map(lambda t, i=i: t[i:i + 1]) for i, parent in enumerate(q_parents(shape))}
    out: Dict[int, SparseDist] = {}
    first: Dict[int, int] = {}
    for node, parent in enumerate(shape.parents):
        if parent not in first:
            first[parent] = node
            out[parent] = q.map(lambda t, i=node: t[i:i + 1])
            continue
        row = first[parent]
        same = torch.equal(q.ids[node], q.ids[row]) and torch.equal(q.probs[node], q.probs[row])
        if not same:
            raise invalid(f"draft tree nodes {row} and {node} share a parent but their q rows differ; a node's "
                          "row must be the distribution its parent's children were drawn from")
    return out


def block_shape(tree: TreeShape, k: int, seq: int, parents: Sequence[int] = ()) -> TreeShape:
    """The tree a block of k draft tokens carries: the one its parents give (DraftBlock.parents), else the session's
    first k nodes; OUT_OF_RANGE past the tree's size, INVALID_ARGUMENT for parents that are not a tree of k nodes."""
    if k > tree.size:
        raise ProtocolError(grpc.StatusCode.OUT_OF_RANGE,
                            f"block {seq} has {k} draft tokens; the session's tree has {tree.size} nodes")
    if not parents:
        return prefix(tree, k)
    if len(parents) != k:
        raise invalid(f"block {seq} has {k} draft tokens but {len(parents)} parents; send one per node (or none)")
    try:
        return from_parents(parents)
    except ValueError as exc:
        raise invalid(f"block {seq}: {exc}") from None


def proposal_shape(session) -> TreeShape:
    """The tree of the drafter session's block in flight (Proposal.shape; a prefix of its tree if unset)."""
    proposal = session.proposal
    shape = getattr(proposal, "shape", None)
    return shape if shape is not None else prefix(session.mode.tree, len(proposal.draft_ids))

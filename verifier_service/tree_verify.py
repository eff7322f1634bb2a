"""Draft-tree sessions on the verifier (VerifyOpen.tree): each block holds the first nodes of the
session's static tree, breadth-first, and is verified by the in-process `tree_decoding` steps (the
pending token and every node scored with an ancestor mask; the greedy walk, or over siblings drawn without
replacement recursive rejection sampling or, in a block-verified session, traversal verification; the cache
keeping the accepted path), so a seeded session draws exactly what `tree_generate` draws in one process.
Concurrent sessions' trees share one packed pass (each row with its own positions and mask); chain sessions in
the same batch keep theirs.
"""

from __future__ import annotations

import time
from typing import Dict, List

import grpc
import torch

from steerspec.decoding.rounds import DecodeConfig
from steerspec.decoding.sampling import SparseDist
from steerspec.decoding.tree_decoding import finish_tree, tree_feed
from steerspec.decoding.trees import TreeShape, node_q_rows, prefix, q_parents
from steerspec.models.batched import packed_extend
from steerspec.models.kv import FastCachedLM
from steerspec.serving.wire import ProtocolError, WireBlock, invalid
from verifier_service import fast_verify
from verifier_service.verify_jobs import JobResult, TreeBlock


def check_session(lm) -> None:
    """FAILED_PRECONDITION unless the session's cache can hold a tree: a FastCachedLM (what
    `verify_sessions.session_lm` gives a tree session unless --kv-backend hf or the architecture rules it out)."""
    if not isinstance(lm, FastCachedLM):
        raise ProtocolError(grpc.StatusCode.FAILED_PRECONDITION,
                            "draft trees need the lean KV cache, which this replica's model or --kv-backend hf "
                            "does not give: start the verifier with --kv-backend auto or fast, or open the "
                            "session without a tree")


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


def block_shape(tree: TreeShape, k: int, seq: int) -> TreeShape:
    """The tree a block of k draft tokens carries: the session's first k nodes (OUT_OF_RANGE past its size)."""
    if k > tree.size:
        raise ProtocolError(grpc.StatusCode.OUT_OF_RANGE,
                            f"block {seq} has {k} draft tokens; the session's tree has {tree.size} nodes")
    return prefix(tree, k)


def check_block(shape: TreeShape, block: WireBlock, greedy: bool) -> TreeBlock:
    """The `TreeBlock` of a block carrying `shape` (`block_shape`); INVALID_ARGUMENT when siblings' q rows differ."""
    return TreeBlock(shape, None if (block.q is None or greedy) else parents_q(shape, block.q))


@torch.inference_mode()
def run(runner, jobs) -> List:
    """Tree jobs -> JobResults with their accepted paths: every tree scored in ONE packed pass
    (`packed_extend` with each row's positions and ancestor mask), then each session's own walk."""
    start = time.perf_counter()
    sessions = [job.session for job in jobs]
    trees = [job.tree for job in jobs]  # checked on arrival (`check_block`, the server's `_check_block`)
    shapes = [t.shape for t in trees]
    starts = [s.lm.length for s in sessions]
    fed = [tree_feed(s.pending, job.block.draft_ids.tolist(), shape, at)
           for s, job, shape, at in zip(sessions, jobs, shapes, starts)]
    want_hidden = runner.head is not None and any(s.steering for s in sessions)
    outs = packed_extend([s.lm for s in sessions], [f[0] for f in fed],
                         fast_verify.head_layers(runner) if want_hidden else None, [(f[1], f[2]) for f in fed])
    walked = []
    for session, job, tree, at, out in zip(sessions, jobs, trees, starts, outs):
        walked.append(finish_tree(session.lm, at, tree.shape, job.block.draft_ids.tolist(), out,
                                  DecodeConfig(sampling=session.params, acceptance=session.acceptance), tree.q_at,
                                  session.generator))
    steering = [None] * len(jobs)
    if want_hidden:
        g = fast_verify.steering_vectors(runner, torch.stack([hidden for _, _, hidden in walked]))
        steering = [g[i] if s.steering else None for i, s in enumerate(sessions)]
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    verify_ms = (time.perf_counter() - start) * 1e3
    results = []
    for i, (job, shape, (path, next_token, _)) in enumerate(zip(jobs, shapes, walked)):
        leaf = not (shape.children(path[-1]) if path else shape.children(-1))
        results.append(JobResult(accepted=len(path), next_token=next_token, is_bonus=leaf, steering=steering[i],
                                 queue_ms=(start - job.submitted) * 1e3, verify_ms=verify_ms,
                                 batch_size=len(jobs), path=path))
    return results


def run_mixed(runner, jobs) -> List:
    """Results in job order: the tree jobs together in one pass, the others through `runner.run` together."""
    chains = [job for job in jobs if job.session.tree is None]
    trees = iter(run(runner, [job for job in jobs if job.session.tree is not None]))
    batched = iter(runner.run(chains) if chains else [])
    return [next(trees) if job.session.tree is not None else next(batched) for job in jobs]

"""Draft-tree sessions on the verifier (VerifyOpen.tree): each block holds the first nodes of the
session's static tree, breadth-first, and is verified on its own by the in-process
`tree_decoding.verify_tree` (one pass over the pending token and every node with an ancestor mask,
the greedy walk or recursive rejection sampling over siblings drawn without replacement, the cache
keeping the accepted path), so a seeded session draws exactly what `tree_generate` draws in one
process. Chain sessions in the same batch keep the batched path.
"""

from __future__ import annotations

import time
from typing import Dict, List

import grpc
import torch

from steerspec.models.graphed import GraphedLM
from steerspec.models.kv import FastCachedLM
from steerspec.rounds import DecodeConfig
from steerspec.sampling import SparseDist
from steerspec.tree_decoding import verify_tree
from steerspec.trees import TreeShape, prefix
from steerspec.wire import ProtocolError, invalid
from verifier_service import fast_verify


def check_session(lm) -> None:
    """FAILED_PRECONDITION unless the session's cache can hold a tree (the host path's FastCachedLM)."""
    if not isinstance(lm, FastCachedLM) or isinstance(lm, GraphedLM):
        raise ProtocolError(grpc.StatusCode.FAILED_PRECONDITION,
                            "draft trees need the lean KV cache on this replica: start the verifier with "
                            "--kv-backend fast (or open the session without a tree)")


def parents_q(shape: TreeShape, q: SparseDist) -> Dict[int, SparseDist]:
    """The distribution [1, S] each parent's children were drawn from, from the block's rows (a node's
    row is its parent's q): INVALID_ARGUMENT when siblings' rows differ."""
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


@torch.inference_mode()
def run(runner, job):
    """One tree job -> JobResult (batch size 1) with the accepted path."""
    from verifier_service.batcher import JobResult

    start = time.perf_counter()
    session, block = job.session, job.block
    shape = block_shape(session.tree, block.k, block.seq)
    q_at = None if (block.q is None or session.greedy) else parents_q(shape, block.q)
    layers = fast_verify._layers(runner) if (session.steering and runner.head is not None) else None
    path, next_token, hidden = verify_tree(session.lm, session.pending, block.draft_ids.tolist(), shape, layers,
                                           DecodeConfig(sampling=session.params), q_at, session.generator)
    steering = None if hidden is None else fast_verify._head(runner, hidden.unsqueeze(0))[0]
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    leaf = not (shape.children(path[-1]) if path else shape.children(-1))
    return JobResult(accepted=len(path), next_token=next_token, is_bonus=leaf, steering=steering,
                     queue_ms=(start - job.submitted) * 1e3, verify_ms=(time.perf_counter() - start) * 1e3,
                     batch_size=1, path=path)


def run_mixed(runner, jobs) -> List:
    """Results in job order: tree jobs one by one, the others through `runner.run` together."""
    chains = [job for job in jobs if job.session.tree is None]
    batched = iter(runner.run(chains) if chains else [])
    return [run(runner, job) if job.session.tree is not None else next(batched) for job in jobs]

"""Traversal verification over a draft tree (Weng et al., "Traversal Verification for Speculative Tree
Decoding", NeurIPS 2025): exact like recursive rejection sampling (`trees.sampled_walk`), and on a chain it is
block verification (`block_verify`), since it judges each root-to-node path as a whole (pure; no I/O).

Leaf to root, children before their parent and in rank order (post-order), each node α keeps a weight w_α and
the verifier's distribution P_α after it (row 1 + α of `p_rows`; the root: w = 1, row 0):
- on reaching a child c with token x: w_c = min(1, w_α · P_α(x) / q_i(x)), q_i the distribution c was drawn
  from (q without the earlier siblings' tokens when drawn without replacement), and c's subtree goes first;
- when c's subtree is all rejected: r = max(0, w_α · P_α − q_i) with mass s, P_α = r / s (when s > 0) and
  w_α = s / (s + 1 − w_α) (0 when both vanish);
- once α's children are done α is judged: the path root..α is accepted with probability w_α (the root always);
  the first accepted path ends the walk, and the next token is drawn from that node's P.
A child rejected by the token-wise test no longer drops its subtree: a descendant whose ratio is above 1 can
carry the path. Checked exact by enumeration over small trees and vocabularies (tests/decoding/test_traversal.py).
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from steerspec.decoding.trees import TreeShape, node_tests, sibling_proposal


def traversal_evaluations(shape: TreeShape, node_tokens: Sequence[int], p_rows: Tensor, q_at: Dict[int, Tensor],
                          distinct: bool = True) -> Iterator[Tuple[int, float, Tensor]]:
    """The walk's judgements in order, each given that every earlier one rejected: (node, -1 for the root; the
    chance its path is accepted; the distribution the next token comes from if it is). Arguments as
    `trees.sampled_walk`'s."""
    weight: Dict[int, float] = {-1: 1.0}
    dist: Dict[int, Tensor] = {-1: p_rows[0]}

    def visit(node: int) -> Iterator[Tuple[int, float, Tensor]]:
        earlier: List[int] = []
        for child in shape.children(node):
            x = int(node_tokens[child])
            q = sibling_proposal(q_at[node], earlier) if distinct else q_at[node]
            earlier.append(x)
            if float(q.sum()) <= 0:  # q had fewer tokens than siblings: the rest were never drawn from it
                break
            p = dist[node]
            ratio = float(p[x]) / float(q[x]) if float(q[x]) > 0 else 0.0
            weight[child], dist[child] = min(1.0, weight[node] * ratio), p_rows[1 + child]
            yield from visit(child)
            w = weight[node]
            residual = (w * p - q).clamp_(min=0)
            mass = float(residual.sum())
            weight[node] = mass / (mass + 1.0 - w) if mass + 1.0 - w > 0 else 0.0
            if mass > 0:
                dist[node] = residual / mass
        yield node, (1.0 if node < 0 else weight[node]), dist[node]

    yield from visit(-1)


def traversal_walk(shape: TreeShape, node_tokens: Sequence[int], p_rows: Tensor, q_at: Dict[int, Tensor],
                   generator: Optional[torch.Generator] = None, distinct: bool = True) -> Tuple[List[int], int, int]:
    """Traversal verification over a verified tree: exactly the verifier's distribution. Arguments and result as
    `trees.sampled_walk`'s: (accepted path, next token, row of `p_rows` at the node that gave it)."""
    for node, chance, p in traversal_evaluations(shape, node_tokens, p_rows, q_at, distinct):
        if node < 0 or float(torch.rand((), generator=generator, device=p.device)) < chance:
            token = int(torch.multinomial(p.unsqueeze(0), 1, generator=generator)[0, 0])
            path = [] if node < 0 else shape.ancestors(node) + [node]
            return path, token, 1 + node
    raise AssertionError("the root is always accepted")


def expected_path_lengths(shape: TreeShape, node_tokens: Sequence[int], p_rows: Tensor, q_at: Dict[int, Tensor],
                          distinct: bool = True) -> Tuple[float, float]:
    """E[accepted drafts] given the tree's drafts under recursive rejection sampling and under traversal
    verification: a paired, noise-free comparison of the two rules on the same trees
    (scripts/bench_block_verify.py --trees)."""
    def rrs(node: int, row: int) -> float:
        total, rest = 0.0, 1.0
        for child, chance, _ in node_tests(p_rows[row], q_at.get(node), shape.children(node), node_tokens, distinct):
            if child is None:
                break
            total += rest * chance * (1.0 + rrs(child, 1 + child))
            rest *= 1.0 - chance
        return total

    traversal, rest = 0.0, 1.0
    for node, chance, _ in traversal_evaluations(shape, node_tokens, p_rows, q_at, distinct):
        if node >= 0:
            traversal += rest * chance * shape.depths[node]
            rest *= 1.0 - chance
    return rrs(-1, 0), traversal

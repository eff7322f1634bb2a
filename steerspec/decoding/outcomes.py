"""The likeliest verdicts of a block in flight, ranked by the drafter's own probabilities (drafting ahead).

While a block is away being verified, the drafter prepares the next block for the verdicts it finds most
probable (drafter_service/ahead.py). A verdict is the accepted drafts (a chain's first a; a tree's path, root to
the node it ends at) and the verifier's next token after them: the correction at a rejection (any token but the
drafts tried there) or the bonus token after the last draft. Its score treats the drafter as the verifier: the log
probability, under the drafter's distribution at the session's temperature (1 when greedy), of the accepted drafts
and then of the next token. The drafter's logits come from one pass over [pending, drafts...] (a tree's with its
ancestor mask), made in idle time.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch
from torch import Tensor

from steerspec.decoding.trees import TreeShape


@dataclass(frozen=True)
class Outcome:
    """A verdict a block may get: the accepted drafts (a tree's path of nodes), the next token, its log probability."""

    accepted: int
    next_token: int
    path: Tuple[int, ...] = ()
    logprob: float = 0.0


def log_probs(logits: Tensor, temperature: float) -> Tensor:
    """The drafter's log probabilities [rows, V] at `temperature` (greedy sessions: 1)."""
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits.float() / t, dim=-1)


def _best_after(row: Tensor, exclude: Sequence[int], count: int) -> List[Tuple[int, float]]:
    """The `count` likeliest tokens of one row of log probabilities, `exclude` left out."""
    top = row.topk(min(count + len(exclude), row.numel()))
    out = [(int(t), float(v)) for v, t in zip(top.values.tolist(), top.indices.tolist()) if int(t) not in exclude]
    return out[:count]


def chain_outcomes(lp: Tensor, drafts: Sequence[int], limit: int) -> List[Outcome]:
    """The `limit` likeliest verdicts of a chain block; `lp` [k + 1, V]: the drafter's rows at the pending token
    and after each draft."""
    found: List[Outcome] = []
    prefix = 0.0
    for a in range(len(drafts) + 1):
        exclude = [int(drafts[a])] if a < len(drafts) else []
        for token, value in _best_after(lp[a], exclude, limit):
            found.append(Outcome(a, token, (), prefix + value))
        if a < len(drafts):
            prefix += float(lp[a, int(drafts[a])])
    return heapq.nlargest(limit, found, key=lambda o: o.logprob)


def tree_outcomes(lp: Tensor, tokens: Sequence[int], shape: TreeShape, limit: int) -> List[Outcome]:
    """The `limit` likeliest verdicts of a tree block; `lp` [size + 1, V]: the drafter's rows at the pending token
    (row 0) and at each node (row 1 + node), from one pass with the tree's ancestor mask."""
    found: List[Outcome] = []
    ends = [-1, *range(shape.size)]
    reach = {-1: 0.0}  # log probability of the path to each node
    for node in range(shape.size):  # breadth-first: a parent comes before its children
        parent = shape.parents[node]
        reach[node] = reach[parent] + float(lp[parent + 1, int(tokens[node])])
    for end in ends:
        path = () if end < 0 else tuple(shape.ancestors(end)) + (end,)
        exclude = [int(tokens[c]) for c in shape.children(end)]
        for token, value in _best_after(lp[end + 1], exclude, limit):
            found.append(Outcome(len(path), token, path, reach[end] + value))
    return heapq.nlargest(limit, found, key=lambda o: o.logprob)

"""The verifier's anchor passes: a few passes timed on itself at start, so its cost fit can tell a block's cost from
a row's and a branched tree's (verifier_service/pass_costs.py) before the served passes vary them.

Blocks of 1 and 4 sessions — chains of 1 and 8 rows, and a branched tree of TREE_PARENTS' nodes — over a
PREFIX-token cache, interleaved, median of REPEATS after a warm-up, through `packed_extend`, the pass the verifier's
fast caches run (invariant or not, as the model is set).
Only where sessions get the lean FastCachedLM on the CPU; elsewhere (transformers caches, GPUs) no anchors. Kept for
the process per machine, model shape, dtype, kernel plan and thread count (the kernel-path cache's key: timings
depend on those, not on the weights' values), so verifiers started again in one process time them once.
"""

from __future__ import annotations

import statistics
import time
from typing import Dict, List, Tuple

import torch

from steerspec.models.batched import packed_extend
from steerspec.models.invariant_pass import invariant_plan
from steerspec.models.kernel_path import cache_key
from steerspec.models.kv import FastCachedLM

SHAPES = ((1, 1, False), (1, 8, False), (4, 1, False), (4, 8, False), (1, 6, True), (4, 6, True))
# (blocks, rows per block, a branched tree): the tree is the pending token's row and a 5-node tree under it
TREE_PARENTS = (-1, 0, 0, 0, 1, 2)  # each row's parent row (-1: the cached prefix's last token)
PREFIX = 96  # cached tokens per session (a short prompt and some output)
REPEATS = 3
Anchor = Tuple[int, int, float, int]  # blocks, rows, median ms, branched trees
TIMED: Dict[Tuple[str, object], List[Anchor]] = {}  # (kernel-path key, plan) -> anchors


@torch.inference_mode()
def anchor_passes(model) -> List[Anchor]:
    """(blocks, rows, median ms, branched trees) per shape of SHAPES on `model`; [] where its sessions do not run
    packed passes."""
    if model.device.type != "cpu" or not FastCachedLM.supports(model):
        return []
    key = (cache_key(model), invariant_plan(model))
    if key not in TIMED:
        TIMED[key] = _time_shapes(model)
    return list(TIMED[key])


def _time_shapes(model) -> List[Anchor]:
    """Time SHAPES on `model` (module docstring)."""
    gen = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    most = max(b for b, _, _ in SHAPES)
    tree = tree_mask(PREFIX, TREE_PARENTS)
    lms = [FastCachedLM(model) for _ in range(most)]
    for lm in lms:
        lm.extend(torch.randint(0, vocab, (PREFIX,), generator=gen))
    times = {shape: [] for shape in SHAPES}
    for repeat in range(REPEATS + 1):
        for blocks, rows, branched in SHAPES:
            feeds = [torch.randint(0, vocab, (rows,), generator=gen) for _ in range(blocks)]
            start = time.perf_counter()
            packed_extend(lms[:blocks], feeds, trees=[tree] * blocks if branched else None)
            ms = (time.perf_counter() - start) * 1e3
            for lm in lms[:blocks]:
                lm.rollback(PREFIX)
            if repeat:  # the first round warms the kernels and the weight copies up
                times[(blocks, rows, branched)].append(ms)
    return [(b, b * r, statistics.median(times[(b, r, t)]), b if t else 0) for b, r, t in SHAPES]


def tree_mask(start: int, parents: Tuple[int, ...]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(positions, visible) of a tree whose rows have these parents, after `start` cached tokens."""
    n = len(parents)
    visible = torch.zeros(n, start + n, dtype=torch.bool)
    visible[:, :start] = True
    depth = []
    for row in range(n):
        node, d = row, 0
        while node >= 0:
            visible[row, start + node] = True
            node, d = parents[node], d + 1
        depth.append(d - 1)
    return torch.tensor(depth) + start, visible

"""The verifier's anchor passes: a few passes timed on itself at start, so its cost fit can tell a block's cost from
a row's and a branching tree's (verifier_service/pass_costs.py) before the served passes vary them.

Blocks of 1 and 4 sessions, 1 and 8 rows each, 6 of 2 and 3 rows, and 4 branching trees of 8 rows (TREE_PARENTS),
over a PREFIX-token cache, interleaved, median of REPEATS after a warm-up — through `packed_extend`, the pass the
verifier's fast caches run (invariant or not, as the model is set).
Only where sessions get the lean FastCachedLM on the CPU; elsewhere (transformers caches, GPUs) no anchors. Kept for
the process per machine, model shape, dtype, kernel plan and thread count (the kernel-path cache's key: timings
depend on those, not on the weights' values), so verifiers started again in one process time them once.
"""

from __future__ import annotations

import statistics
import time
from typing import Dict, List, Tuple

import torch

from steerspec.decoding.tree_decoding import tree_feed
from steerspec.decoding.trees import from_parents
from steerspec.models.batched import packed_extend
from steerspec.models.invariant_pass import invariant_plan
from steerspec.models.kernel_path import cache_key
from steerspec.models.kv import FastCachedLM
from verifier_service.pass_costs import Anchor

# (blocks, rows per block, tree): 6 blocks of 2 and of 3 rows differ only in the rows a bucketed path pads to (12 and
# 18: one product of 16 rows or two), whatever a block's attention costs on the served contexts; a tree's rows are the
# pending token and TREE_PARENTS' nodes
SHAPES = ((1, 1, False), (1, 8, False), (4, 1, False), (4, 8, False), (6, 2, False), (6, 3, False), (4, 8, True))
TREE_PARENTS = (-1, -1, 0, 0, 1, 1, 2)  # a branching tree's nodes as the wire carries them (-1: the pending token)
PREFIX = 96  # cached tokens per session (a short prompt and some output)
REPEATS = 3
TIMED: Dict[Tuple[str, object], List[Anchor]] = {}  # (kernel-path key, plan) -> anchors


@torch.inference_mode()
def anchor_passes(model) -> List[Anchor]:
    """An `Anchor` (blocks, rows, median ms, branched) per shape of SHAPES on `model`; [] where its sessions do not run
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
    _, positions, visible = tree_feed(0, [0] * len(TREE_PARENTS), from_parents(TREE_PARENTS), PREFIX)
    lms = [FastCachedLM(model) for _ in range(most)]
    for lm in lms:
        lm.extend(torch.randint(0, vocab, (PREFIX,), generator=gen))
    times = {shape: [] for shape in SHAPES}
    for repeat in range(REPEATS + 1):
        for blocks, rows, branched in SHAPES:
            feeds = [torch.randint(0, vocab, (rows,), generator=gen) for _ in range(blocks)]
            trees = [(positions, visible)] * blocks if branched else None
            start = time.perf_counter()
            packed_extend(lms[:blocks], feeds, trees=trees)
            ms = (time.perf_counter() - start) * 1e3
            for lm in lms[:blocks]:
                lm.rollback(PREFIX)
            if repeat:  # the first round warms the kernels and the weight copies up
                times[(blocks, rows, branched)].append(ms)
    return [Anchor(b, b * r, statistics.median(times[(b, r, t)]), t) for b, r, t in SHAPES]

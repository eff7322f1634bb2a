"""The verifier's anchor passes: a few passes timed on itself at start, so its cost fit can tell a block's cost from
a row's (verifier_service/pass_costs.py) before the served passes vary both.

Blocks of 1 and 4 sessions, 1 and 8 rows each, over a PREFIX-token cache, interleaved, median of REPEATS after a
warm-up — through `packed_extend`, the pass the verifier's fast caches run (invariant or not, as the model is set).
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

SHAPES = ((1, 1), (1, 8), (4, 1), (4, 8))  # (blocks, rows per block)
PREFIX = 96  # cached tokens per session (a short prompt and some output)
REPEATS = 3
TIMED: Dict[Tuple[str, object], List[Tuple[int, int, float]]] = {}  # (kernel-path key, plan) -> anchors


@torch.inference_mode()
def anchor_passes(model) -> List[Tuple[int, int, float]]:
    """(blocks, rows, median ms) per shape of SHAPES on `model`; [] where its sessions do not run packed passes."""
    if model.device.type != "cpu" or not FastCachedLM.supports(model):
        return []
    key = (cache_key(model), invariant_plan(model))
    if key not in TIMED:
        TIMED[key] = _time_shapes(model)
    return list(TIMED[key])


def _time_shapes(model) -> List[Tuple[int, int, float]]:
    """Time SHAPES on `model` (module docstring)."""
    gen = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    most = max(b for b, _ in SHAPES)
    lms = [FastCachedLM(model) for _ in range(most)]
    for lm in lms:
        lm.extend(torch.randint(0, vocab, (PREFIX,), generator=gen))
    times = {shape: [] for shape in SHAPES}
    for repeat in range(REPEATS + 1):
        for blocks, rows in SHAPES:
            feeds = [torch.randint(0, vocab, (rows,), generator=gen) for _ in range(blocks)]
            start = time.perf_counter()
            packed_extend(lms[:blocks], feeds)
            ms = (time.perf_counter() - start) * 1e3
            for lm in lms[:blocks]:
                lm.rollback(PREFIX)
            if repeat:  # the first round warms the kernels and the weight copies up
                times[(blocks, rows)].append(ms)
    return [(b, b * r, statistics.median(times[(b, r)])) for b, r in SHAPES]

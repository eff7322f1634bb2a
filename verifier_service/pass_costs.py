"""The verifier's measured cost curve: pass time against the blocks and the rows it scored, fitted over recent passes.

c = fixed + per_block · U + per_row · R', in the units of the verifier's kernel path (`steerspec.models.pass_shape`):
on the ordinary path U is the pass's blocks B and R' its rows R; on the batch-invariant path U counts each block's
attention products and R' the rows padded to the linear layers' bucket, so the fit follows the path's staircase
(16 rows in one product, 17 in two) instead of drawing a line through it. Both terms are real: every row goes
through the linear layers, and every block (a session's rows) costs its own attention over its own cache — on the
batch-invariant path one product per 5 rows on SmolLM2, whatever its cache, so a pass of 16 one-row blocks costs about
three times a pass of one 16-row block (Intel Xeon, SmolLM2 in bfloat16). Sessions that all send blocks
of one size make R = B · (n + 1): from their passes alone the two slopes cannot be told apart, so the fit also
holds a few anchor passes the verifier timed on itself at start (`verifier_service/cost_probe.py`: 1 and 4 blocks of
1 and 8 rows), at a fixed small weight; the served passes decide every direction they vary in (their weights decay
by 1 − beta per pass, so the fit follows the host and the current contexts), the anchors the rest. Slopes are kept
≥ 0. Each result carries the fit (VerifyResult.cost_fixed_ms / cost_per_block_ms / cost_per_row_ms) and its units
(cost_row_bucket / cost_block_rows): a coordinator sharing the verifier prices its next block with them
(steerspec/policies/load.py).
"""

from __future__ import annotations

from typing import Iterable, List, Sequence, Tuple

import numpy as np

from steerspec.models.pass_shape import PassShape

ANCHOR_WEIGHT = 0.5  # each anchor pass weighs as this many served passes (the decayed served weight tops at 1/beta)
RIDGE = 1e-6  # on the slopes only: a direction no pass varies in gets no slope (the cost stays in the fixed part)


class PassCosts:
    """c = fixed + per_block · U + per_row · R' (module docstring) from the block rows and times of the verifier's
    passes."""

    def __init__(self, beta: float = 0.05, anchors: Iterable[Tuple[int, int, float]] = (),
                 shape: PassShape = PassShape()) -> None:
        self.beta = float(beta)
        self.shape = shape
        self.xx = np.zeros((3, 3))  # decayed Σ w·x·xᵀ, x = (1, U, R')
        self.xy = np.zeros(3)  # decayed Σ w·x·ms
        self.anchors: List[Tuple[int, int, float]] = []
        self.passes = 0
        self.set_anchors(anchors)

    def set_anchors(self, anchors: Iterable[Tuple[int, int, float]]) -> None:
        """The start-up passes (blocks, rows, ms) — blocks of equal rows — that identify the slopes the served passes
        cannot."""
        self.anchors = [(int(b), int(r), float(ms)) for b, r, ms in anchors if b > 0 and r > 0 and ms > 0]

    def features(self, block_rows: Sequence[int]) -> np.ndarray:
        """x = (1, U, R') of a pass of blocks with these rows."""
        units, rows = self.shape.units(block_rows)
        return np.array([1.0, units, rows])

    def add(self, block_rows: Sequence[int], ms: float) -> None:
        """One pass of blocks of these rows (the pending token and the drafts of each) that took `ms`."""
        if not block_rows or min(block_rows) <= 0 or ms <= 0:
            return
        x = self.features(block_rows)
        keep = 1.0 - self.beta
        self.xx = keep * self.xx + np.outer(x, x)
        self.xy = keep * self.xy + x * float(ms)
        self.passes += 1

    def line(self) -> Tuple[float, float, float]:
        """(fixed ms, ms per attention unit, ms per padded row); zeros before any pass."""
        if not self.passes and not self.anchors:
            return 0.0, 0.0, 0.0
        xx, xy = self.xx.copy(), self.xy.copy()
        for b, r, ms in self.anchors:
            x = self.features([r // b] * b)
            xx += ANCHOR_WEIGHT * np.outer(x, x)
            xy += ANCHOR_WEIGHT * x * ms
        return _solve(xx, xy)


def _solve(xx: np.ndarray, xy: np.ndarray) -> Tuple[float, float, float]:
    """Weighted least squares with both slopes ≥ 0 (a negative one is dropped and the rest refitted)."""
    free: Sequence[int] = (0, 1, 2)
    for _ in range(3):
        sub = np.ix_(free, free)
        penalty = np.diag([0.0 if i == 0 else RIDGE for i in free])
        theta = np.linalg.solve(xx[sub] + penalty, xy[list(free)])
        full = np.zeros(3)
        full[list(free)] = theta
        negative = [i for i in free if i > 0 and full[i] < 0.0]
        if not negative:
            break
        free = [i for i in free if i not in negative]
    if full[0] < 0.0:  # a line through the data would start below zero: the passes' mean cost over their rows
        rows = xx[0, 2] / max(xx[0, 0], 1e-9)
        full = np.array([0.0, 0.0, (xy[0] / max(xx[0, 0], 1e-9)) / max(rows, 1.0)])
    return float(full[0]), float(full[1]), float(full[2])

"""The verifier's measured cost curve: pass time against the blocks and the rows it scored, fitted over recent passes.

c(B, R) = fixed + per_block · B + per_row · R. Both terms are real: every row goes through the linear layers, and
every block (a session's rows) costs its own attention over its own cache — on the batch-invariant path a block's
attention is a fixed set of products whatever its rows (models/invariant_ops.py), so a pass of 16 one-row blocks
costs about three times a pass of one 16-row block (Intel Xeon, SmolLM2 in bfloat16). Sessions that all send blocks
of one size make R = B · (n + 1): from their passes alone the two slopes cannot be told apart, so the fit also
holds a few anchor passes the verifier timed on itself at start (`verifier_service/cost_probe.py`: 1 and 4 blocks of
1 and 8 rows), at a fixed small weight; the served passes decide every direction they vary in (their weights decay
by 1 − beta per pass, so the fit follows the host and the current contexts), the anchors the rest. Slopes are kept
≥ 0. Each result carries the fit (VerifyResult.cost_fixed_ms / cost_per_block_ms / cost_per_row_ms): a coordinator
sharing the verifier prices its next block with it (steerspec/policies/load.py).
"""

from __future__ import annotations

from typing import Iterable, List, Sequence, Tuple

import numpy as np

ANCHOR_WEIGHT = 0.5  # each anchor pass weighs as this many served passes (the decayed served weight tops at 1/beta)
RIDGE = 1e-6  # on the slopes only: a direction no pass varies in gets no slope (the cost stays in the fixed part)


class PassCosts:
    """c(B, R) = fixed + per_block · B + per_row · R from (blocks, rows, ms) of the verifier's passes."""

    def __init__(self, beta: float = 0.05, anchors: Iterable[Tuple[int, int, float]] = ()) -> None:
        self.beta = float(beta)
        self.xx = np.zeros((3, 3))  # decayed Σ w·x·xᵀ, x = (1, B, R)
        self.xy = np.zeros(3)  # decayed Σ w·x·ms
        self.anchors: List[Tuple[int, int, float]] = []
        self.passes = 0
        self.set_anchors(anchors)

    def set_anchors(self, anchors: Iterable[Tuple[int, int, float]]) -> None:
        """The start-up passes (blocks, rows, ms) that identify the slopes the served passes cannot."""
        self.anchors = [(int(b), int(r), float(ms)) for b, r, ms in anchors if b > 0 and r > 0 and ms > 0]

    def add(self, blocks: int, rows: int, ms: float) -> None:
        """One pass of `blocks` blocks and `rows` rows that took `ms`."""
        if blocks <= 0 or rows <= 0 or ms <= 0:
            return
        x = np.array([1.0, float(blocks), float(rows)])
        keep = 1.0 - self.beta
        self.xx = keep * self.xx + np.outer(x, x)
        self.xy = keep * self.xy + x * float(ms)
        self.passes += 1

    def line(self) -> Tuple[float, float, float]:
        """(fixed ms, ms per block, ms per row); zeros before any pass."""
        if not self.passes and not self.anchors:
            return 0.0, 0.0, 0.0
        xx, xy = self.xx.copy(), self.xy.copy()
        for b, r, ms in self.anchors:
            x = np.array([1.0, float(b), float(r)])
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

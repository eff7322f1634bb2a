"""The verifier's measured cost curve: pass time against the blocks and the rows it scored, fitted over recent passes.

c = fixed + per_block · U + per_row · R', in the units of the verifier's kernel path (`steerspec.models.pass_shape`):
on the ordinary path U is the pass's blocks B and R' its rows R; on the batch-invariant path U counts each block's
attention products and R' the rows padded to the linear layers' bucket, so the fit follows the path's staircase (16
rows in one product, 17 in two) instead of drawing a line through it; + per_branched_row · G, G the rows of the blocks
that are branching trees (their attention gathers keys per query; 0 on a chain). The terms are real: every row goes
through the linear layers, and every block (a session's rows) costs its own attention over its own cache — on the
batch-invariant path one product per 5 rows on SmolLM2, whatever its cache, so a pass of 16 one-row blocks costs about
three times a pass of one 16-row block (Intel Xeon, SmolLM2 in bfloat16). Sessions that all send blocks of one size
make R = B · (n + 1): from their passes alone the two slopes cannot be told apart, so the fit also holds a few anchor
passes the verifier timed on itself at start (`verifier_service/cost_probe.py`: 1 and 4 blocks of 1 and 8 rows, 6 of 2
and 3, 4 branching trees of 8), at a fixed small weight and with an offset of their own (they ran on short contexts on
an idle host: their level is not the served passes', only their differences count); the served passes decide every
direction they vary in (their weights decay by 1 − beta per pass, so the fit follows the host and the current
contexts), the anchors the rest. Slopes are kept ≥ 0. Each result carries the fit (VerifyResult.cost_fixed_ms /
cost_per_block_ms / cost_per_row_ms / cost_per_branched_row_ms) and its units (cost_row_bucket / cost_block_rows): a
coordinator sharing the verifier prices its next block with them (steerspec/policies/load.py).
"""

from __future__ import annotations

from typing import Iterable, List, NamedTuple, Sequence, Tuple

import numpy as np

from steerspec.models.pass_shape import PassShape

ANCHOR_WEIGHT = 0.5  # each anchor pass weighs as this many served passes (the decayed served weight tops at 1/beta)
TERMS = 4  # reported: fixed, per attention unit, per padded row, per branched row
OFFSET = TERMS  # fitted besides them: how much cheaper (or dearer) the anchor passes ran than the served ones
RIDGE = 1e-6  # on the slopes only: a direction no pass varies in gets no slope (the cost stays in the fixed part)


class Anchor(NamedTuple):
    """A start-up pass: `blocks` blocks of rows/blocks rows each (trees that branch, when `branched`) took `ms`."""

    blocks: int
    rows: int
    ms: float
    branched: bool = False


class PassCosts:
    """c = fixed + per_block · U + per_row · R' + per_branched_row · G (module docstring) from the block rows and
    times of the verifier's passes."""

    def __init__(self, beta: float = 0.05, anchors: Iterable[Sequence] = (), shape: PassShape = PassShape()) -> None:
        self.beta = float(beta)
        self.shape = shape
        self.xx = np.zeros((TERMS + 1, TERMS + 1))  # decayed Σ w·x·xᵀ, x = (1, U, R', G, anchor)
        self.xy = np.zeros(TERMS + 1)  # decayed Σ w·x·ms
        self.anchors: List[Anchor] = []
        self.passes = 0
        self.set_anchors(anchors)

    def set_anchors(self, anchors: Iterable[Sequence]) -> None:
        """The start-up passes (`Anchor`s, or (blocks, rows, ms) tuples of chains) that identify the slopes the served
        passes cannot."""
        made = [Anchor(*a) for a in anchors]
        self.anchors = [a for a in made if a.blocks > 0 and a.rows > 0 and a.ms > 0]

    def features(self, block_rows: Sequence[int], branched: Sequence[bool] = (), anchor: bool = False) -> np.ndarray:
        """x = (1, U, R', G, anchor) of a pass of blocks with these rows (`branched`: which are trees that branch)."""
        return np.array([1.0, *self.shape.units(block_rows, branched), float(anchor)])

    def add(self, block_rows: Sequence[int], ms: float, branched: Sequence[bool] = ()) -> None:
        """One pass of blocks of these rows (the pending token and the drafts of each) that took `ms`."""
        if not block_rows or min(block_rows) <= 0 or ms <= 0:
            return
        x = self.features(block_rows, branched)
        keep = 1.0 - self.beta
        self.xx = keep * self.xx + np.outer(x, x)
        self.xy = keep * self.xy + x * float(ms)
        self.passes += 1

    def line(self) -> Tuple[float, float, float, float]:
        """(fixed ms, ms per attention unit, ms per padded row, ms per branched row); zeros before any pass."""
        if not self.passes and not self.anchors:
            return 0.0, 0.0, 0.0, 0.0
        xx, xy = self.xx.copy(), self.xy.copy()
        for a in self.anchors:
            x = self.features([a.rows // a.blocks] * a.blocks, [a.branched] * a.blocks, anchor=True)
            xx += ANCHOR_WEIGHT * np.outer(x, x)
            xy += ANCHOR_WEIGHT * x * a.ms
        return _solve(xx, xy)


def _solve(xx: np.ndarray, xy: np.ndarray) -> Tuple[float, float, float, float]:
    """Weighted least squares with every slope ≥ 0 (a negative one is dropped and the rest refitted); the anchors'
    offset takes either sign, so a level the served passes run at (longer contexts, a busier host) does not tilt the
    slopes that only the anchors' differences decide."""
    free: Sequence[int] = tuple(range(TERMS + 1))
    for _ in range(TERMS):
        sub = np.ix_(free, free)
        penalty = np.diag([0.0 if i == 0 else RIDGE for i in free])
        theta = np.linalg.solve(xx[sub] + penalty, xy[list(free)])
        full = np.zeros(TERMS + 1)
        full[list(free)] = theta
        negative = [i for i in free if 0 < i < OFFSET and full[i] < 0.0]
        if not negative:
            break
        free = [i for i in free if i not in negative]
    if full[0] < 0.0:  # a line through the data would start below zero: the passes' mean cost over their rows
        rows = xx[0, 2] / max(xx[0, 0], 1e-9)
        full = np.zeros(TERMS + 1)
        full[2] = (xy[0] / max(xx[0, 0], 1e-9)) / max(rows, 1.0)
    return float(full[0]), float(full[1]), float(full[2]), float(full[3])

"""How a verify pass's cost grows with its shape: the units a pass of blocks of r_1..r_B rows is billed in.

On the ordinary path a pass costs about fixed + per_block · B + per_row · R (R = Σ r_b). The batch-invariant path
(models/invariant_ops.py) computes in fixed-size products instead: every linear layer pads the pass's R rows up to a
multiple of its row bucket, and each block's attention runs its r_b rows × the query heads per key head in products of
QUERY_ROWS rows. Its cost is a staircase: on SmolLM2 (bucket 16, 3 query heads per key head), 4 blocks of 4 rows
(16 rows) cost 89 ms and 4 blocks of 5 (20 rows) 121 ms, one block of 6 rows costs a second attention product
(Intel Xeon, bfloat16, one thread). `PassShape` names the two steps, so the verifier fits its cost in those units
(verifier_service/pass_costs.py) and a coordinator prices a block it might send in the same ones
(steerspec/policies/load.py): row_bucket 1 and block_rows 0 are the ordinary path's plain counts. A third unit is
the rows of blocks that are branching trees: their queries gather their own keys (a path reads them in place), 4
blocks of the tree {0, 00, 1} costing 116 ms where 4 chains of as many rows cost 93.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence, Tuple

from steerspec.models.invariant_ops import QUERY_ROWS
from steerspec.models.invariant_pass import invariant_plan

EPS = 1e-9  # a float block_rows such as 16/3 must not turn 16 rows' 3.0000000000000004 into 4 products


class PassShape(NamedTuple):
    """The steps of a verifier's pass cost: rows per linear product, and a block's rows per attention product."""

    row_bucket: int = 1  # the pass's rows are padded to a multiple of this (1: not padded)
    block_rows: float = 0.0  # a block's attention takes one product per this many of its rows (0: one per block)

    def block_units(self, rows: float) -> float:
        """Attention products one block of `rows` rows costs (1 per block on the ordinary path)."""
        if self.block_rows <= 0.0:
            return 1.0
        return float(max(1, math.ceil(rows / self.block_rows - EPS)))

    def padded_rows(self, rows: float) -> float:
        """The rows a pass of `rows` rows is computed as."""
        bucket = max(int(self.row_bucket), 1)
        return float(bucket * math.ceil(rows / bucket - EPS)) if bucket > 1 else float(rows)

    def units(self, block_rows: Sequence[int], branched: Sequence[bool] = ()) -> Tuple[float, float, float]:
        """(attention units, padded rows, rows of branched blocks) of a pass of blocks with these rows (`branched`:
        which blocks are trees that branch, whose attention gathers keys per query): what its cost is linear in."""
        flags = list(branched) or [False] * len(block_rows)
        gathered = float(sum(r for r, tree in zip(block_rows, flags) if tree))
        return sum(self.block_units(r) for r in block_rows), self.padded_rows(sum(block_rows)), gathered


def pass_shape(model) -> PassShape:
    """The steps of `model`'s verify passes: its invariant plan's (rows bucket; QUERY_ROWS over the query heads per key
    head), or the ordinary path's plain counts."""
    plan = invariant_plan(model)
    if plan is None:
        return PassShape()
    config = model.config
    heads = int(config.num_attention_heads)
    group = max(heads // int(getattr(config, "num_key_value_heads", None) or heads), 1)
    return PassShape(row_bucket=int(plan.rows), block_rows=QUERY_ROWS / group)

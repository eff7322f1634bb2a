"""The verifier's measured cost curve: pass time against the rows it scored, a line fitted over recent passes.

Every verify pass adds (rows, ms); the line c(R) = fixed + per_row · R is the exponentially weighted least-squares
fit (weights decay by 1 − beta per pass, so it follows the host and the current batch), its slope clamped to
[0, mean ms per row] so the fixed part stays ≥ 0. Each result carries it (VerifyResult.cost_fixed_ms /
cost_per_row_ms): a coordinator sharing the verifier prices its next block with it (steerspec/policies/load.py).
"""

from __future__ import annotations

from typing import Tuple

MIN_SPREAD = 1e-6  # below this weighted variance of rows the slope is not identified


class PassCosts:
    """c(R) = fixed + per_row · R from (rows, ms) of the verifier's passes."""

    def __init__(self, beta: float = 0.05) -> None:
        self.beta = float(beta)
        self.w = self.sr = self.sm = self.srr = self.srm = 0.0  # decayed Σw, Σw·R, Σw·ms, Σw·R², Σw·R·ms
        self.passes = 0

    def add(self, rows: int, ms: float) -> None:
        """One pass of `rows` rows that took `ms`."""
        if rows <= 0 or ms <= 0:
            return
        keep = 1.0 - self.beta
        r, m = float(rows), float(ms)
        self.w = keep * self.w + 1.0
        self.sr = keep * self.sr + r
        self.sm = keep * self.sm + m
        self.srr = keep * self.srr + r * r
        self.srm = keep * self.srm + r * m
        self.passes += 1

    def line(self) -> Tuple[float, float]:
        """(fixed ms, ms per row); (0, 0) before any pass."""
        if not self.passes:
            return 0.0, 0.0
        mean_r, mean_m = self.sr / self.w, self.sm / self.w
        spread = self.srr / self.w - mean_r * mean_r
        per_row = (self.srm / self.w - mean_r * mean_m) / spread if spread > MIN_SPREAD else 0.0
        per_row = min(max(per_row, 0.0), mean_m / max(mean_r, 1.0))
        return max(mean_m - per_row * mean_r, 0.0), per_row

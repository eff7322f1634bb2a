"""A block cost as a line in its length, c0 + c1·k, fitted to measured blocks of different lengths.

The slope comes from consecutive blocks of different lengths: each such pair adds Δk·Δms and Δk² to
exponentially weighted sums (decayed by 1 − beta per block, so recent pairs outweigh old ones; after
a long stretch on one length the slope so far counts as one pair), c1 = Σ Δk·Δms / Σ Δk². (A slope
forgetting 4× slower than the level halved its noise in simulation but measured worse through the
services: RTT 50 0.91× the best fixed k per prompt against 1.01×; an early, noisy slope then
lingers.) Blocks next to each other ran on the same host state, so a slow drift of the host's speed
(a shared CPU runs 10–25% slower for minutes) cancels out of the slope; a least-squares fit over
per-length means took each length's mean from a different stretch of time and read that drift as
slope. The level comes from per-length exponentially weighted means (every observation first
multiplies all weights by 1 − beta, then adds weight 1 to its own length): c0 = their weighted mean
minus c1 times the weighted mean length, so it follows the recent blocks. With fewer than two
lengths measured the line is not identified: the slope is `prior_share` of the mean cost per token.
The slope is clamped to [`min_share`, 1] × the mean cost per token, which keeps c0 ≥ 0. Once the
line is identified an observation counts clipped to within ±`HUBER` of the line's value, so one
stall on a loaded machine (tens of ms in a block of any length) moves the line by a bounded step
instead of tilting the slope; a lasting change still moves it, by up to that step per block.

With `residuals`, a cost that is not a line (a verifier whose 1–3-token passes cost about the same and
4-token ones 30% more, as SteerSpec's own on a CPU with out-major weight copies) is modelled as the
line plus a per-length residual: each observation's distance from the line refitted with it, averaged
with the same decaying weights as the per-length means (a length not measured for a while takes a
fresh observation almost whole). A length never measured takes the residual of the nearest measured
one (the lower on a tie), so a step seen at 3 also prices 4 and 5, and the modelled costs are a
running maximum over the lengths (a longer pass never costs less). Residuals are relative to the
line, which follows the host's drift, so they survive it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

MIN_WEIGHT = 1e-12  # a length once measured keeps at least this weight
HUBER = 0.5
MIN_PAIRS = 1e-3  # below this total weight the pair sums are rescaled to one pair


class CostLine:
    """c0 + c1·k from (k, ms) observations, k in 1..max_k."""

    def __init__(self, max_k: int, beta: float, prior: Tuple[float, float], prior_share: float,
                 min_share: float = 0.0, residuals: bool = False) -> None:
        self.max_k, self.beta = int(max_k), float(beta)
        self.residuals = bool(residuals)
        self.residual: List[float] = [0.0] * self.max_k  # per length: observed minus the line, averaged
        self.prior, self.prior_share, self.min_share = prior, float(prior_share), float(min_share)
        self.weight: List[float] = [0.0] * self.max_k
        self.mean: List[float] = [0.0] * self.max_k
        self.pairs = [0.0, 0.0]  # decayed Σ Δk·Δms and Σ Δk² over consecutive blocks of different lengths
        self.last: Tuple[int, float] = (0, 0.0)  # the previous block (length, ms); length 0: none yet
        self.c0, self.c1 = prior

    def lengths(self) -> List[int]:
        """The lengths measured so far (a measured length keeps at least MIN_WEIGHT)."""
        return self.recent_lengths(MIN_WEIGHT)

    def recent_lengths(self, floor: float) -> List[int]:
        """The lengths whose weight is still at least `floor` (measured in the last few blocks)."""
        return [k + 1 for k, w in enumerate(self.weight) if w >= floor]

    def add(self, k: int, ms: float) -> None:
        """One block of k tokens took `ms`."""
        if not 1 <= k <= self.max_k or not ms > 0:
            return
        if len(self.lengths()) >= 2:
            expected = self(k)
            ms = min(max(ms, (1.0 - HUBER) * expected), (1.0 + HUBER) * expected)
        keep = 1.0 - self.beta
        last_k, last_ms = self.last
        self.pairs = [keep * self.pairs[0], keep * self.pairs[1]]
        if 0 < self.pairs[1] < MIN_PAIRS:  # long on one length: the slope so far counts as one pair
            self.pairs = [self.pairs[0] / self.pairs[1], 1.0]
        if last_k and last_k != k:
            dk = k - last_k
            self.pairs = [self.pairs[0] + dk * (ms - last_ms), self.pairs[1] + dk * dk]
        self.last = (k, ms)
        self.weight = [max(w * keep, MIN_WEIGHT) if w > 0 else 0.0 for w in self.weight]
        i = k - 1
        before = self.weight[i]
        self.mean[i] = (before * self.mean[i] + ms) / (before + 1.0)
        self.weight[i] += 1.0
        self._fit()
        self.residual[i] = (before * self.residual[i] + ms - self.line(k)) / (before + 1.0)

    def _fit(self) -> None:
        points = [(k + 1, w, self.mean[k]) for k, w in enumerate(self.weight) if w > 0]
        total = sum(w for _, w, _ in points)
        k_bar = sum(w * k for k, w, _ in points) / total
        y_bar = sum(w * y for _, w, y in points) / total
        per_token = y_bar / k_bar
        if len(points) < 2 or self.pairs[1] <= 0:
            slope = self.prior_share * per_token
        else:
            slope = self.pairs[0] / self.pairs[1]
        self.c1 = min(max(slope, self.min_share * per_token), per_token)
        self.c0 = max(0.0, y_bar - self.c1 * k_bar)

    def line(self, k: int) -> float:
        """c0 + c1·k."""
        return self.c0 + self.c1 * k

    def __call__(self, k: int) -> float:
        """The modelled cost of k tokens (never below 0, never below a shorter length's)."""
        if not self.residuals:
            return max(0.0, self.line(k))
        return self.table()[k - 1]

    def table(self) -> List[float]:
        """The modelled cost of every length 1..max_k, in one pass (what a policy reads per draft). With
        residuals it is made non-decreasing (a running maximum): a longer pass never costs less, and a
        residual measured long ago against another line must not make an unmeasured length look cheap."""
        measured = self.lengths() if self.residuals else []
        costs, m, floor = [], 0, 0.0
        for k in range(1, self.max_k + 1):
            off = 0.0
            if measured:  # the nearest measured length, the lower on a tie
                while m + 1 < len(measured) and abs(measured[m + 1] - k) < abs(measured[m] - k):
                    m += 1
                off = self.residual[measured[m] - 1]
            floor = max(floor, self.line(k) + off)
            costs.append(floor)
        return costs

    def state_dict(self) -> Dict[str, Any]:
        return {"weight": list(self.weight), "mean": list(self.mean), "c": [self.c0, self.c1],
                "pairs": list(self.pairs), "last": list(self.last), "residual": list(self.residual)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        weight, mean = [float(w) for w in state["weight"]], [float(m) for m in state["mean"]]
        if len(weight) != self.max_k or len(mean) != self.max_k:
            raise ValueError(f"cost line has {len(weight)} lengths, policy has max={self.max_k}")
        self.weight, self.mean = weight, mean
        self.c0, self.c1 = (float(c) for c in state["c"])
        self.pairs = [float(x) for x in state.get("pairs", (0.0, 0.0))]
        last = state.get("last", (0, 0.0))
        self.last = (int(last[0]), float(last[1]))
        residual = [float(r) for r in state.get("residual", [0.0] * self.max_k)]
        if len(residual) != self.max_k:
            raise ValueError(f"cost line has {len(residual)} residuals, policy has max={self.max_k}")
        self.residual = residual

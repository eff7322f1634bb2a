"""A block cost as a line in its length, c0 + c1·k, fitted to measured blocks of different lengths.

Per drafted length k the line keeps an exponentially weighted mean of the measured milliseconds
(every observation first multiplies all weights by 1 − beta, then adds weight 1 to its own length).
The fit is weighted least squares over those means, so a length measured long ago still pins the
slope (with a small weight) after the policy settled on one length. With fewer than two lengths
measured the line is not identified: the slope is `prior_share` of the mean cost per token. The
slope is clamped to [`min_share`, 1] × the mean cost per token, which keeps c0 ≥ 0. Once the line
is identified an observation counts clipped to within ±`HUBER` of the line's value, so one stall
on a loaded machine (tens of ms in a block of any length) moves the line by a bounded step
instead of tilting the slope; a lasting change still moves it, by up to that step per block.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

MIN_WEIGHT = 1e-12  # a length once measured keeps at least this weight
HUBER = 0.5


class CostLine:
    """c0 + c1·k from (k, ms) observations, k in 1..max_k."""

    def __init__(self, max_k: int, beta: float, prior: Tuple[float, float], prior_share: float,
                 min_share: float = 0.0) -> None:
        self.max_k, self.beta = int(max_k), float(beta)
        self.prior, self.prior_share, self.min_share = prior, float(prior_share), float(min_share)
        self.weight: List[float] = [0.0] * self.max_k
        self.mean: List[float] = [0.0] * self.max_k
        self.c0, self.c1 = prior

    def lengths(self) -> List[int]:
        """The lengths measured so far."""
        return [k + 1 for k, w in enumerate(self.weight) if w > 0]

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
        self.weight = [max(w * keep, MIN_WEIGHT) if w > 0 else 0.0 for w in self.weight]
        i = k - 1
        self.mean[i] = (self.weight[i] * self.mean[i] + ms) / (self.weight[i] + 1.0)
        self.weight[i] += 1.0
        self._fit()

    def _fit(self) -> None:
        points = [(k + 1, w, self.mean[k]) for k, w in enumerate(self.weight) if w > 0]
        total = sum(w for _, w, _ in points)
        k_bar = sum(w * k for k, w, _ in points) / total
        y_bar = sum(w * y for _, w, y in points) / total
        per_token = y_bar / k_bar
        if len(points) < 2:
            slope = self.prior_share * per_token
        else:
            var = sum(w * (k - k_bar) ** 2 for k, w, _ in points)
            slope = sum(w * (k - k_bar) * (y - y_bar) for k, w, y in points) / var
        self.c1 = min(max(slope, self.min_share * per_token), per_token)
        self.c0 = max(0.0, y_bar - self.c1 * k_bar)

    def __call__(self, k: int) -> float:
        return self.c0 + self.c1 * k

    def state_dict(self) -> Dict[str, Any]:
        return {"weight": list(self.weight), "mean": list(self.mean), "c": [self.c0, self.c1]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        weight, mean = [float(w) for w in state["weight"]], [float(m) for m in state["mean"]]
        if len(weight) != self.max_k or len(mean) != self.max_k:
            raise ValueError(f"cost line has {len(weight)} lengths, policy has max={self.max_k}")
        self.weight, self.mean = weight, mean
        self.c0, self.c1 = (float(c) for c in state["c"])

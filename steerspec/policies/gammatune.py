"""GammaTune and GammaTune+ (training-free adaptive speculation length, Algorithm 1 of the paper).

After each block with A accepted drafts out of γ proposed:
  1. if A == γ: γ <- A + δ                       (expansion when every draft was accepted)
  2. γ̄ <- min(γ_max, max(γ_min, (1-η)·γ̄ + η·A))  (EWMA of the acceptance length, clamped)
  3. γ <- ⌈γ̄⌉
Read literally, line 3 overwrites line 1 before anything uses it, and since A ≤ γ the window
could then never grow; we implement the expansion the paper describes ("expanding in easy
regimes"): on full acceptance the observation fed to the EWMA is γ + δ, i.e. line 2 uses the
expanded window. γ̄ starts at the initial γ.
The next block drafts γ tokens (at least 1). GammaTune+ adds the confidence stop: a block ends
after a draft whose top drafter probability is below τ.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

from steerspec.policies.base import MAX_K, BlockFeedback, DraftStep, PolicyBase, check_k, check_open_unit
from steerspec.policies.catalog import Key, register

_KEYS = {
    "k": Key(int, 5, "initial γ"),
    "eta": Key(float, 0.5, "EWMA weight η of the new acceptance length"),
    "gmin": Key(int, 1, "γ_min"),
    "gmax": Key(int, 24, "γ_max"),
    "delta": Key(int, 2, "expansion δ when every draft was accepted"),
}


@register("gammatune", dict(_KEYS), doc="GammaTune (Algorithm 1)", length_keys=("k", "gmax"))
class GammaTune(PolicyBase):
    """Algorithm 1: expansion by δ on full acceptance, EWMA with η, clamp to [γ_min, γ_max], ceil."""

    name = "gammatune"

    def __init__(self, k: int = 5, eta: float = 0.5, gmin: int = 1, gmax: int = 24, delta: int = 2,
                 context: Optional[Any] = None) -> None:
        self.initial = check_k(k)
        self.eta = check_open_unit(eta, "eta") if eta != 1.0 else 1.0
        self.gmin, self.gmax = check_k(gmin, "gmin"), check_k(gmax, "gmax")
        if self.gmin > self.gmax:
            raise ValueError(f"gmin={gmin} exceeds gmax={gmax}")
        if int(delta) != delta or not 0 <= delta <= MAX_K:
            raise ValueError(f"delta must be an integer in [0, {MAX_K}], got {delta}")
        self.delta = int(delta)
        self.max_k = max(self.gmax, self.initial)
        self.reset()

    def reset(self) -> None:
        self.gamma = self.initial
        self.gamma_bar = float(self.initial)

    def next_k(self) -> int:
        return max(1, self.gamma)

    def update(self, feedback: BlockFeedback) -> None:
        observed = float(feedback.accepted)
        if feedback.drafted > 0 and feedback.accepted == feedback.drafted:  # lines 1-2: expand by δ
            observed = feedback.accepted + self.delta
        self.gamma_bar = min(self.gmax, max(self.gmin, (1 - self.eta) * self.gamma_bar + self.eta * observed))
        self.gamma = math.ceil(self.gamma_bar - 1e-12)

    def state_dict(self) -> Dict[str, Any]:
        return {"gamma": self.gamma, "gamma_bar": self.gamma_bar}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.gamma, self.gamma_bar = int(state["gamma"]), float(state["gamma_bar"])


@register("gammatune+", dict(_KEYS, tau=Key(float, 0.4, "confidence stop τ")), doc="GammaTune+ (confidence stop)")
class GammaTunePlus(GammaTune):
    """GammaTune whose blocks also stop after a draft with top drafter probability below τ."""

    name = "gammatune+"
    stops_early = True

    def __init__(self, tau: float = 0.4, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tau = check_open_unit(tau, "tau")

    def observe(self, step: DraftStep) -> bool:
        return float(step.probs.max()) < self.tau

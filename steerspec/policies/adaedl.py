"""AdaEDL: early draft stopping from an entropy-based lower bound on token acceptance.

After each drafted token with drafter distribution q, the lower bound on its acceptance
probability is LB = 1 - sqrt(γ·H(q)) (H in nats, γ ≈ 0.2); the block stops when LB < λ.
λ adapts from observed acceptance. The AdaEDL paper was not available offline here, so this is
our stated rule, in its spirit (λ tracks how well the bound predicts acceptance): after each
block, with α̂ the block's observed per-token acceptance rate (accepted / drafted) and L̄ the mean
bound over the block's drafts, λ <- clip(λ + ε·(L̄ - α̂), λ_min, λ_max). When drafts are accepted
more often than the bound says, λ falls and blocks grow; when less often, λ rises.
Blocks are at most k long.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch

from steerspec.policies.base import BlockFeedback, DraftStep, PolicyBase, check_k, check_open_unit
from steerspec.policies.catalog import Key, register


def entropy_lower_bound(probs: torch.Tensor, gamma: float) -> float:
    """1 - sqrt(γ·H(q)) for one distribution q [V] (entropy in nats)."""
    p = probs.float().clamp_min(1e-30)
    entropy = float(-(probs.float() * p.log()).sum())
    return 1.0 - math.sqrt(max(gamma * entropy, 0.0))


@register("adaedl", {"lam": Key(float, 0.5, "initial stop threshold λ on the bound"),
                     "gamma": Key(float, 0.2, "entropy scale γ"),
                     "eps": Key(float, 0.05, "λ adaptation step ε"),
                     "k": Key(int, 20, "most tokens per block")},
          doc="AdaEDL: entropy lower-bound stop, λ adapted from acceptance")
class AdaEDL(PolicyBase):
    """Stop when 1 - sqrt(γ·H(q)) < λ; λ moves by ε·(mean bound − observed acceptance) per block."""

    name = "adaedl"
    stops_early = True
    LAMBDA_MIN, LAMBDA_MAX = 0.01, 0.99

    def __init__(self, lam: float = 0.5, gamma: float = 0.2, eps: float = 0.05, k: int = 20,
                 context: Optional[Any] = None) -> None:
        self.initial = check_open_unit(lam, "lam")
        if not gamma > 0:
            raise ValueError(f"gamma must be > 0, got {gamma}")
        self.gamma = float(gamma)
        self.eps = check_open_unit(eps, "eps")
        self.max_k = check_k(k)
        self.reset()

    def reset(self) -> None:
        self.lam = self.initial
        self._bounds: list = []

    def next_k(self) -> int:
        self._bounds = []
        return self.max_k

    def observe(self, step: DraftStep) -> bool:
        bound = entropy_lower_bound(step.probs, self.gamma)
        self._bounds.append(bound)
        return bound < self.lam

    def update(self, feedback: BlockFeedback) -> None:
        if feedback.drafted <= 0 or not self._bounds:
            return
        observed = feedback.accepted / feedback.drafted
        mean_bound = sum(self._bounds) / len(self._bounds)
        self.lam = min(self.LAMBDA_MAX, max(self.LAMBDA_MIN, self.lam + self.eps * (mean_bound - observed)))

    def state_dict(self) -> Dict[str, Any]:
        return {"lam": self.lam}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.lam = float(state["lam"])

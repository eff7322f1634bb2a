"""SPRINTER's theory as pure functions (paper 004, Theorems 1–3), to report beside measurements.

Notation: η_TP is the classifier's true-positive rate (an acceptable token, q(x)/p(x) ≤ λ, is
kept), η_FP its false-positive rate (an unacceptable token is kept). r is the number of
consecutive acceptable draft tokens the drafter would produce before its first unacceptable one.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor


def tv_distance(p: Tensor, q: Tensor) -> Tensor:
    """Total-variation distance ½ Σ |p − q| over the last dim (batched)."""
    return 0.5 * (p - q).abs().sum(-1)


def sprinter_distribution(p: Tensor, q: Tensor, eta_fp: float) -> Tensor:
    """Theorem 1: the distribution SPRINTER samples from, (1 − η_FP)·p + η_FP·q."""
    return (1.0 - eta_fp) * p + eta_fp * q


def tv_bound(eta_fp: float, tv_pq: float) -> float:
    """Theorem 1: d_TV(p, p_SPRINTER) = η_FP · d_TV(p, q), the deviation from the verifier."""
    return float(eta_fp) * float(tv_pq)


def acceptance_rate(eta_fp: float, tv_pq: float) -> float:
    """Theorem 7 (appendix A.4): β_SPRINTER = 1 − (1 − η_FP) · d_TV(p, q)."""
    return 1.0 - (1.0 - float(eta_fp)) * float(tv_pq)


def _check_rates(eta_tp: float, eta_fp: float, r: int) -> None:
    if not (0.0 <= eta_tp <= 1.0 and 0.0 <= eta_fp <= 1.0):
        raise ValueError(f"rates must be in [0, 1], got eta_tp={eta_tp}, eta_fp={eta_fp}")
    if r < 0:
        raise ValueError(f"r must be >= 0, got {r}")


def run_length_survival(eta_tp: float, eta_fp: float, r: int, i: int) -> float:
    """P(N ≥ i): the classifier keeps the first i tokens (η_TP per acceptable, η_FP per unacceptable one)."""
    _check_rates(eta_tp, eta_fp, r)
    if i <= r:
        return eta_tp ** i
    return eta_tp ** r * eta_fp ** (i - r)


def run_length_pmf(eta_tp: float, eta_fp: float, r: int, n_max: int) -> List[float]:
    """Theorem 2: P(N = i) for i = 0..n_max (η_TP^i(1−η_TP) for i < r, η_TP^r η_FP^(i−r)(1−η_FP) after)."""
    return [run_length_survival(eta_tp, eta_fp, r, i) - run_length_survival(eta_tp, eta_fp, r, i + 1)
            for i in range(n_max + 1)]


def expected_run_length(eta_tp: float, eta_fp: float, r: int, max_run: Optional[int] = None) -> float:
    """Theorem 2: E[N], the tokens kept before the classifier first predicts a rejection.

    Closed form, equal to the paper's eq. 3: (η_TP − η_TP^(r+1))/(1 − η_TP) + η_TP^r·η_FP/(1 − η_FP).
    With `max_run`, E[min(N, max_run)] (our runs are capped), summed exactly.
    """
    _check_rates(eta_tp, eta_fp, r)
    if max_run is not None:
        return sum(run_length_survival(eta_tp, eta_fp, r, i) for i in range(1, max_run + 1))
    if eta_fp >= 1.0:
        return float("inf")
    head = r if eta_tp >= 1.0 else (eta_tp - eta_tp ** (r + 1)) / (1.0 - eta_tp)
    return head + eta_tp ** r * eta_fp / (1.0 - eta_fp)


def expected_stop_time(eta_tp: float, eta_fp: float, r: int, t_draft: float, max_run: Optional[int] = None) -> float:
    """Theorem 3: E[T_stop] = t_d·(1 − η_TP^r)/(1 − η_TP) + t_d·η_TP^r/(1 − η_FP), i.e. t_d·(E[N] + 1)."""
    return float(t_draft) * (expected_run_length(eta_tp, eta_fp, r, max_run) + 1.0)


def mean_expected_run_length(eta_tp: float, eta_fp: float, rs: List[int], max_run: Optional[int] = None) -> float:
    """Theorem 2 averaged over measured r's (one per run), to set beside the measured mean run length."""
    if not rs:
        return 0.0
    return sum(expected_run_length(eta_tp, eta_fp, r, max_run) for r in rs) / len(rs)


def first_token_distribution(p: Tensor, q: Tensor, keep: Tensor) -> Tensor:
    """The exact distribution of SPRINTER's next committed token at one prefix (batched over rows).

    p, q [..., V]: the verifier's and the drafter's distributions; keep [..., V] in [0, 1]: whether
    (or how likely) the head keeps each candidate x. A kept draft is committed as is; any other is
    checked by min(1, p/q) and replaced from norm(max(0, p − q)) on rejection. keep ≡ 0 gives p.
    """
    ratio = torch.where(q > 0, (p / q.clamp_min(1e-30)).clamp(max=1.0), torch.zeros_like(q))
    checked = q * (1.0 - keep)
    rejected = (checked * (1.0 - ratio)).sum(-1, keepdim=True)
    residual = (p - q).clamp(min=0.0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)
    return q * keep + checked * ratio + rejected * residual

"""SPRINTER's classifier inputs and labels (pure torch, batched, drafter-side only).

Features per draft token x, all from the drafter: its hidden state entering the last decoder
layer at the position that sampled x, the input embedding of x, q(x), log q(x) and the entropy
of the drafter's warped distribution. Label: x is acceptable when q(x)/p(x) ≤ λ (paper §A.5).
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

SCALARS = 3  # q(x), log q(x), entropy


def feature_dim(hidden_size: int) -> int:
    """Width of one feature row: hidden + embedding + the scalar features."""
    return 2 * hidden_size + SCALARS


def entropy(probs: Tensor) -> Tensor:
    """Shannon entropy (nats) of probs [..., V] over the last dim."""
    logp = probs.clamp_min(1e-30).log()
    return -(probs * logp).sum(-1)


def build_features(hidden: Tensor, token_embed: Tensor, q_x: Tensor, q_entropy: Tensor) -> Tensor:
    """[..., 2D + 3] from hidden [..., D], embedding of x [..., D], q(x) [...] and H(q) [...]."""
    q_x = q_x.to(hidden.dtype)
    scalars = torch.stack([q_x, q_x.clamp_min(1e-12).log(), q_entropy.to(hidden.dtype)], dim=-1)
    return torch.cat([hidden, token_embed.to(hidden.dtype), scalars], dim=-1)


def acceptable(q_x: Tensor, p_x: Tensor, lam: float = 1.0) -> Tensor:
    """Label: q(x)/p(x) ≤ λ (written q ≤ λ·p so p = 0 is unacceptable unless q = 0)."""
    return q_x <= lam * p_x


def soft_target(ratio: Tensor, lam: float = 1.0) -> Tensor:
    """The soft label min(1, λ·p(x)/q(x)) from the ratio q/p: at λ = 1 the probability that the exact rule
    accepts x. Equals 1 exactly where `acceptable` holds, and shrinks with how far q over-produces x."""
    return (lam / ratio.float().clamp_min(1e-30)).clamp(max=1.0)


def moved_mass(q_x: Tensor, p_x: Tensor) -> Tensor:
    """1 − min(1, p(x)/q(x)): the mass keeping x unverified moves off the verifier's distribution. Its mean over
    x ~ q weighted by the keep rule is exactly d_TV(p, SPRINTER's distribution) at that position."""
    return (1.0 - p_x / q_x.clamp_min(1e-30)).clamp_min(0.0)


def confusion(predicted: Tensor, label: Tensor) -> Tuple[int, int, int, int]:
    """(TP, FN, FP, TN) with positive = acceptable: predicted keep on an acceptable token is a TP."""
    predicted, label = predicted.bool(), label.bool()
    return (int((predicted & label).sum()), int((~predicted & label).sum()),
            int((predicted & ~label).sum()), int((~predicted & ~label).sum()))


def rates(tp: int, fn: int, fp: int, tn: int) -> Tuple[float, float]:
    """(η_TP, η_FP): kept fraction of acceptable and of unacceptable tokens (0 when none)."""
    eta_tp = tp / (tp + fn) if tp + fn else 0.0
    eta_fp = fp / (fp + tn) if fp + tn else 0.0
    return eta_tp, eta_fp


def roc_auc(scores: Tensor, labels: Tensor) -> float:
    """Area under the ROC curve (Mann–Whitney with tied ranks averaged); 0.5 when one class is absent."""
    scores = scores.double().flatten()
    labels = labels.bool().flatten()
    pos, neg = int(labels.sum()), int((~labels).sum())
    if pos == 0 or neg == 0:
        return 0.5
    order = scores.argsort()
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    uniq, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    if len(uniq) < len(scores):  # average the ranks of ties
        starts = torch.cumsum(counts, 0) - counts
        mean_rank = starts.double() + (counts.double() + 1) / 2
        ranks[order] = mean_rank[inverse]
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def roc_curve(scores: Tensor, labels: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """(false-positive rates, true-positive rates, thresholds) sweeping the threshold down."""
    scores = scores.double().flatten()
    labels = labels.bool().flatten()
    order = scores.argsort(descending=True)
    s, y = scores[order], labels[order]
    tps = torch.cumsum(y.double(), 0)
    fps = torch.cumsum((~y).double(), 0)
    last = torch.ones_like(s, dtype=torch.bool)
    last[:-1] = s[1:] != s[:-1]
    pos, neg = max(float(y.sum()), 1.0), max(float((~y).sum()), 1.0)
    zero = torch.zeros(1, dtype=torch.float64)
    return (torch.cat([zero, fps[last] / neg]), torch.cat([zero, tps[last] / pos]),
            torch.cat([torch.full((1,), float("inf"), dtype=torch.float64), s[last]]))

"""SPRINTER's labels of one run and their tally: what η_TP, η_FP and the theorems are measured from.

A run's tokens are labelled from the verifier's rows of its one pass (acceptable: q(x)/p(x) ≤ λ;
greedy: x is p's argmax) against the classifier's keep flags. In-process decoding labels each run
itself; the verifier service labels it and sends the counts (VerifyResult.sprinter), and the
coordinator tallies them, so both report the same figures from the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from steerspec.decoding.speculative import DraftBlock
from steerspec.sprinter import features as F
from steerspec.sprinter import theory


@dataclass
class RunLabels:
    """One run's confusion counts, r (acceptable tokens before the first unacceptable), Σ d_TV(p, q) and the
    mass its kept tokens moved, Σ_kept 1 − min(1, p(x)/q(x))."""

    tp: int = 0
    fn: int = 0
    fp: int = 0
    tn: int = 0
    r: int = 0
    tv_pq_sum: float = 0.0
    moved_sum: float = 0.0

    @property
    def labelled(self) -> int:
        return self.tp + self.fn + self.fp + self.tn


def label_run(block: DraftBlock, kept: Sequence[bool], probs, logits, vocab: int, lam: float = 1.0
              ) -> Optional[RunLabels]:
    """Label the run's j tokens from the verifier's probs/logits [≥ j, V] (probs None when greedy); None if j = 0."""
    j = int(block.tokens.shape[1])
    if j == 0:
        return None
    tokens = block.tokens[0].to(logits.device)
    if probs is None:  # greedy: acceptable means the verifier's argmax
        label = logits[:j].argmax(-1) == tokens
        moved = (~label).float()  # greedy: the exact rule keeps x or moves all of its mass
        q_dense = torch.nn.functional.one_hot(tokens, vocab).float()
        p_dense = torch.nn.functional.one_hot(logits[:j].argmax(-1), vocab).float()
    else:
        q = block.q.map(lambda t: t[0].to(logits.device))
        q_x = q.prob_of(tokens)
        p_x = probs[:j].gather(-1, tokens.view(-1, 1)).squeeze(-1)
        label = F.acceptable(q_x, p_x.to(q_x.dtype), lam)
        moved = F.moved_mass(q_x.float(), p_x.float())
        q_dense, p_dense = q.to_dense(vocab).float(), probs[:j].float()
    predicted = torch.tensor(list(kept), dtype=torch.bool, device=label.device)
    tp, fn, fp, tn = F.confusion(predicted, label)
    bad = (~label).nonzero()
    return RunLabels(tp=tp, fn=fn, fp=fp, tn=tn, r=int(bad[0]) if len(bad) else j,
                     tv_pq_sum=float(theory.tv_distance(p_dense, q_dense).sum()),
                     moved_sum=float((moved * predicted.float()).sum()))


@dataclass
class SprinterTally:
    """Labels and run lengths summed over a generation's runs -> the measured rates and the theorems."""

    max_run: int
    tp: int = 0
    fn: int = 0
    fp: int = 0
    tn: int = 0
    tv_pq_sum: float = 0.0  # Σ d_TV(p, q) over the labelled tokens (Theorem 1's factor)
    moved_sum: float = 0.0  # Σ over kept tokens of 1 − min(1, p/q): the measured deviation Theorem 1 bounds
    labelled: int = 0
    run_lengths: List[int] = field(default_factory=list)  # tokens the classifier kept, per run
    run_r: List[int] = field(default_factory=list)  # per labelled run: acceptable tokens before the first unacceptable

    def _add_counts(self, other) -> None:
        """Add another record's confusion counts, Σ d_TV and labelled total (a RunLabels or a tally)."""
        self.tp, self.fn, self.fp, self.tn = (self.tp + other.tp, self.fn + other.fn, self.fp + other.fp,
                                              self.tn + other.tn)
        self.tv_pq_sum += other.tv_pq_sum
        self.moved_sum += other.moved_sum
        self.labelled += other.labelled

    def add_labels(self, labels: Optional[RunLabels]) -> None:
        if labels is None:
            return
        self._add_counts(labels)
        self.run_r.append(labels.r)

    @classmethod
    def pooled(cls, tallies: Sequence["SprinterTally"], max_run: int) -> "SprinterTally":
        """One tally over several generations' runs (their counts summed, their runs in order)."""
        out = cls(max_run=max_run)
        for t in tallies:
            out._add_counts(t)
            out.run_lengths.extend(t.run_lengths)
            out.run_r.extend(t.run_r)
        return out

    @property
    def eta(self) -> tuple:
        return F.rates(self.tp, self.fn, self.fp, self.tn)

    def theory(self) -> Dict[str, float]:
        """Measured η's, Theorem 1's TV bound and Theorems 2–3's run length beside the measured one."""
        eta_tp, eta_fp = self.eta
        tv_pq = self.tv_pq_sum / self.labelled if self.labelled else 0.0
        mean_run = sum(self.run_lengths) / len(self.run_lengths) if self.run_lengths else 0.0
        expected = theory.mean_expected_run_length(eta_tp, eta_fp, self.run_r, self.max_run)
        return {"eta_tp": round(eta_tp, 6), "eta_fp": round(eta_fp, 6), "tv_pq": round(tv_pq, 6),
                "tv_bound": round(theory.tv_bound(eta_fp, tv_pq), 6),
                "tv_measured": round(self.moved_sum / self.labelled if self.labelled else 0.0, 6),
                "mean_run_length": round(mean_run, 6), "expected_run_length": round(expected, 6)}


def theory_line(t: Dict[str, float]) -> str:
    """`SprinterTally.theory()` on one line (the summaries' LOSSY line)."""
    return (f"eta_tp={t['eta_tp']:.3f} eta_fp={t['eta_fp']:.3f} tv_bound={t['tv_bound']:.4f} "
            f"tv_measured={t['tv_measured']:.4f} "
            f"run_length={t['mean_run_length']:.2f} (theorem 2: {t['expected_run_length']:.2f})")

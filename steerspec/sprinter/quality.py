"""The verifier's perplexity of a decoder's text, with a control variate that makes it resolvable.

A raw perplexity ratio between two samplers at T = 1 is dominated by which continuations the seeds
happened to draw. At each committed token the NLL exact decoding would have *in expectation at the
same prefix* is known in closed form, E_{x~p_T}[−log p(x)] (the verifier's entropy at T = 1), so
log ppl_ratio = (excess NLL per token at the same prefixes) + (the shift in that baseline between the
prefixes each decoder visits). The first term is ≈ 0 for any lossless decoder with little noise; the
second is what remains noisy. Pure functions; the bench runs the verifier.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Dict, Sequence, Tuple

import torch
from torch import Tensor

from steerspec.decoding.sampling import SamplingParams, probs_from_logits

Z95 = 1.959964  # two-sided 95% normal quantile


def token_nll_and_baseline(logits: Tensor, tokens: Tensor, params: SamplingParams) -> Tuple[Tensor, Tensor]:
    """Per position of logits [N, V] (each predicting tokens [N]): the verifier's NLL (T = 1) of the
    committed token, and its expectation had the token been drawn by exact decoding, E_{x~p_T}[−log p(x)]."""
    logp = logits.float().log_softmax(-1)
    nll = -logp.gather(-1, tokens.view(-1, 1).to(logp.device))[:, 0]
    p_t = probs_from_logits(logits.float(), params.temperature, params.top_k, params.top_p)
    baseline = -torch.where(p_t > 0, p_t * logp, torch.zeros_like(logp)).sum(-1)
    return nll, baseline


@dataclass(frozen=True)
class SequenceQuality:
    """One generated sequence's sums (token-weighted pooling keeps long sequences from counting once)."""

    tokens: int
    nll: float
    baseline: float

    @property
    def excess(self) -> float:
        return self.nll - self.baseline


def summarise(seq: Sequence[SequenceQuality]) -> SequenceQuality:
    """Pooled sums over sequences."""
    return SequenceQuality(sum(s.tokens for s in seq), sum(s.nll for s in seq), sum(s.baseline for s in seq))


def _per_token(s: SequenceQuality, field: str) -> float:
    return getattr(s, field) / s.tokens


def _log_ratio(rows: Sequence[SequenceQuality], ref: Sequence[SequenceQuality] | None, field: str) -> Tuple[float, float]:
    """Pooled per-token `field` of rows (minus ref's, paired by index) and the standard error of that
    difference from the per-sequence values (sequences with no tokens in either are left out of the SE)."""
    pooled = summarise(rows)
    value = getattr(pooled, field) / max(1, pooled.tokens)
    if ref is None:
        diffs = [_per_token(a, field) for a in rows if a.tokens]
    else:
        if len(ref) != len(rows):
            raise ValueError(f"paired rows need equal lengths, got {len(rows)} and {len(ref)}")
        base = summarise(ref)
        value -= getattr(base, field) / max(1, base.tokens)
        diffs = [_per_token(a, field) - _per_token(b, field) for a, b in zip(rows, ref) if a.tokens and b.tokens]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("inf")
    return value, se


def quality_ratios(rows: Sequence[SequenceQuality], exact: Sequence[SequenceQuality]) -> Dict[str, float]:
    """Perplexity ratios against exact decoding on the same prompts and seeds, each with a 95% interval:
    `ppl_ratio` (raw, paired by sequence), `ppl_excess` (exp of the mean excess NLL at the same prefixes;
    1 in expectation for a lossless decoder) and `ppl_drift` (the baseline's shift; raw ≈ excess · drift
    up to the token weighting of exact's own excess)."""
    out: Dict[str, float] = {}
    for key, ref, field in (("ppl_ratio", exact, "nll"), ("ppl_excess", None, "excess"),
                            ("ppl_drift", exact, "baseline")):
        value, se = _log_ratio(rows, ref, field)
        out[key] = math.exp(value)
        out[f"{key}_low"] = math.exp(value - Z95 * se)
        out[f"{key}_high"] = math.exp(value + Z95 * se)
    return out

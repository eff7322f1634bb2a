"""Tune Pacer's (b, t, ρ) on labelled blocks of the training split (`steerspec train pacer`).

Pacer's paper tunes its block size b, threshold t and growth ρ per setting (its Table 10). Here
the held-out labelled blocks (training-split prompts the head did not see) are replayed offline:
for each candidate, Pacer's stop rule runs on the head's predicted acceptances of every block's
drafts, giving a stop length n; the block then commits min(L, n) + 1 tokens (L = the drafts the
verifier accepted) and costs n·d + v0 + v1·(n + 1) + rtt ms, with d, v0, v1 measured on the
pair. The candidate with the most committed tokens per ms wins; fixed k is replayed the same way
so the report shows the best fixed k under the same model. Pure tensor math apart from
`measure_costs`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Dict, Iterable, List, Sequence, Tuple

import torch

B_GRID = (1, 2, 3, 4)
T_GRID = tuple(round(0.05 * i, 2) for i in range(1, 20))  # 0.05 .. 0.95
RHO_GRID = (1.0, 1.05, 1.1, 1.2)


@dataclass(frozen=True)
class BlockCost:
    """Milliseconds of one block: `draft_ms` per draft, verify `v0 + v1·tokens`, plus a fixed `rtt_ms`."""

    draft_ms: float
    v0: float
    v1: float
    rtt_ms: float = 0.0

    def block_ms(self, n: torch.Tensor) -> torch.Tensor:
        return n * self.draft_ms + self.v0 + self.v1 * (n + 1) + self.rtt_ms


def stop_lengths(acceptance: torch.Tensor, b: int, t: float, rho: float, cap: int) -> torch.Tensor:
    """Pacer's stop rule on predicted acceptances [N, γ]: rounds of b drafts, stop after a round whose
    mean ≤ t (t·ρ after each round that continues), or at `cap`; returns the drafts per block [N]."""
    n_blocks, gamma = acceptance.shape
    cap = min(cap, gamma)
    stop = torch.full((n_blocks,), cap, dtype=torch.long)
    open_ = torch.ones(n_blocks, dtype=torch.bool)
    threshold = t
    for end in range(b, cap + 1, b):
        low = acceptance[:, end - b:end].mean(dim=1) <= threshold
        hit = open_ & low
        stop[hit] = end
        open_ &= ~low
        threshold *= rho
    return stop


def tokens_per_ms(stop: torch.Tensor, accepted: torch.Tensor, cost: BlockCost) -> float:
    """Committed tokens (min(L, n) + 1 per block) over the blocks' modelled time."""
    committed = torch.minimum(accepted, stop).float() + 1.0
    return float(committed.sum() / cost.block_ms(stop.float()).sum())


def tune(acceptance: torch.Tensor, accepted: torch.Tensor, cost: BlockCost, cap: int,
         b_grid: Iterable[int] = B_GRID, t_grid: Iterable[float] = T_GRID,
         rho_grid: Iterable[float] = RHO_GRID) -> Dict[str, float]:
    """The (b, t, ρ) with the most committed tokens per ms, its rate and stop length, and the best
    fixed k replayed under the same model (ties go to the earlier, i.e. smaller, setting)."""
    best: Tuple[float, int, float, float] = (-1.0, 0, 0.0, 0.0)
    for b in b_grid:
        for t in t_grid:
            for rho in rho_grid:
                rate = tokens_per_ms(stop_lengths(acceptance, b, t, rho, cap), accepted, cost)
                if rate > best[0] + 1e-12:
                    best = (rate, b, t, rho)
    rate, b, t, rho = best
    mean_n = float(stop_lengths(acceptance, b, t, rho, cap).float().mean())
    fixed = {k: tokens_per_ms(torch.full_like(accepted, k), accepted, cost) for k in range(1, cap + 1)}
    best_k = max(fixed, key=lambda k: (fixed[k], -k))
    return {"b": b, "t": t, "rho": rho, "tokens_per_s": round(1000 * rate, 4), "mean_drafts": round(mean_n, 3),
            "best_fixed_k": best_k, "best_fixed_tokens_per_s": round(1000 * fixed[best_k], 4),
            "gain_over_best_fixed": round(rate / fixed[best_k], 4)}


def _median_ms(fn, repeats: int) -> float:
    times: List[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


@torch.inference_mode()
def measure_costs(verifier, drafter, prompt: Sequence[int], repeats: int = 9, rtt_ms: float = 0.0) -> BlockCost:
    """One drafter step and verify passes of 1 and 9 tokens after `prompt`, median ms (CachedLMs)."""
    prompt = list(prompt)
    for lm in (verifier, drafter):
        lm.reset()
        lm.extend(prompt)
    n = len(prompt)
    token = prompt[-1]

    def step(lm, count: int):
        def run() -> None:
            lm.extend([token] * count)
            lm.rollback(n)
        return run

    step(verifier, 9)()  # warm-up
    draft_ms = _median_ms(step(drafter, 1), 3 * repeats)
    one, nine = _median_ms(step(verifier, 1), repeats), _median_ms(step(verifier, 9), repeats)
    v1 = max(0.0, (nine - one) / 8)
    return BlockCost(draft_ms=draft_ms, v0=max(0.0, one - v1), v1=v1, rtt_ms=rtt_ms)

"""Tune Pacer's (b, t, ρ) on labelled blocks of the training split (`steerspec train pacer`).

Pacer's paper tunes its block size b, threshold t and growth ρ per setting (its Table 10). Here
held-out training-split prompts (the head never saw them) are replayed offline. For each
candidate, Pacer's stop rule runs on the head's predicted acceptances of a block's drafts, giving a
stop length n; the block then commits min(L, n) + 1 tokens (L = the drafts the verifier accepted)
and costs n·d + ⌈n/b⌉·r + V(n + 1) + rtt ms, with d (a draft step of the real draft loop), r (one
pass of the Pacer layer) and V (a verify pass, per token count) measured on the pair. `tune` pools
independent blocks, or, given `chains`, replays greedy decoding itself: with a block labelled at *every* answer
position, each prompt's blocks are chained as decoding chains them (the next block starts where the
last one's committed tokens end), so the blocks scored are the ones decoding meets, not a uniform
sample of positions. Fixed k is replayed the same way; the candidate whose worst gain over the best
fixed k across the given costs (one per network RTT; with one cost, simply the most committed
tokens per ms) is highest wins. Pure tensor math apart from `measure_costs`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from steerspec.decoding.engine import draft_block
from steerspec.decoding.rounds import DecodeConfig

B_GRID = (1, 2, 3, 4)
T_GRID = tuple(round(0.05 * i, 2) for i in range(1, 20))  # 0.05 .. 0.95
RHO_GRID = (1.0, 1.05, 1.1, 1.2)


@dataclass(frozen=True)
class BlockCost:
    """Milliseconds of one block: `draft_ms` per draft, `round_ms` per pass of a stop head over a round
    of b drafts, the verify pass of n + 1 tokens, plus a fixed `rtt_ms`. The verify pass costs
    `verify_ms[tokens - 1]` where measured (a verifier's cost need not be a line: SteerSpec's on a CPU is
    about flat for 1–3 tokens, where its out-major weight copies serve, and a step dearer from 4), else
    `v0 + v1·tokens`, shifted to meet the last measured length."""

    draft_ms: float
    v0: float
    v1: float
    rtt_ms: float = 0.0
    round_ms: float = 0.0
    verify_ms: Tuple[float, ...] = ()

    def verify(self, tokens: torch.Tensor) -> torch.Tensor:
        """Modelled ms of verify passes of `tokens` tokens (elementwise)."""
        if not self.verify_ms:
            return self.v0 + self.v1 * tokens
        table = torch.tensor(self.verify_ms, dtype=torch.float32)
        measured = len(self.verify_ms)
        index = tokens.long().clamp(1, measured) - 1
        beyond = table[-1] + self.v1 * (tokens - measured)
        return torch.where(tokens <= measured, table[index], beyond)

    def block_ms(self, n: torch.Tensor, b: int = 0) -> torch.Tensor:
        """b = 0: no stop head runs (fixed k)."""
        rounds = torch.div(n + b - 1, b, rounding_mode="floor") if b else 0
        return n * self.draft_ms + rounds * self.round_ms + self.verify(n + 1) + self.rtt_ms


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


def tokens_per_ms(stop: torch.Tensor, accepted: torch.Tensor, cost: BlockCost, b: int = 0) -> float:
    """Committed tokens (min(L, n) + 1 per block) over the blocks' modelled time."""
    committed = torch.minimum(accepted, stop).float() + 1.0
    return float(committed.sum() / cost.block_ms(stop.float(), b).sum())


def decoding_chains(prompt: torch.Tensor) -> List[Tuple[int, int]]:
    """(first row, rows) of each prompt's blocks, for blocks labelled at every answer position in order."""
    chains: List[Tuple[int, int]] = []
    ids = prompt.tolist()
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            chains.append((start, i - start))
            start = i
    return chains


def visited(stop: torch.Tensor, accepted: torch.Tensor, chains: Sequence[Tuple[int, int]]) -> torch.Tensor:
    """Rows greedy decoding drafts from: per chain, the block at offset 0, then the block at the
    offset where the last one's min(L, n) + 1 committed tokens end, until the chain runs out."""
    take = (torch.minimum(accepted, stop) + 1).tolist()
    rows: List[int] = []
    for first, count in chains:
        offset = 0
        while offset < count:
            rows.append(first + offset)
            offset += take[first + offset]
    return torch.tensor(rows, dtype=torch.long)


def _scored(stop, accepted, chains) -> Tuple[torch.Tensor, torch.Tensor]:
    """(stop, accepted) of the blocks that count: every block (chains None) or those decoding visits
    (the walk depends on the stop lengths only, not on the cost, so it runs once per candidate)."""
    if chains is None:
        return stop, accepted
    rows = visited(stop, accepted, chains)
    return stop[rows], accepted[rows]


def tune(acceptance: torch.Tensor, accepted: torch.Tensor, cost: Union[BlockCost, Sequence[BlockCost]], cap: int,
         b_grid: Iterable[int] = B_GRID, t_grid: Iterable[float] = T_GRID,
         rho_grid: Iterable[float] = RHO_GRID,
         chains: Optional[Sequence[Tuple[int, int]]] = None) -> Dict[str, Any]:
    """The (b, t, ρ) whose worst gain over the best fixed k (replayed under the same model) across the
    given costs (e.g. one per network RTT) is highest; with one cost, the most committed tokens per ms
    (ties go to the earlier, i.e. smaller, setting). With `chains` (see `decoding_chains`) only the
    blocks greedy decoding would visit count. Per cost: the rate, the best fixed k and its rate; `blocks`:
    the blocks the chosen setting is scored on."""
    costs = [cost] if isinstance(cost, BlockCost) else list(cost)

    def rates(stop: torch.Tensor, b: int) -> List[float]:  # tokens per ms under each cost
        n, a = _scored(stop, accepted, chains)
        return [tokens_per_ms(n, a, c, b) for c in costs]

    by_k = {k: rates(torch.full_like(accepted, k), 0) for k in range(1, cap + 1)}
    best_k = [max(by_k, key=lambda k, i=i: (by_k[k][i], -k)) for i in range(len(costs))]
    best_fixed = [by_k[k][i] for i, k in enumerate(best_k)]
    best: Tuple[float, int, float, float] = (-1.0, 0, 0.0, 0.0)
    for b in b_grid:
        for t in t_grid:
            for rho in rho_grid:
                gain = min(r / f for r, f in zip(rates(stop_lengths(acceptance, b, t, rho, cap), b), best_fixed))
                if gain > best[0] + 1e-12:
                    best = (gain, b, t, rho)
    gain, b, t, rho = best
    stop = stop_lengths(acceptance, b, t, rho, cap)
    per_cost = [{"rtt_ms": c.rtt_ms, "tokens_per_s": round(1000 * r, 4), "best_fixed_k": k,
                 "best_fixed_tokens_per_s": round(1000 * f, 4), "gain": round(r / f, 4)}
                for c, r, k, f in zip(costs, rates(stop, b), best_k, best_fixed)]
    drafts = _scored(stop, accepted, chains)[0]
    return {"b": b, "t": t, "rho": rho, "mean_drafts": round(float(drafts.float().mean()), 3), "blocks": len(drafts),
            "gain_over_best_fixed": round(gain, 4), **{key: per_cost[0][key] for key in
                                                        ("tokens_per_s", "best_fixed_k", "best_fixed_tokens_per_s")},
            "per_rtt": per_cost, "replay": "decoding" if chains is not None else "blocks"}


def nondecreasing(values: Sequence[float]) -> List[float]:
    """The least-squares non-decreasing fit (pool adjacent violators): a longer verify pass never costs
    less, so a count measured below a shorter one is host noise, averaged with its neighbours."""
    blocks: List[List[float]] = []  # [sum, count] of pooled runs
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def _ms(fn) -> float:
    """Milliseconds of one call of `fn`."""
    start = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - start)


def _median_ms(fn, repeats: int) -> float:
    return statistics.median(_ms(fn) for _ in range(repeats))


@torch.inference_mode()
def measure_costs(verifier, drafter, prompt: Sequence[int], repeats: int = 9,
                  stop_head: Optional[Callable[[], object]] = None, tokens: int = 9) -> BlockCost:
    """Median ms of a draft step in the real draft loop (a greedy block of 8, per draft), a verify pass
    of every 1..`tokens` tokens after `prompt` (CachedLMs; the counts interleaved, then made
    non-decreasing; v0 + v1·t through the 1- and `tokens`-token passes), and one call of `stop_head` (a
    policy's head) if given; no network (add one per RTT with `dataclasses.replace(cost, rtt_ms=...)`)."""
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

    config = DecodeConfig(max_new_tokens=64, eos_token_ids=())

    def block() -> None:  # decoding's shape: the pending token is fed, then 8 drafts
        drafter.rollback(n - 1)
        draft_block(drafter, prompt, 8, config)

    tokens = max(2, int(tokens))
    for count in (2, 3, tokens):  # warm-up (each layout's plans)
        step(verifier, count)()
    block()
    draft_ms = _median_ms(block, repeats) / 8
    passes = [step(verifier, count) for count in range(1, tokens + 1)]
    times: List[List[float]] = [[] for _ in passes]
    for _ in range(repeats):  # interleaved, so a drift of the host's speed reaches every count alike
        for run, into in zip(passes, times):
            into.append(_ms(run))
    verify_ms = tuple(nondecreasing([statistics.median(t) for t in times]))
    v1 = max(0.0, (verify_ms[-1] - verify_ms[0]) / (tokens - 1))
    round_ms = _median_ms(stop_head, 3 * repeats) if stop_head is not None else 0.0
    return BlockCost(draft_ms=draft_ms, v0=max(0.0, verify_ms[0] - v1), v1=v1, round_ms=round_ms,
                     verify_ms=verify_ms)

"""The one draft loop: blocks for several sessions with one forward pass per draft step.

The drafter service drafts its sessions' blocks here; the in-process engine's `draft_block` is a
batch of one through the same loop.

Each row is one session (its own cache, committed sequence, k, sampling parameters, generator
and policy). Step 0 feeds committed[lm.length:]: rows whose feed is one token join the batched
pass; a longer feed (a new prompt, or the last draft plus the bonus token) runs alone first.
Later steps feed each row its last draft. A row leaves the batch when its block is complete
(its own k) or its policy stops early.

Per row the result is what a batch of one gives for that session alone: the same warping, top-K
truncation and sampling from the row's *own* generator in the same order of draws. Only the
batched matmuls differ from the single-row ones (~1e-6 in the logits; see models/batched.py).

Policies (steerspec/policies/base.py): a stopping policy sees each drafted token with the drafter's
distribution exactly as the sampler used it (temperature/top-k/top-p warped; greedy rows: the
temperature-1 softmax under the same top-k/top-p) and, when it declares `needs_hidden`, the
drafter's final hidden state at the position that produced the token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Generator, List, Optional, Sequence, Tuple, TypeVar

import torch
from torch import Tensor

from steerspec.decoding import fastpath
from steerspec.decoding.rounds import DecodeConfig
from steerspec.decoding.sampling import SparseDist, draft_distribution, probs_from_logits, sample_sparse
from steerspec.decoding.speculative import DraftBlock
from steerspec.models.batched import batched_extend, first_logits
from steerspec.models.kv import CachedLM
from steerspec.policies.base import DraftLengthPolicy, DraftStep


@dataclass
class DraftRow:
    """One session's part of a batched draft (the arguments of `draft_block`)."""

    lm: CachedLM
    committed: Sequence[int]
    k: int
    config: DecodeConfig
    generator: Optional[torch.Generator] = None
    policy: Optional[DraftLengthPolicy] = None
    first_logits: Optional[Tensor] = None  # [1, V] when the caller already fed committed[lm.length:]


@dataclass
class _Drafted:
    """What one row has drafted so far."""

    tokens: List[Tensor]
    q_rows: List[SparseDist]
    stopped: bool = False


def _sampling_key(config: DecodeConfig) -> Tuple[float, int, float, int, bool]:
    params = config.sampling
    return params.temperature, params.top_k, params.top_p, config.draft_top_k, config.draft_tail


def _choose(rows: Sequence[DraftRow], logits: Tensor, step: int, drafted: Sequence[_Drafted]) -> Tensor:
    """Pick one token per row from logits [A, V] exactly as `draft_block` does; returns tokens [A]."""
    tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    groups: Dict[Optional[Tuple], List[int]] = {}
    for j, row in enumerate(rows):
        groups.setdefault(None if row.config.greedy else _sampling_key(row.config), []).append(j)
    for key, members in groups.items():
        sub = logits if len(members) == len(rows) else logits[members]
        if key is None:
            chosen = sub.argmax(-1)
            tokens[members] = chosen
            for r, j in enumerate(members):
                params = rows[j].config.sampling
                _maybe_stop(rows[j], drafted[j], step, chosen[r],
                            lambda: probs_from_logits(sub[r : r + 1], 1.0, params.top_k, params.top_p)[0])
            continue
        temperature, top_k, top_p, draft_top_k, draft_tail = key
        probs_full = probs_from_logits(sub, temperature, top_k, top_p)
        dist = draft_distribution(probs_full, draft_top_k, draft_tail)
        for r, j in enumerate(members):
            own = dist.map(lambda t: t[r : r + 1])
            token = sample_sparse(own, rows[j].generator)  # [1], from this row's generator only
            tokens[j : j + 1] = token
            drafted[j].q_rows.append(own)
            _maybe_stop(rows[j], drafted[j], step, token[0], lambda: probs_full[r])
    return tokens


def _wants_hidden(row: DraftRow) -> bool:
    policy = row.policy
    return policy is not None and getattr(policy, "stops_early", False) and getattr(policy, "needs_hidden", False)


def _maybe_stop(row: DraftRow, drafted: _Drafted, step: int, token: Tensor, probs) -> None:
    """Ask a stopping policy after draft `step` (probs built only then; hidden when it needs it)."""
    policy = row.policy
    if policy is not None and getattr(policy, "stops_early", False) and step + 1 < row.k:
        hidden = row.lm.last_hidden if _wants_hidden(row) else None
        drafted.stopped = bool(policy.observe(DraftStep(step, int(token), probs(), hidden)))


T = TypeVar("T")
Steps = Generator[None, None, T]  # yields between forward passes, returns the result


def drive(steps: "Steps[T]") -> T:
    """Run a step generator (`draft_block_steps`, `tree_decoding.draft_tree_steps`) to its end; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def draft_blocks(rows: Sequence[DraftRow]) -> List[DraftBlock]:
    """Every row's next block at once; returns one batch-1 DraftBlock per row."""
    if fastpath.applies_any(rows):  # device sampling, one host copy (CUDA); stopping policies stay here
        return fastpath.draft_blocks_split(rows, draft_blocks)
    return drive(draft_block_steps(rows))


def draft_block_steps(rows: Sequence[DraftRow]) -> "Steps[List[DraftBlock]]":
    """`draft_blocks` on the host, yielding after each forward pass (drafting ahead runs it so that real requests
    go first: drafter_service/ahead.py); the same draws in the same order."""
    for row in rows:
        row.lm.keep_last_hidden = _wants_hidden(row)
    drafted = [_Drafted([], []) for _ in rows]
    active = [i for i, row in enumerate(rows) if row.k > 0]
    step = 0
    logits = first_logits(rows, active) if active else None
    if active:
        yield
    while active:
        tokens = _choose([rows[i] for i in active], logits, step, [drafted[i] for i in active])
        for a, i in enumerate(active):
            drafted[i].tokens.append(tokens[a : a + 1])
        keep = [a for a, i in enumerate(active) if len(drafted[i].tokens) < rows[i].k and not drafted[i].stopped]
        if not keep:
            break
        feed = tokens if len(keep) == len(active) else tokens[keep]
        active = [active[a] for a in keep]
        logits = batched_extend([rows[i].lm for i in active], feed)
        step += 1
        yield
    return [_block(row, d) for row, d in zip(rows, drafted)]


def _block(row: DraftRow, drafted: _Drafted) -> DraftBlock:
    """This row's drafts as a batch-1 DraftBlock (q None when greedy)."""
    device = row.lm.device
    if drafted.tokens:
        tokens = torch.cat(drafted.tokens).view(1, -1)
    else:
        tokens = torch.zeros(1, 0, dtype=torch.long, device=device)
    q = None
    if not row.config.greedy and drafted.tokens:
        q = SparseDist.stack(drafted.q_rows, dim=1)
    return DraftBlock(tokens=tokens, lengths=torch.tensor([len(drafted.tokens)], device=device), q=q)

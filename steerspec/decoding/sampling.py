"""Logits warping and sampling shared by drafter and verifier (pure torch, batched, no I/O).

Both sides must warp identically: exact speculative sampling compares the verifier's warped
distribution p with the drafter's (top-K truncated) distribution q.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Union

import torch
from torch import Tensor

Generators = Union[torch.Generator, Sequence[torch.Generator], None]
MAX_DRAFT_TOP_K = 1024


MIN_TEMPERATURE = 1e-5  # below this (as vLLM's sampling epsilon) only 0 = greedy makes sense


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen: temperature 0 is greedy; top_k 0 and top_p 1 disable those filters."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> "SamplingParams":
        """Raise ValueError with an actionable message when a parameter is out of range."""
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:  # logits / T would overflow to inf, then NaN
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, "
                             f"got {self.temperature:g}")
        if self.temperature > 100.0:
            raise ValueError(f"temperature must be at most 100, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0 (0 = off), got {self.top_k}")
        return self


@dataclass
class SparseDist:
    """A distribution over the vocabulary kept on its support: ids [..., S] and probs [..., S].

    `floor` [...] is the probability of each of the `vocab` − S tokens *not* listed (the
    drafter's tail mass spread evenly; None = 0). Unused support slots carry probability 0.
    This is what a sampling drafter sends on the wire.
    """

    ids: Tensor
    probs: Tensor
    floor: Optional[Tensor] = None
    vocab: int = 0

    def map(self, fn: Callable[[Tensor], Tensor]) -> "SparseDist":
        """The same distribution with `fn` applied to each tensor (row selection, device moves)."""
        floor = None if self.floor is None else fn(self.floor.unsqueeze(-1)).squeeze(-1)
        return SparseDist(ids=fn(self.ids), probs=fn(self.probs), floor=floor, vocab=self.vocab)

    @staticmethod
    def stack(dists: Sequence["SparseDist"], dim: int) -> "SparseDist":
        """Stack distributions of equal support along a new leading dim `dim` (< ids.dim())."""
        floors = [d.floor for d in dists]
        floor = None if any(f is None for f in floors) else torch.stack(floors, dim=dim)
        return SparseDist(ids=torch.stack([d.ids for d in dists], dim=dim),
                          probs=torch.stack([d.probs for d in dists], dim=dim), floor=floor, vocab=dists[0].vocab)

    def to_dense(self, vocab_size: int) -> Tensor:
        """Scatter back into [..., V] (duplicated ids add up; unlisted ids get the floor)."""
        dense = torch.zeros(*self.ids.shape[:-1], vocab_size, dtype=self.probs.dtype, device=self.probs.device)
        dense.scatter_add_(-1, self.ids, self.probs)
        if self.floor is not None:
            listed = torch.zeros_like(dense, dtype=torch.bool).scatter_(-1, self.ids, True)
            dense = torch.where(listed, dense, self.floor.unsqueeze(-1).to(dense.dtype))
        return dense

    def prob_of(self, tokens: Tensor) -> Tensor:
        """Probability of `tokens` [...] under this distribution."""
        hit = self.ids == tokens.unsqueeze(-1)
        listed = (self.probs * hit).sum(-1)
        if self.floor is None:
            return listed
        return torch.where(hit.any(-1), listed, self.floor.to(listed.dtype))


def renormalise(probs: Tensor) -> Tensor:
    """Divide each row [..., S] by its sum."""
    return probs / probs.sum(-1, keepdim=True)


def fp16_down(probs: Tensor) -> Tensor:
    """Quantise probabilities (>= 0) to fp16 rounding toward zero, so a row never gains mass."""
    half = probs.to(torch.float16)
    return torch.where(half.float() > probs, torch.nextafter(half, torch.zeros_like(half)), half)


def wire_dist(ids: Tensor, weights: Tensor, vocab: int) -> SparseDist:
    """The distribution a sparse row of fp16 weights denotes, identically on both sides of the wire.

    Listed ids get their weight; the mass left below 1 is spread evenly over the vocab − S unlisted
    ids. Rows summing above 1 are scaled to 1, and so is every row when all ids are listed (no tail
    takes what fp16 rounded off). Sums run in float64, where adding fp16 values is exact in any
    order, so drafter and verifier derive the same bits from the same bytes.
    """
    weights = weights.float()
    total = weights.sum(-1, dtype=torch.float64)
    unlisted = vocab - ids.shape[-1]
    divisor = total.clamp(min=1.0) if unlisted > 0 else total
    probs = weights
    if bool((divisor != 1.0).any()):  # dividing by 1 changes nothing, so only such rows pay for it
        probs = (weights.double() / divisor.unsqueeze(-1)).float()
    if unlisted > 0:
        floor = torch.sub(1.0, total).clamp_(min=0.0).div_(unlisted).float()
    else:
        floor = torch.zeros_like(total, dtype=torch.float32)
    return SparseDist(ids=ids, probs=probs, floor=floor, vocab=vocab)


def fp16_roundtrip(dist: SparseDist, vocab: int) -> SparseDist:
    """The distribution the wire carries: probs quantised to fp16 (toward zero), then `wire_dist`.

    A sampling drafter samples from this, in-process too, so drafter and verifier use the
    identical q and a seed gives the same tokens whichever transport runs the session.
    """
    return wire_dist(dist.ids, fp16_down(dist.probs).float(), vocab)


def draft_distribution(probs: Tensor, draft_top_k: int, tail: bool = True) -> SparseDist:
    """What a sampling drafter proposes from its warped probs [..., V]: the top `draft_top_k`
    (0 = all) on the wire, with the rest of its mass spread evenly over the other tokens
    (`tail`, the default: more overlap with p at no extra bytes) or renormalised away."""
    return fp16_roundtrip(truncate_top_k(probs, draft_top_k, renormalise_kept=not tail), probs.shape[-1])


def _as_rows(value: Union[float, int, Tensor], like: Tensor, dtype: torch.dtype) -> Tensor:
    """Broadcast a scalar or per-row parameter to logits.shape[:-1] + (1,)."""
    t = torch.as_tensor(value, dtype=dtype, device=like.device)
    while t.dim() < like.dim() - 1:
        t = t.unsqueeze(-1)
    return t.expand(like.shape[:-1]).unsqueeze(-1)


def warp_logits(
    logits: Tensor,
    temperature: Union[float, Tensor] = 1.0,
    top_k: Union[int, Tensor] = 0,
    top_p: Union[float, Tensor] = 1.0,
) -> Tensor:
    """Apply temperature, top-k and top-p to logits [..., V]; removed tokens get -inf.

    Parameters are scalars or per-row tensors (leading dims of `logits`). Rows with temperature 0
    keep only their argmax, so their softmax is the one-hot greedy distribution.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    temp = _as_rows(temperature, logits, torch.float32)
    greedy = temp <= 0
    out = logits / torch.where(greedy, torch.ones_like(temp), temp)
    neg_inf = torch.tensor(float("-inf"), device=logits.device)

    k = _as_rows(top_k, logits, torch.long).clamp(min=0, max=vocab)
    if bool((k > 0).any()):
        sorted_desc = out.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(-1, (k - 1).clamp(min=0))
        out = torch.where((k > 0) & (out < kth), neg_inf, out)

    p = _as_rows(top_p, logits, torch.float32)
    if bool((p < 1.0).any()):
        sorted_logits, order = out.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
        drop_sorted = (before >= p) & (p < 1.0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))

    if bool(greedy.any()):
        onehot = torch.full_like(out, float("-inf")).scatter(-1, logits.argmax(-1, keepdim=True), 0.0)
        out = torch.where(greedy, onehot, out)
    return out


def probs_from_logits(
    logits: Tensor,
    temperature: Union[float, Tensor] = 1.0,
    top_k: Union[int, Tensor] = 0,
    top_p: Union[float, Tensor] = 1.0,
) -> Tensor:
    """Warped probabilities [..., V] in float32 (one-hot for greedy rows)."""
    return warp_logits(logits, temperature, top_k, top_p).softmax(-1)


def truncate_top_k(probs: Tensor, draft_top_k: int, renormalise_kept: bool = True) -> SparseDist:
    """Keep the `draft_top_k` most likely tokens of probs [..., V] (0 = full vocabulary), renormalised
    unless `renormalise_kept` is False (then the dropped mass is left for `wire_dist` to spread)."""
    vocab = probs.shape[-1]
    if draft_top_k <= 0 or draft_top_k >= vocab:
        ids = torch.arange(vocab, device=probs.device).expand(probs.shape).contiguous()
        return SparseDist(ids=ids, probs=renormalise(probs))
    top = probs.topk(draft_top_k, dim=-1)
    kept = top.values
    return SparseDist(ids=top.indices, probs=renormalise(kept) if renormalise_kept else kept)


def row_generators(generator: Generators, rows: int) -> list:
    if generator is None or isinstance(generator, torch.Generator):
        return [generator] * rows
    gens = list(generator)
    if len(gens) != rows:
        raise ValueError(f"need one generator per row: {rows} rows, {len(gens)} generators")
    return gens


def uniform(shape: Sequence[int], generator: Generators = None, device: Union[str, torch.device] = "cpu") -> Tensor:
    """U[0, 1) of `shape`; with a list of generators, row i of dim 0 draws from generator i."""
    shape = tuple(shape)
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(shape, generator=generator, device=device)
    gens = row_generators(generator, shape[0])
    return torch.stack([torch.rand(shape[1:], generator=g, device=device) for g in gens])


def sample(probs: Tensor, generator: Generators = None) -> Tensor:
    """Draw one token per row from probs [B, V] (rows need not be normalised)."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    gens = row_generators(generator, probs.shape[0])
    return torch.cat([torch.multinomial(probs[i : i + 1], 1, generator=g).squeeze(-1) for i, g in enumerate(gens)])


def sample_sparse(dist: SparseDist, generator: Generators = None) -> Tensor:
    """Draw one token id per row from a sparse distribution with ids/probs [B, S] (and its floor)."""
    if dist.floor is not None:
        return _sample_with_tail(dist, generator)
    slot = sample(dist.probs, generator)
    return dist.ids.gather(-1, slot.unsqueeze(-1)).squeeze(-1)


def _sample_with_tail(dist: SparseDist, generator: Generators) -> Tensor:
    """Draw over the listed ids plus one slot for the whole tail; rows that land on the tail then
    draw uniformly among the vocab − S unlisted ids (cheaper than a multinomial over the vocabulary)."""
    support = dist.ids.shape[-1]
    unlisted = dist.vocab - support
    slot = sample(torch.cat([dist.probs, dist.floor.mul(unlisted).unsqueeze(-1)], dim=-1), generator)
    flat, rows = slot.reshape(-1), dist.ids.reshape(-1, support)
    if flat.numel() == 1:  # one row, how a drafter samples: Python ints are cheaper than tensor ops
        tails = [0] if int(flat) == support else []
        token = rows[:, min(int(flat), support - 1)].clone()
    else:
        tails = torch.nonzero(flat == support).squeeze(-1).tolist()
        token = rows.gather(-1, flat.clamp(max=support - 1).unsqueeze(-1)).squeeze(-1)
    gens = row_generators(generator, flat.numel()) if tails else []
    for row in tails:
        u = float(torch.rand((), generator=gens[row], device=flat.device))
        token[row] = _unlisted(rows[row].tolist(), u, unlisted)
    return token.reshape(slot.shape)


def _unlisted(listed: List[int], u: float, unlisted: int) -> int:
    """The unlisted id at uniform position u ∈ [0, 1): the r-th id not in `listed`, r = ⌊u·unlisted⌋."""
    token = min(int(u * unlisted), unlisted - 1)
    for taken in sorted(listed):  # each listed id at or below the answer pushes it up by one
        if taken > token:
            break
        token += 1
    return token

"""Logits warping and sampling shared by drafter and verifier (pure torch, batched, no I/O).

Both sides must warp identically: exact speculative sampling compares the verifier's warped
distribution p with the drafter's (top-K truncated) distribution q.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch
from torch import Tensor

Generators = Union[torch.Generator, Sequence[torch.Generator], None]
MAX_DRAFT_TOP_K = 1024


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
        if self.temperature > 100.0:
            raise ValueError(f"temperature must be at most 100, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0 (0 = off), got {self.top_k}")
        return self


@dataclass
class SparseDist:
    """A distribution over the vocabulary kept on its support only: ids [..., S] and probs [..., S].

    Unused support slots carry probability 0. This is what a sampling drafter sends on the wire.
    """

    ids: Tensor
    probs: Tensor

    def to_dense(self, vocab_size: int) -> Tensor:
        """Scatter back into [..., V] (duplicated ids add up)."""
        dense = torch.zeros(*self.ids.shape[:-1], vocab_size, dtype=self.probs.dtype, device=self.probs.device)
        return dense.scatter_add_(-1, self.ids, self.probs)

    def prob_of(self, tokens: Tensor) -> Tensor:
        """Probability of `tokens` [...] under this distribution."""
        hit = self.ids == tokens.unsqueeze(-1)
        return (self.probs * hit).sum(-1)


def renormalise(probs: Tensor) -> Tensor:
    """Divide each row [..., S] by its sum (the same op on both sides of the wire)."""
    return probs / probs.sum(-1, keepdim=True)


def fp16_roundtrip(dist: SparseDist) -> SparseDist:
    """The distribution the wire carries: probs quantised to fp16, back to float32, renormalised.

    A sampling drafter samples from this, in-process too, so drafter and verifier use the
    identical q and a seed gives the same tokens whichever transport runs the session.
    """
    return SparseDist(ids=dist.ids, probs=renormalise(dist.probs.to(torch.float16).float()))


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


def truncate_top_k(probs: Tensor, draft_top_k: int) -> SparseDist:
    """Keep the `draft_top_k` most likely tokens of probs [..., V] and renormalise; 0 = full vocabulary."""
    vocab = probs.shape[-1]
    if draft_top_k <= 0 or draft_top_k >= vocab:
        ids = torch.arange(vocab, device=probs.device).expand(probs.shape).contiguous()
        return SparseDist(ids=ids, probs=probs / probs.sum(-1, keepdim=True))
    top = probs.topk(draft_top_k, dim=-1)
    kept = top.values
    return SparseDist(ids=top.indices, probs=kept / kept.sum(-1, keepdim=True))


def _row_generators(generator: Generators, rows: int) -> list:
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
    gens = _row_generators(generator, shape[0])
    return torch.stack([torch.rand(shape[1:], generator=g, device=device) for g in gens])


def sample(probs: Tensor, generator: Generators = None) -> Tensor:
    """Draw one token per row from probs [B, V] (rows need not be normalised)."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    gens = _row_generators(generator, probs.shape[0])
    return torch.cat([torch.multinomial(probs[i : i + 1], 1, generator=g).squeeze(-1) for i, g in enumerate(gens)])


def sample_sparse(dist: SparseDist, generator: Generators = None) -> Tensor:
    """Draw one token id per row from a sparse distribution with ids/probs [B, S]."""
    slot = sample(dist.probs, generator)
    return dist.ids.gather(-1, slot.unsqueeze(-1)).squeeze(-1)

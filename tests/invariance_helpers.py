"""Checks that a verify pass gives each row bit for bit the logits one-token decoding gives it (batch invariance)."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from steerspec.models.batched import packed_extend
from steerspec.models.kv import FastCachedLM

PASS_ROWS = tuple(range(1, 18)) + (65,)


def decode_one_by_one(model, ids: Sequence[int]) -> torch.Tensor:
    """Logits [len(ids), V] of one-token decoding: each token fed alone after the ones before it."""
    lm = FastCachedLM(model, capacity=len(ids))
    return torch.cat([lm.extend([t]).logits for t in ids])


def verify_pass_differences(model, seed: int = 0, rows: Sequence[int] = PASS_ROWS, length: int = 100) -> int:
    """Over random tokens: for each pass size n at a random cache length (cached by a prefill pass), how many rows of
    the n-row pass (and of the prefill) differ from one-token decoding's logits for the same position."""
    gen = torch.Generator().manual_seed(seed)
    vocab = int(model.config.vocab_size)
    longest = max(rows)
    ids = torch.randint(0, vocab, (length + longest,), generator=gen).tolist()
    reference = decode_one_by_one(model, ids)
    lm = FastCachedLM(model)
    differing = 0
    for n in rows:
        start = int(torch.randint(1, length, (), generator=gen))
        lm.reset()
        prefill = lm.extend(ids[:start]).logits
        differing += int((prefill != reference[:start]).any(-1).sum())
        out = lm.extend(ids[start:start + n]).logits
        differing += int((out != reference[start:start + n]).any(-1).sum())
    return differing


def random_tree(n: int, gen: torch.Generator) -> List[int]:
    """Parents of n tree tokens (-1: a child of the pending root's position), each before its children."""
    return [-1] + [int(torch.randint(-1, i, (), generator=gen)) for i in range(1, n)]


def ancestry(parents: Sequence[int]) -> Tuple[torch.Tensor, List[List[int]]]:
    """([n, n] bool: token i sees token j, itself included), each token's path from the root (its ancestors, itself last)."""
    n = len(parents)
    visible = torch.zeros(n, n, dtype=torch.bool)
    paths = []
    for i in range(n):
        path, j = [], i
        while j >= 0:
            visible[i, j] = True
            path.append(j)
            j = parents[j]
        paths.append(path[::-1])
    return visible, paths


def packed_differences(model, sessions: int, seed: int = 0, trees: bool = True, longest: int = 80) -> int:
    """Sessions of random prefixes packed into one pass, each feeding a chain or (every other one) a random tree: how
    many rows differ from one-token decoding of that row's own path."""
    gen = torch.Generator().manual_seed(seed)
    vocab = int(model.config.vocab_size)
    lms, feeds, masks, wants = [], [], [], []
    for s in range(sessions):
        start = int(torch.randint(1, longest, (), generator=gen))
        n = int(torch.randint(1, 18, (), generator=gen))
        prefix = torch.randint(0, vocab, (start,), generator=gen).tolist()
        feed = torch.randint(0, vocab, (n,), generator=gen).tolist()
        lm = FastCachedLM(model)
        lm.extend(prefix)
        if trees and s % 2:
            visible, paths = ancestry(random_tree(n, gen))
            depth = torch.tensor([len(p) - 1 for p in paths])
            mask = torch.cat([torch.ones(n, start, dtype=torch.bool), visible], dim=1)
            masks.append((start + depth, mask))
            wants.append((prefix, [[feed[j] for j in path] for path in paths]))
        else:
            masks.append(None)
            wants.append((prefix, [feed[: i + 1] for i in range(n)]))
        lms.append(lm)
        feeds.append(feed)
    outs = packed_extend(lms, feeds, None, masks)
    differing = 0
    for out, (prefix, paths) in zip(outs, wants):
        reference = FastCachedLM(model)
        for t in prefix:  # one token at a time, then each row's path the same way
            reference.extend([t])
        for i, path in enumerate(paths):
            reference.rollback(len(prefix))
            for t in path:
                last = reference.extend([t]).logits[0]
            differing += int(not torch.equal(out.logits[i], last))
    return differing


def with_invariance(model, plan) -> Optional[object]:
    """Set `model`'s invariant plan (None: off); returns the previous one."""
    from steerspec.models.invariant_pass import invariant_plan, set_invariant

    previous = invariant_plan(model)
    set_invariant(model, plan)
    return previous

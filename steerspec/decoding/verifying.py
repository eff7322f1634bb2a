"""The one verify path's acceptance: blocks of several sessions accepted or rejected together.

The in-process engine (`engine.verify_block`, a batch of one) and the verifier service's batcher
(verifier_service/verify_batcher.py, one row per session in the batch) both call `accept`. Greedy rows
compare argmaxes in one `greedy_verify`; sampling rows go through ONE `rejection_sample` call (ONE
`block_verify` call for those of sessions that asked for block verification) with one generator per
row, each row drawing exactly what it would draw alone (k uniforms, then one
token), so a seeded session's output never depends on who shared its batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from steerspec.decoding.block_verify import block_verify
from steerspec.decoding.sampling import SamplingParams, SparseDist, probs_from_logits
from steerspec.decoding.speculative import DraftBlock, VerifyOutcome, greedy_verify, rejection_sample


@dataclass
class VerifyRow:
    """One session's block as the verifier scored it."""

    logits: Tensor  # [>= k+1, V]: row i scores draft i, row k the bonus (later rows are ignored)
    tokens: Tensor  # [k] draft ids
    q: Optional[SparseDist]  # the drafter's distribution, ids/probs [k, S] (None: greedy drafts)
    sampling: SamplingParams
    generator: Optional[torch.Generator] = None
    acceptance: str = "token"  # sampled rows: "token" (speculative sampling) or "block" (block verification)


def _pad_q(q: Optional[SparseDist], k: int, width: int, support: int, vocab: int, dtype) -> SparseDist:
    """Row q [k, S] padded to [width, support]: extra slots repeat the row's first id with probability 0
    (so `prob_of` and `to_dense` are unchanged), extra positions are never read (past the row's k)."""
    ids = torch.zeros(width, support, dtype=torch.long)
    probs = torch.zeros(width, support, dtype=dtype)
    floor = torch.zeros(width, dtype=dtype)
    if q is not None and k:
        s = q.ids.shape[-1]
        ids = ids.to(q.ids.device)
        probs, floor = probs.to(q.probs.device), floor.to(q.probs.device)
        ids[:k, :s] = q.ids
        ids[:k, s:] = q.ids[:, :1]
        probs[:k, :s] = q.probs.to(dtype)
        if q.floor is not None:
            floor[:k] = q.floor.to(dtype)
    return SparseDist(ids=ids, probs=probs, floor=floor, vocab=vocab)


def _sampled(rows: Sequence[VerifyRow]) -> VerifyOutcome:
    """Rejection sampling for sampling rows: one call, one generator per row."""
    device = rows[0].logits.device
    ks = [int(r.tokens.numel()) for r in rows]
    width = max(ks)
    probs = [probs_from_logits(r.logits[: k + 1].unsqueeze(0), r.sampling.temperature, r.sampling.top_k,
                               r.sampling.top_p)[0] for r, k in zip(rows, ks)]
    target = probs[0].new_zeros(len(rows), width + 1, probs[0].shape[-1])
    tokens = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    for i, (p, r, k) in enumerate(zip(probs, rows, ks)):
        target[i, : k + 1] = p
        tokens[i, :k] = r.tokens.to(device)
    q = None
    with_q = [r.q for r in rows if r.q is not None]
    if with_q and width:
        if len(rows) == 1:
            q = with_q[0].map(lambda t: t.unsqueeze(0).to(device))
        else:
            support = max(d.ids.shape[-1] for d in with_q)
            dtype = with_q[0].probs.dtype
            for d in with_q[1:]:
                dtype = torch.promote_types(dtype, d.probs.dtype)
            vocab = with_q[0].vocab
            padded = [_pad_q(r.q, k, width, support, vocab, dtype) for r, k in zip(rows, ks)]
            floors = [d.floor for d in with_q]
            q = SparseDist.stack(padded, dim=0).map(lambda t: t.to(device))
            if any(f is None for f in floors):
                q = SparseDist(ids=q.ids, probs=q.probs, floor=None, vocab=vocab)
    block = DraftBlock(tokens=tokens, lengths=torch.tensor(ks, device=device), q=q)
    generators = rows[0].generator if len(rows) == 1 else [r.generator for r in rows]
    rule = block_verify if rows[0].acceptance == "block" else rejection_sample
    return rule(target, block, generators)


def accept(rows: Sequence[VerifyRow]) -> VerifyOutcome:
    """Accepted counts, next tokens and bonus flags [B] for every row's block."""
    batch = len(rows)
    accepted = [0] * batch
    next_tokens = [0] * batch
    is_bonus = [False] * batch
    unknown = {r.acceptance for r in rows} - {"token", "block"}
    if unknown:
        raise ValueError(f"unknown acceptance rule(s) {sorted(unknown)}: use 'token' or 'block'")
    for greedy, rule in ((True, None), (False, "token"), (False, "block")):
        members = [i for i, r in enumerate(rows) if r.sampling.greedy == greedy and (greedy or r.acceptance == rule)]
        if not members:
            continue
        if greedy:
            outcome = _greedy([rows[i] for i in members])
        else:
            outcome = _sampled([rows[i] for i in members])
        if batch == len(members):
            return outcome
        for r, i in enumerate(members):
            accepted[i] = int(outcome.accepted[r])
            next_tokens[i] = int(outcome.next_tokens[r])
            is_bonus[i] = bool(outcome.is_bonus[r])
    return VerifyOutcome(accepted=torch.tensor(accepted), next_tokens=torch.tensor(next_tokens),
                         is_bonus=torch.tensor(is_bonus))


def _greedy(rows: Sequence[VerifyRow]) -> VerifyOutcome:
    """Greedy rows: accept while the draft equals the verifier's argmax (one call)."""
    ks = [int(r.tokens.numel()) for r in rows]
    width = max(ks)
    logits = torch.stack([r.logits[: width + 1] if r.logits.shape[0] >= width + 1 else
                          torch.cat([r.logits, r.logits.new_zeros(width + 1 - r.logits.shape[0], r.logits.shape[-1])])
                          for r in rows])
    tokens = torch.zeros(len(rows), width, dtype=torch.long, device=logits.device)
    for i, (r, k) in enumerate(zip(rows, ks)):
        tokens[i, :k] = r.tokens.to(logits.device)
    return greedy_verify(logits, DraftBlock(tokens=tokens, lengths=torch.tensor(ks, device=logits.device)))


def outcome_lists(outcome: VerifyOutcome) -> List[tuple]:
    """Per row (accepted, next_token, is_bonus) as Python values."""
    return list(zip((int(a) for a in outcome.accepted.tolist()), (int(t) for t in outcome.next_tokens.tolist()),
                    (bool(b) for b in outcome.is_bonus.tolist())))

"""A chain: k drafts, each drawn after the previous one, verified in one pass of k + 1 rows.

Drafting is `steerspec.decoding.drafting.draft_blocks` (one batched forward pass per draft step, each session as
if alone; `engine.draft_block` for a lone session); verification is one packed pass over every chain session's
rows (`models.batched.packed_extend` on lean caches, transformers' padded pass otherwise, `fastpath.verify_blocks`
on the device path) and `verifying.accept` per session with its own generator, so seeded sampling does not
depend on who shared the batch.
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from steerspec.blocks.block_kind import BlockKind, DraftOutput, JobResult, Verdict, register_kind
from steerspec.decoding import fastpath, verifying
from steerspec.decoding.drafting import draft_block_steps, draft_blocks
from steerspec.decoding.outcomes import Outcome, chain_outcomes, log_probs
from steerspec.decoding.engine import DecodeConfig, draft_block, speculative_generate
from steerspec.decoding.speculative import DraftBlock
from steerspec.decoding.verifying import VerifyRow
from steerspec.models.batched import can_batch, packed_extend
from steerspec.models.kv import FastCachedLM


@register_kind
class ChainKind(BlockKind):
    """Up to k drafts in a row (k from the session's draft-length policy)."""

    name = "chain"

    # -- the drafter service -----------------------------------------------------------------------------
    def draft(self, drafter, sessions: Sequence) -> List[DraftOutput]:
        if len(sessions) == 1 or not can_batch([s.lm for s in sessions]):
            return [self.draft_one(drafter, session) for session in sessions]
        start = time.perf_counter()
        try:
            blocks = draft_blocks([drafter.chain_row(session) for session in sessions])
        finally:
            for session in sessions:
                session.lm.set_up_bias(None)
        drafter.sync()
        return [drafter.output(block, start, len(sessions)) for block in blocks]

    def draft_one(self, drafter, session) -> DraftOutput:
        """One session's block alone (`engine.draft_block`, steered through the drafter's hooks)."""
        start = time.perf_counter()
        k = drafter.block_length(session)
        drafter.steer(session)
        try:
            block = draft_block(session.lm, session.committed, k,
                                DecodeConfig(sampling=session.params, draft_top_k=session.draft_top_k),
                                session.generator, session.policy)
        finally:
            drafter.unsteer()
        drafter.sync()
        return drafter.output(block, start)

    def draft_steps(self, drafter, sessions):
        """The blocks `draft` drafts, one batched forward pass per step (steered through each cache's up_bias, so
        no global hook stays set across a yield)."""
        start = time.perf_counter()
        try:
            rows = [drafter.chain_row(session) for session in sessions]
            if fastpath.applies_any(rows) or not can_batch([s.lm for s in sessions]):
                blocks = draft_blocks(rows) if can_batch([s.lm for s in sessions]) else \
                    [draft_blocks([row])[0] for row in rows]
            else:
                blocks = yield from draft_block_steps(rows)
        finally:
            for session in sessions:
                session.lm.set_up_bias(None)
        drafter.sync()
        return [drafter.output(block, start, len(sessions)) for block in blocks]

    def outcomes(self, drafter, session, limit: int) -> List[Outcome]:
        """The likeliest (accepted, next token) of the chain in flight, from one drafter pass over
        [pending, drafts...] (`Drafter.rescore`)."""
        drafts = session.proposal.draft_ids
        logits = drafter.rescore(session, [session.committed[-1], *drafts])
        if logits is None:
            return []
        return chain_outcomes(log_probs(logits, session.params.temperature), drafts, limit)

    def feedback(self, drafter, session, verdict: Verdict) -> None:
        """Commit, roll back, and tell the session's draft-length policy how the block fared."""
        drafted = len(session.proposal.draft_ids)
        super().feedback(drafter, session, verdict)
        if verdict.timing is not None and (drafted or getattr(session.policy, "min_k", 1) == 0):  # empty blocks carry the load
            session.policy.update(verdict.timing)

    # -- the verifier service ----------------------------------------------------------------------------
    @torch.inference_mode()
    def verify(self, runner, jobs: Sequence) -> List[JobResult]:
        if on_device(jobs) and all(job.session.acceptance == "token" for job in jobs):
            return verify_on_device(runner, jobs)
        start = time.perf_counter()
        batch = len(jobs)
        feeds = [[job.session.pending, *job.block.draft_ids.tolist()] for job in jobs]
        want_hidden = runner.head is not None and any(job.session.steering for job in jobs)
        packed = all(isinstance(job.session.lm, FastCachedLM) for job in jobs)
        hidden_states = new_kv = outs = None
        if packed:
            outs = packed_extend([job.session.lm for job in jobs], feeds,
                                 runner.head_layers() if want_hidden else None)
            logits: Sequence[Tensor] = [out.logits for out in outs]
        elif batch == 1:
            logits, hidden_states = runner.forward_single(jobs[0].session, feeds[0], want_hidden)
        else:
            logits, hidden_states, new_kv = runner.forward_batch(jobs, feeds, want_hidden)
        accepted, next_tokens, is_bonus = accept(jobs, logits)
        steering: List[Optional[Tensor]] = [None] * batch
        if want_hidden:
            if packed:  # [B, L, D] at each row's new-pending position
                g = runner.steering_vectors(torch.stack([out.hidden[:, a] for out, a in zip(outs, accepted)]))
            else:
                g = runner.steering(hidden_states, torch.arange(batch), torch.tensor(accepted))
            steering = [g[i] if job.session.steering else None for i, job in enumerate(jobs)]
        # keep the accepted positions: the verifier cache ends at committed + a (pending excluded)
        for i, job in enumerate(jobs):
            session = job.session
            if session.closed:
                continue
            if new_kv is None:  # fed pending + k drafts onto n - 1 cached tokens; keep n + a
                session.lm.rollback(session.committed + accepted[i])
            else:
                cache = session.lm.cache
                for layer, (k, v) in enumerate(new_kv):
                    cache.update(k[i : i + 1, :, : accepted[i] + 1], v[i : i + 1, :, : accepted[i] + 1], layer)
                session.lm.length += accepted[i] + 1
        runner.sync()
        verify_ms = (time.perf_counter() - start) * 1e3
        return [JobResult(accepted=accepted[i], next_token=next_tokens[i], is_bonus=is_bonus[i], steering=steering[i],
                          queue_ms=(start - job.submitted) * 1e3, verify_ms=verify_ms, batch_size=batch)
                for i, job in enumerate(jobs)]

    # -- in process --------------------------------------------------------------------------------------
    def generate(self, verifier, drafter, prompt_ids, config, mode, *, policy=None, steering=None, tokenizer=None,
                 on_round=None, head=None):
        return speculative_generate(verifier, drafter, prompt_ids, config, policy, steering=steering,
                                    tokenizer=tokenizer, on_round=on_round)


def accept(jobs: Sequence, logits: Sequence[Tensor]):
    """Every session's acceptance in one call (steerspec/decoding/verifying.py; one generator per row)."""
    rows = []
    for i, job in enumerate(jobs):
        q = job.block.q if not job.session.greedy else None
        device = logits[i].device
        rows.append(VerifyRow(logits[i], torch.from_numpy(job.block.draft_ids).to(device),
                              None if q is None else q.map(lambda t: t.to(device)),
                              job.session.params, job.session.generator, job.session.acceptance))
    outcome = verifying.accept(rows)
    return outcome.accepted.tolist(), outcome.next_tokens.tolist(), outcome.is_bonus.tolist()


def on_device(jobs: Sequence) -> bool:
    """True when every session's cache takes the device path (`fastpath.enabled`: CUDA by default)."""
    return bool(jobs) and all(isinstance(job.session.lm, FastCachedLM) and fastpath.enabled(job.session.lm.device)
                              for job in jobs)


@torch.inference_mode()
def verify_on_device(runner, jobs: Sequence) -> List[JobResult]:
    """Chains on the device path: one forward pass, acceptance on the device, one host copy per batch."""
    start = time.perf_counter()
    want_hidden = runner.head is not None and any(job.session.steering for job in jobs)
    blocks = []
    for job in jobs:
        k = job.block.k
        q = None if job.block.q is None else job.block.q.map(lambda t: t.unsqueeze(0))
        blocks.append(DraftBlock(tokens=torch.from_numpy(job.block.draft_ids).view(1, k).long(),
                                 lengths=torch.tensor([k]), q=q))
    sessions = [job.session for job in jobs]
    results, states = fastpath.verify_blocks([s.lm for s in sessions], [s.pending for s in sessions], blocks,
                                             [s.params for s in sessions], [s.generator for s in sessions],
                                             runner.head_layers() if want_hidden else None)
    steering: List[Optional[Tensor]] = [None] * len(jobs)
    if want_hidden:
        g = runner.steering_vectors(states)
        steering = [g[i] if s.steering else None for i, s in enumerate(sessions)]
    verify_ms = (time.perf_counter() - start) * 1e3
    return [JobResult(accepted=acc, next_token=nxt, is_bonus=bonus, steering=steering[i],
                      queue_ms=(start - job.submitted) * 1e3, verify_ms=verify_ms, batch_size=len(jobs))
            for i, (job, (acc, nxt, bonus)) in enumerate(zip(jobs, results))]

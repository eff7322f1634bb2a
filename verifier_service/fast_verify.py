"""The verifier service on the device path: sessions in slots of a static KV pool (graphed on
CUDA) and batches verified by `steerspec.decoding.fastpath.verify_blocks` (one forward pass, acceptance
on the device, one device→host copy per batch). Used when `fastpath.enabled(device)` (CUDA by
default, STEERSPEC_DEVICE_SAMPLING); otherwise sessions keep a FastCachedLM and the host path
(`VerifyRunner.run`: one packed pass, acceptance on the host).

Hooks (a line or two each): `VerifierSessions.open` builds the session's cache with `verify_sessions.session_lm`;
`VerifyRunner.prefill` hands over to `prefill` for any fast cache, `VerifyRunner.run` to `run`
when `applies`.
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from steerspec.decoding import fastpath
from steerspec.decoding.speculative import DraftBlock
from steerspec.models.kv import CachedLM, FastCachedLM
from verifier_service.verify_jobs import JobResult


def applies(lms: Sequence[CachedLM]) -> bool:
    """True when every cache can take the device path."""
    return bool(lms) and all(isinstance(lm, FastCachedLM) and fastpath.enabled(lm.device) for lm in lms)


def head_layers(runner) -> Optional[List[int]]:
    return None if runner.head is None else [int(layer) for layer in runner.head.layers]


def steering_vectors(runner, states: Tensor) -> Tensor:
    """g [B, d_V] from hidden states [B, L, D] entering the head's layers (concatenated in order)."""
    head_device = next(runner.head.parameters()).device
    return runner.head(states.reshape(states.shape[0], -1).to(head_device, torch.float32)).float()


@torch.inference_mode()
def prefill(runner, session, prompt: List[int], start: int = 0) -> Optional[Tensor]:
    """`VerifyRunner.prefill` on a fast/graphed cache (either path): feed prompt[start:-1] (the rest is
    cached); steering for block 1."""
    lm = session.lm
    if start == 0:
        lm.reset()
    feed = prompt[start:-1]
    want = session.steering and runner.head is not None
    if not feed:
        return runner.initial_steering() if want else None
    out = lm.extend(feed, head_layers(runner) if want else None, logits_to_keep=1)
    if not want:
        return None
    return steering_vectors(runner, out.hidden[:, -1].unsqueeze(0))[0]


@torch.inference_mode()
def run(runner, jobs) -> list:
    """`VerifyRunner.run` on the device path: the same JobResults, one host copy per batch."""
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
                                             head_layers(runner) if want_hidden else None)
    steering: List[Optional[Tensor]] = [None] * len(jobs)
    if want_hidden:
        g = steering_vectors(runner, states)
        steering = [g[i] if s.steering else None for i, s in enumerate(sessions)]
    verify_ms = (time.perf_counter() - start) * 1e3
    return [JobResult(accepted=acc, next_token=nxt, is_bonus=bonus, steering=steering[i],
                      queue_ms=(start - job.submitted) * 1e3, verify_ms=verify_ms, batch_size=len(jobs))
            for i, (job, (acc, nxt, bonus)) in enumerate(zip(jobs, results))]

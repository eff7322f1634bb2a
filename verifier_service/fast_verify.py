"""The verifier service on the device path: sessions in slots of a static KV pool (graphed on
CUDA) and batches verified by `steerspec.fastpath.verify_blocks` (one forward pass, acceptance
on the device, one device→host copy per batch). Used when `fastpath.enabled(device)` (CUDA by
default, STEERSPEC_DEVICE_SAMPLING); otherwise sessions keep a FastCachedLM and the host path
(`VerifyRunner.run`: one packed pass, acceptance on the host).

Hooks (a line or two each): `VerifierSessions.open` builds the session's cache with `session_lm`;
`VerifyRunner.prefill` hands over to `prefill` for any fast cache, `VerifyRunner.run` to `run`
when `applies`.
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from steerspec import fastpath
from steerspec.models.kv import CachedLM, FastCachedLM, cached_lm
from steerspec.speculative import DraftBlock


KV_BACKENDS = ("auto", "fast", "hf")


def check_backend(backend: str) -> str:
    """`backend` if it names a session cache (`--kv-backend`), else ValueError naming the choices."""
    if backend not in KV_BACKENDS:
        raise ValueError(f"unknown KV backend {backend!r}: use one of {', '.join(KV_BACKENDS)}")
    return backend


def session_lm(model, backend: str = "auto", tree: bool = False) -> CachedLM:
    """A session's verifier cache (`--kv-backend`). auto: graphed/fast when the device path serves
    this model, the lean FastCachedLM on the host path (a CPU; `VerifyRunner.run` packs its
    batches), the transformers cache for architectures the fast forward does not cover. fast: a
    FastCachedLM on either path. hf: the transformers cache (its padded batched pass). A draft-tree
    session (`tree`) gets a FastCachedLM on any device: the graphed static pool takes no tree."""
    if check_backend(backend) == "hf" or not FastCachedLM.supports(model):
        return CachedLM(model)
    if tree:
        return FastCachedLM(model)
    return cached_lm(model) if backend == "auto" and fastpath.enabled(model.device) else FastCachedLM(model)


def applies(lms: Sequence[CachedLM]) -> bool:
    """True when every cache can take the device path."""
    return bool(lms) and all(isinstance(lm, FastCachedLM) and fastpath.enabled(lm.device) for lm in lms)


def _layers(runner) -> Optional[List[int]]:
    return None if runner.head is None else [int(layer) for layer in runner.head.layers]


def _head(runner, states: Tensor) -> Tensor:
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
    out = lm.extend(feed, _layers(runner) if want else None, logits_to_keep=1)
    if not want:
        return None
    return _head(runner, out.hidden[:, -1].unsqueeze(0))[0]


@torch.inference_mode()
def run(runner, jobs) -> list:
    """`VerifyRunner.run` on the device path: the same JobResults, one host copy per batch."""
    from verifier_service.batcher import JobResult

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
                                             _layers(runner) if want_hidden else None)
    steering: List[Optional[Tensor]] = [None] * len(jobs)
    if want_hidden:
        g = _head(runner, states)
        steering = [g[i] if s.steering else None for i, s in enumerate(sessions)]
    verify_ms = (time.perf_counter() - start) * 1e3
    return [JobResult(accepted=acc, next_token=nxt, is_bonus=bonus, steering=steering[i],
                      queue_ms=(start - job.submitted) * 1e3, verify_ms=verify_ms, batch_size=len(jobs))
            for i, (job, (acc, nxt, bonus)) in enumerate(zip(jobs, results))]

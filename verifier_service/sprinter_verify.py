"""SPRINTER (lossy) sessions on the verifier: each block is one run, verified on its own by the
in-process `sprinter.decoding.verify_run` (the kept tokens fed and accepted, the rest checked by
min(1, p/q) with the residual resample), so a seeded session draws exactly what `sprinter_generate`
draws in one process. Exact sessions in the same batch keep the batched path. Each run's tokens are
labelled from the same pass (`sprinter.labels.label_run`) and the counts go back with the result.
"""

from __future__ import annotations

import time
from typing import List

import torch

from steerspec.decoding.rounds import DecodeConfig
from steerspec.decoding.speculative import DraftBlock
from steerspec.sprinter.decoding import verify_run
from steerspec.sprinter.labels import label_run
from verifier_service import fast_verify
from verifier_service.verify_jobs import JobResult


@torch.inference_mode()
def run(runner, job):
    """One SPRINTER job -> JobResult (batch size 1)."""
    start = time.perf_counter()
    session, block = job.session, job.block
    k = block.k
    q = None if block.q is None or session.greedy else block.q.map(lambda t: t.unsqueeze(0))
    draft = DraftBlock(tokens=torch.from_numpy(block.draft_ids).view(1, k).long(), lengths=torch.tensor([k]), q=q)
    layers = fast_verify.head_layers(runner) if (session.steering and runner.head is not None) else None
    accepted, next_token, probs, logits, hidden = verify_run(session.lm, session.pending, draft,
                                                             DecodeConfig(sampling=session.params), session.generator,
                                                             layers, kept=block.kept)
    flags = [i < block.head_kept for i in range(k)]  # what the drafter's classifier kept
    labels = label_run(draft, flags, probs, logits, session.lm.vocab_size, block.lam)
    steering = None if hidden is None else fast_verify.steering_vectors(runner, hidden.unsqueeze(0))[0]
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return JobResult(accepted=accepted, next_token=next_token, is_bonus=accepted == k, steering=steering,
                     queue_ms=(start - job.submitted) * 1e3, verify_ms=(time.perf_counter() - start) * 1e3,
                     batch_size=1, labels=labels)


def run_mixed(runner, jobs) -> List:
    """Results in job order: SPRINTER jobs one by one, the others through `runner.run` together."""
    exact = [job for job in jobs if not job.session.sprinter]
    batched = iter(runner.run(exact) if exact else [])
    return [run(runner, job) if job.session.sprinter else next(batched) for job in jobs]

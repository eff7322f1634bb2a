"""A SPRINTER run (lossy): the drafter drafts until its classifier predicts a rejection; the coordinator commits
the kept tokens before the verifier call and the verifier checks the run's last token exactly
(`sprinter.decoding.verify_run`), labelling every token of the run from the same pass (`sprinter.labels`).

Runs are drafted and verified one session at a time, as in process (`sprinter_generate`), so a seeded session draws
exactly what it draws in one process; the verifier's labels go back with the result and the coordinator tallies
them as in-process SPRINTER tallies them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from steerspec.blocks.block_kind import DraftOutput, JobResult, register_kind
from steerspec.blocks.chain_kind import ChainKind
from steerspec.decoding.engine import DecodeConfig
from steerspec.decoding.speculative import DraftBlock
from steerspec.serving import wire
from steerspec.serving.wire import WireBlock
from steerspec.sprinter.decoding import SprinterScorer, draft_run, sprinter_generate, verify_run
from steerspec.sprinter.labels import SprinterTally, label_run
from steerspec.v1 import common_pb2


@dataclass
class SprinterRun:
    """A drafter session's classifier: runs end at its first predicted rejection."""

    scorer: SprinterScorer  # over the session's cache
    threshold: float
    lam: float = 1.0  # the λ the head was trained with: the verifier labels the run's tokens with it


@register_kind
class SprinterKind(ChainKind):
    """Lossy runs up to `max_run` tokens (`BlockMode.k`), ended by the drafter's classifier."""

    name = "sprinter"

    # -- the coordinator's round -------------------------------------------------------------------------
    def commit_early(self, block: common_pb2.DraftBlock) -> int:
        """The classifier's kept tokens (never the run's last one, which the verifier checks)."""
        block.kept = min(int(block.kept), max(len(block.draft_ids) - 1, 0))  # after a cut too
        return int(block.kept)

    def tally(self, mode) -> SprinterTally:
        return SprinterTally(max_run=mode.verification.max_run)

    def count(self, tally, block: common_pb2.DraftBlock, result: Optional[common_pb2.VerifyResult]) -> None:
        """The verifier's labels of the run (not forwarded to the drafter) and the run's kept length."""
        if result is not None and result.HasField("sprinter"):
            tally.add_labels(wire.decode_labels(result.sprinter))
            result.ClearField("sprinter")
        tally.run_lengths.append(max(int(block.head_kept), int(block.kept)))

    # -- the drafter service -----------------------------------------------------------------------------
    def open_drafter(self, drafter, session) -> None:
        """The drafter's classifier head on the session's cache (FAILED_PRECONDITION when it has none)."""
        loaded = drafter.sprinter_head()
        rule = session.mode.verification
        threshold = rule.threshold if rule.threshold is not None else loaded.default_threshold
        session.kind_state = SprinterRun(SprinterScorer(loaded.head, session.lm), threshold, loaded.lam)

    def draft(self, drafter, sessions: Sequence) -> List[DraftOutput]:
        return [self.draft_one(drafter, session) for session in sessions]

    def draft_one(self, drafter, session) -> DraftOutput:
        """A run: token by token until the head predicts a rejection (`sprinter.decoding.draft_run`)."""
        start = time.perf_counter()
        k = drafter.block_length(session)
        drafter.steer(session)
        try:
            block, flags = draft_run(session.lm, session.committed, k,
                                     DecodeConfig(sampling=session.params, draft_top_k=session.draft_top_k),
                                     session.generator, session.kind_state.scorer, session.kind_state.threshold)
        finally:
            drafter.unsteer()
        drafter.sync()
        out = drafter.output(block, start)
        out.kept = max(len(flags) - 1, 0)  # the run's last token is always checked by the verifier
        out.head_kept = sum(flags)  # ... but the head kept it too when the run ended at max_run or the budget
        return out

    def encode_block(self, session, out: DraftOutput, block: common_pb2.DraftBlock) -> None:
        block.kept, block.head_kept, block.sprinter_lambda = out.kept, out.head_kept, session.kind_state.lam

    # -- the verifier service ----------------------------------------------------------------------------
    def admit(self, session, msg: common_pb2.DraftBlock, vocab_size: int) -> Tuple[WireBlock, None]:
        return wire.decode_block(msg, vocab_size, session.greedy), None  # kept tokens are this kind's own

    def verify(self, runner, jobs: Sequence) -> List[JobResult]:
        return [verify_one(runner, job) for job in jobs]

    def encode_result(self, result: JobResult, out: common_pb2.VerifyResult) -> None:
        if result.labels is not None:
            out.sprinter.CopyFrom(wire.encode_labels(result.labels))

    # -- in process --------------------------------------------------------------------------------------
    def generate(self, verifier, drafter, prompt_ids, config, mode, *, policy=None, steering=None, tokenizer=None,
                 on_round=None, head=None):
        """`head`: the drafter's loaded classifier (`sprinter.classifier.resolve_head`)."""
        rule = mode.verification
        threshold = rule.threshold if rule.threshold is not None else head.default_threshold
        return sprinter_generate(verifier, drafter, prompt_ids, config, head.head, threshold=threshold,
                                 max_run=rule.max_run, lam=head.lam, steering=steering, tokenizer=tokenizer,
                                 on_round=on_round)


@torch.inference_mode()
def verify_one(runner, job) -> JobResult:
    """One run -> its verdict and labels (batch size 1)."""
    start = time.perf_counter()
    session, block = job.session, job.block
    k = block.k
    q = None if block.q is None or session.greedy else block.q.map(lambda t: t.unsqueeze(0))
    draft = DraftBlock(tokens=torch.from_numpy(block.draft_ids).view(1, k).long(), lengths=torch.tensor([k]), q=q)
    layers = runner.head_layers() if session.steering else None
    accepted, next_token, probs, logits, hidden = verify_run(session.lm, session.pending, draft,
                                                             DecodeConfig(sampling=session.params), session.generator,
                                                             layers, kept=block.kept)
    flags = [i < block.head_kept for i in range(k)]  # what the drafter's classifier kept
    labels = label_run(draft, flags, probs, logits, session.lm.vocab_size, block.lam)
    steering = None if hidden is None else runner.steering_vectors(hidden.unsqueeze(0))[0]
    runner.sync()
    return JobResult(accepted=accepted, next_token=next_token, is_bonus=accepted == k, steering=steering,
                     queue_ms=(start - job.submitted) * 1e3, verify_ms=(time.perf_counter() - start) * 1e3,
                     batch_size=1, labels=labels)

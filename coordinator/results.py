"""What one distributed generation measured: per-block round-trip costs and the summary metrics."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from steerspec.decoding.generation_result import GenerationResult
from steerspec.decoding.rounds import BlockStats  # noqa: F401  (re-exported: the one per-block stats type)
from steerspec.sprinter.labels import SprinterTally, theory_line
from steerspec.v1 import coordinator_pb2


@dataclass
class Chunk:
    """Tokens committed by one round trip (what the server streams as a TokenChunk)."""

    seq: int
    token_ids: List[int]
    accepted: int
    drafted: int


def _mean(values: Sequence[float]) -> float:
    return float(statistics.fmean(values)) if values else 0.0


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


@dataclass
class DistributedResult(GenerationResult):
    """A GenerationResult plus the per-block round-trip costs of the distributed path."""

    session_id: str = ""
    blocks: List[BlockStats] = field(default_factory=list)
    resumes: int = 0
    trace_id: str = ""
    transport: str = "grpc"
    restored: int = 0  # tokens restored from a checkpoint (resumed session): not counted as this run's work
    verification: str = "exact"  # "sprinter:..." marks a lossy session (not the verifier's distribution)
    sprinter: Optional[SprinterTally] = None  # lossy sessions: the verifier's labels of every run

    @property
    def lossy(self) -> bool:
        return self.verification.split(":")[0] == "sprinter"

    def sprinter_theory(self) -> Optional[Dict[str, float]]:
        """Measured η's, Theorem 1's bound and Theorem 2's run length (`SprinterTally.theory`); None if exact."""
        return self.sprinter.theory() if self.sprinter is not None else None

    @property
    def block_efficiency(self) -> float:
        return (self.generated - self.restored) / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return (self.generated - self.restored) / self.wall_s if self.wall_s > 0 else 0.0

    def stage_ms(self, reduce: Callable[[Sequence[float]], float] = _mean) -> Dict[str, float]:
        b = self.blocks
        return {"draft": reduce([x.draft_ms for x in b]), "network": reduce([x.network_ms for x in b]),
                "queue": reduce([x.queue_ms for x in b]), "verify": reduce([x.verify_ms for x in b]),
                "overhead": reduce([x.overhead_ms for x in b])}

    @property
    def rtt_ms(self) -> float:
        return _mean([x.rtt_ms for x in self.blocks])

    @property
    def bytes_up(self) -> float:
        return _mean([x.bytes_up for x in self.blocks])

    @property
    def bytes_down(self) -> float:
        return _mean([x.bytes_down for x in self.blocks])

    def critical_draft_ms(self) -> float:
        """Mean drafter compute left on the critical path per block (the drafter's own report)."""
        return _mean([x.draft_compute_ms for x in self.blocks])

    def ahead(self) -> Dict[str, float]:
        """Drafting ahead over the blocks that followed a block drafted ahead for: how many, hits, hit rate, and
        per such block the verdicts prepared and the drafter time that took (means)."""
        blocks = [x for x in self.blocks if x.ahead]
        hits = sum(1 for x in blocks if x.ahead_hit)
        return {"blocks": len(blocks), "hits": hits, "hit_rate": hits / len(blocks) if blocks else 0.0,
                "prepared": _mean([x.ahead_prepared for x in blocks]), "ahead_ms": _mean([x.ahead_ms for x in blocks])}

    def to_json(self) -> Dict[str, object]:
        out = super().to_json()
        out.update({
            "transport": self.transport,
            "session_id": self.session_id,
            "rtt_ms": round(self.rtt_ms, 3),
            "bytes_up": round(self.bytes_up, 1),
            "bytes_down": round(self.bytes_down, 1),
            "stage_ms": {k: round(v, 3) for k, v in self.stage_ms().items()},
            "stage_ms_median": {k: round(v, 3) for k, v in self.stage_ms(_median).items()},
            "draft_compute_ms": round(_mean([x.draft_compute_ms for x in self.blocks]), 3),
            "batch_size": round(_mean([x.batch_size for x in self.blocks]), 3),
            "ahead": {k: round(v, 3) for k, v in self.ahead().items()},
            "resumes": self.resumes,
            "trace_id": self.trace_id,
            "verification": self.verification.split(":")[0],
            "lossy": self.lossy,
        })
        if self.lossy:
            out["verification_spec"] = self.verification
            out["verifier_calls"] = self.rounds
            theory = self.sprinter_theory()
            if theory is not None:
                out["sprinter"] = theory
        return out

    def summary(self) -> str:
        text = super().summary()
        ahead = self.ahead()
        if ahead["blocks"]:  # before the summary line, which stays last for exact sessions
            text = (f"drafting ahead: {ahead['hits']}/{ahead['blocks']} blocks hit ({ahead['hit_rate']:.0%}), "
                    f"{ahead['prepared']:.1f} verdicts prepared per block in {ahead['ahead_ms']:.1f} ms; drafting "
                    f"left on the critical path {self.critical_draft_ms():.1f} ms per block\n") + text
        if self.lossy:
            text += (f"\nLOSSY ({self.verification}): tokens the drafter's classifier kept were committed without "
                     f"the verifier ({self.rounds} verifier calls for {self.generated - self.restored} tokens)")
            theory = self.sprinter_theory()
            if theory is not None:
                text += "\n" + theory_line(theory)
        return text

    def to_summary(self, text: str = "") -> coordinator_pb2.GenerationSummary:
        stages = self.stage_ms()
        rate = self.acceptance_rate
        ahead = self.ahead()
        theory = self.sprinter_theory()
        sprinter = None if theory is None else coordinator_pb2.SprinterTheory(**theory,
                                                                              labelled=self.sprinter.labelled)
        return coordinator_pb2.GenerationSummary(
            session_id=self.session_id, token_ids=self.token_ids, text=text, rounds=self.rounds,
            drafted=self.drafted, accepted=self.accepted, block_efficiency=self.block_efficiency,
            acceptance_rate=0.0 if rate is None else rate, accepted_per_position=self.accepted_per_position,
            tokens_per_s=self.tokens_per_s, rtt_ms=self.rtt_ms, bytes_up=self.bytes_up, bytes_down=self.bytes_down,
            stage_ms=coordinator_pb2.StageTimes(draft_ms=stages["draft"], network_ms=stages["network"],
                                                queue_ms=stages["queue"], verify_ms=stages["verify"],
                                                overhead_ms=stages["overhead"]),
            wall_s=self.wall_s, finish_reason=self.stop_reason, resumes=self.resumes, trace_id=self.trace_id,
            lossy=self.lossy, verification=self.verification,
            draft_compute_ms=_mean([x.draft_compute_ms for x in self.blocks]),
            batch_size=_mean([x.batch_size for x in self.blocks]), sprinter=sprinter,
            block_drafted=[x.drafted for x in self.blocks], block_accepted=[x.accepted for x in self.blocks],
            prompt_tokens=self.prompt_tokens, ahead_blocks=ahead["blocks"], ahead_hits=ahead["hits"],
            ahead_prepared=ahead["prepared"], ahead_ms=ahead["ahead_ms"])


def end_block_span(span, stats: BlockStats) -> None:
    """End a round trip's `steerspec.block` span (started when its draft was asked for) with its stages."""
    span.set_attributes({
        "steerspec.block": stats.seq, "steerspec.k": stats.drafted, "steerspec.accepted": stats.accepted,
        "steerspec.bytes_up": stats.bytes_up, "steerspec.bytes_down": stats.bytes_down,
        "steerspec.rtt_ms": stats.rtt_ms, "steerspec.draft_ms": stats.draft_ms,
        "steerspec.draft_compute_ms": stats.draft_compute_ms, "steerspec.cycle_ms": stats.cycle_ms,
        "steerspec.network_ms": stats.network_ms, "steerspec.queue_ms": stats.queue_ms,
        "steerspec.verify_ms": stats.verify_ms, "steerspec.overhead_ms": stats.overhead_ms,
        "steerspec.batch_size": stats.batch_size, "steerspec.verifier": stats.verifier,
        "steerspec.ahead": stats.ahead, "steerspec.ahead_hit": stats.ahead_hit,
        "steerspec.ahead_prepared": stats.ahead_prepared, "steerspec.ahead_ms": stats.ahead_ms,
    })
    span.end()

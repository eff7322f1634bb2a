"""A generation's result rebuilt from the coordinator's final GenerationSummary (what `steerspec run` prints
when the generation went through the services, on either deployment)."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.results import DistributedResult


@dataclass
class SummaryResult(DistributedResult):
    """A DistributedResult rebuilt from a GenerationSummary (per-block means, no per-block list)."""

    wire_summary: object = None

    @property
    def accepted_per_position(self):
        return list(self.wire_summary.accepted_per_position)

    @property
    def rtt_ms(self) -> float:
        return float(self.wire_summary.rtt_ms)

    @property
    def bytes_up(self) -> float:
        return float(self.wire_summary.bytes_up)

    @property
    def bytes_down(self) -> float:
        return float(self.wire_summary.bytes_down)

    def stage_ms(self, reduce=None):
        return dict(self.wire_summary.stage_ms)

    def sprinter_theory(self):
        return self.wire_summary.sprinter

    def critical_draft_ms(self) -> float:
        return float(self.wire_summary.draft_compute_ms)

    def ahead(self):
        s = self.wire_summary
        blocks = int(s.ahead_blocks)
        return {"blocks": blocks, "hits": int(s.ahead_hits), "hit_rate": s.ahead_hits / blocks if blocks else 0.0,
                "prepared": float(s.ahead_prepared), "ahead_ms": float(s.ahead_ms)}

    def to_json(self):
        out = super().to_json()
        out.pop("stage_ms_median", None)
        out["draft_compute_ms"] = round(float(self.wire_summary.draft_compute_ms), 3)
        out["batch_size"] = round(float(self.wire_summary.batch_size), 3)
        out["coordinator_wall_s"] = round(float(self.wire_summary.wall_s), 6)
        return out


def result_from_summary(summary, prompt_tokens: int, mode: str, wall_s: float) -> SummaryResult:
    """The CLI's result object from the client's final Summary."""
    result = SummaryResult(token_ids=list(summary.token_ids), text=summary.text, mode=mode,
                           prompt_tokens=prompt_tokens, rounds=summary.rounds, drafted=summary.drafted,
                           accepted=summary.accepted, wall_s=wall_s, stop_reason=summary.finish_reason,
                           session_id=summary.session_id, resumes=summary.resumes, trace_id=summary.trace_id,
                           wire_summary=summary, verification=summary.verification or "exact")
    result.draft_s = summary.stage_ms["draft"] * summary.rounds / 1000.0
    result.verify_s = summary.stage_ms["verify"] * summary.rounds / 1000.0
    return result

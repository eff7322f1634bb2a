"""OpenAI response bodies and stream chunks from the coordinator's GenerateResponses.

Every response carries `usage` and a `metrics` object: vLLM's per-request timing fields, its
`speculative_decoding` object (the layout of vLLM's --per-request-spec-decode-metrics detailed), and
`steerspec`, the remote regime's figures (round trips, per-block draft / network / queue / verify time,
bytes per block). In a stream they ride the final usage chunk (stream_options.include_usage), as in vLLM.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from steerspec.observability.genai import finish_reason

OBJECTS = {"completion": ("text_completion", "text_completion"), "chat": ("chat.completion", "chat.completion.chunk")}


@dataclass
class Timing:
    """When a request arrived and its tokens came (vLLM's per-request timing metrics)."""

    arrived: float = field(default_factory=time.perf_counter)
    first: Optional[float] = None
    last: Optional[float] = None
    tokens: int = 0

    def tokens_arrived(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last, self.tokens = now, self.tokens + n

    def metrics(self) -> Dict[str, float]:
        first = self.first if self.first is not None else time.perf_counter()
        last = self.last if self.last is not None else first
        decode_s = last - first
        return {"time_to_first_token_ms": round((first - self.arrived) * 1e3, 3),
                "generation_time_ms": round(decode_s * 1e3, 3), "queue_time_ms": 0.0,
                "mean_itl_ms": round(decode_s * 1e3 / (self.tokens - 1), 3) if self.tokens > 1 else 0.0,
                "tokens_per_second": round(self.tokens / (last - self.arrived), 3) if last > self.arrived else 0.0}


def spec_decode_metrics(drafted: Sequence[int], accepted: Sequence[int], num_spec_tokens: int) -> Dict[str, Any]:
    """vLLM's `metrics.speculative_decoding` (detailed) from the per-block drafted / accepted counts; blocks
    with no draft tokens (verifier-only steps) are left out, as vLLM leaves out steps it did not draft."""
    steps = [(int(d), int(a)) for d, a in zip(drafted, accepted) if d > 0]
    width = max([num_spec_tokens] + [d for d, _ in steps])
    histogram = [0] * (width + 1)
    by_length: Dict[str, List[int]] = {}
    for d, a in steps:
        histogram[a] += 1
        by_length.setdefault(str(d), [0] * (d + 1))[a] += 1
    n_accepted, n_drafted = sum(a for _, a in steps), sum(d for d, _ in steps)
    return {
        "mean_acceptance_length": 1.0 + n_accepted / len(steps) if steps else 1.0,
        "draft_acceptance_rate": n_accepted / n_drafted if n_drafted else 0.0,
        "acceptance_histogram": histogram,
        "acceptance_histogram_by_draft_length": dict(sorted(by_length.items(), key=lambda kv: int(kv[0]))),
        "num_spec_steps": len(steps), "num_accepted_draft_tokens": n_accepted, "num_draft_tokens": n_drafted,
        "num_spec_tokens": num_spec_tokens,
        "per_step_accepted": [a for _, a in steps], "per_step_drafted": [d for d, _ in steps],
    }


def steerspec_metrics(summary) -> Dict[str, Any]:
    """The remote regime's figures of one generation (per-block means; GenerationSummary fields)."""
    s = summary.stage_ms
    return {"session_id": summary.session_id, "trace_id": summary.trace_id, "round_trips": summary.rounds,
            "block_efficiency": summary.block_efficiency, "rtt_ms": summary.rtt_ms,
            "stage_ms": {"draft": s.draft_ms, "network": s.network_ms, "queue": s.queue_ms, "verify": s.verify_ms,
                         "overhead": s.overhead_ms},
            "draft_compute_ms": summary.draft_compute_ms, "bytes_up": summary.bytes_up,
            "bytes_down": summary.bytes_down, "verifier_batch_size": summary.batch_size,
            "resumes": summary.resumes, "verification": summary.verification or "exact", "lossy": summary.lossy,
            "wall_s": summary.wall_s}


def usage(summary) -> Dict[str, int]:
    completion = len(summary.token_ids)
    return {"prompt_tokens": int(summary.prompt_tokens), "completion_tokens": completion,
            "total_tokens": int(summary.prompt_tokens) + completion}


def metrics(summary, timing: Timing, num_spec_tokens: int) -> Dict[str, Any]:
    return {**timing.metrics(),
            "speculative_decoding": spec_decode_metrics(summary.block_drafted, summary.block_accepted,
                                                        num_spec_tokens),
            "steerspec": steerspec_metrics(summary)}


@dataclass
class Responder:
    """The OpenAI bodies of one request: its id, creation time, model and kind ("completion" | "chat")."""

    kind: str
    model: str
    request_id: str
    created: int = field(default_factory=lambda: int(time.time()))

    def _envelope(self, streaming: bool) -> Dict[str, Any]:
        return {"id": self.request_id, "object": OBJECTS[self.kind][int(streaming)], "created": self.created,
                "model": self.model}

    def _choice(self, text: str, finish: Optional[str], streaming: bool, first: bool = False) -> Dict[str, Any]:
        if self.kind == "completion":
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if streaming:
            delta: Dict[str, Any] = {"role": "assistant", "content": text} if first else \
                ({"content": text} if text or finish is None else {})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}

    def body(self, summary, timing: Timing, num_spec_tokens: int) -> Dict[str, Any]:
        """The whole (non-streamed) response."""
        return {**self._envelope(False),
                "choices": [self._choice(summary.text, finish_reason(summary.finish_reason), False)],
                "usage": usage(summary), "metrics": metrics(summary, timing, num_spec_tokens)}

    def chunk(self, text: str, first: bool = False) -> Dict[str, Any]:
        """A stream chunk carrying new text (chat: the first one names the role)."""
        return {**self._envelope(True), "choices": [self._choice(text, None, True, first)]}

    def final_chunk(self, summary) -> Dict[str, Any]:
        """The chunk carrying the finish reason."""
        return {**self._envelope(True),
                "choices": [self._choice("", finish_reason(summary.finish_reason), True)]}

    def usage_chunk(self, summary, timing: Timing, num_spec_tokens: int) -> Dict[str, Any]:
        """stream_options.include_usage: no choices, the usage and the per-request metrics."""
        return {**self._envelope(True), "choices": [], "usage": usage(summary),
                "metrics": metrics(summary, timing, num_spec_tokens)}

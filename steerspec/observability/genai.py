"""OpenTelemetry GenAI semantic conventions on the generation span (semconv 1.44.0, the version of the
opentelemetry-semantic-conventions package the SDK installs), so GenAI-aware trace UIs read SteerSpec's spans.

    attributes = request_attributes("chat", "HuggingFaceTB/SmolLM2-360M", session)   # at the span's start
    span.set_attributes(response_attributes(summary))                               # when it ends
"""

from __future__ import annotations

from typing import Dict, Sequence, Union

SEMCONV_VERSION = "1.44.0"
PROVIDER = "steerspec"  # gen_ai.provider.name: SteerSpec serves the model itself (no well-known provider value fits)
OPERATIONS = ("text_completion", "chat")  # gen_ai.operation.name values SteerSpec serves
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}

Attribute = Union[str, int, float, bool, Sequence[str]]


def finish_reason(stop_reason: str) -> str:
    """SteerSpec's finish reason ("eos", "stop", "length", "context") as OpenAI and GenAI name it."""
    return FINISH_REASONS.get(stop_reason, stop_reason or "length")


def request_attributes(operation: str, model: str, session) -> Dict[str, Attribute]:
    """gen_ai.* request attributes of one generation (`session`: a coordinator SessionRequest)."""
    sampling = session.sampling
    out: Dict[str, Attribute] = {
        "gen_ai.operation.name": operation, "gen_ai.provider.name": PROVIDER,
        "gen_ai.request.max_tokens": int(session.max_new_tokens),
        "gen_ai.request.temperature": float(sampling.temperature), "gen_ai.request.top_p": float(sampling.top_p),
        "gen_ai.request.seed": int(session.seed), "gen_ai.request.choice.count": 1,
        "gen_ai.conversation.id": str(session.session_id),
    }
    if model:
        out["gen_ai.request.model"] = model
    if sampling.top_k:
        out["gen_ai.request.top_k"] = float(sampling.top_k)
    if session.stop:
        out["gen_ai.request.stop_sequences"] = list(session.stop)
    return out


def response_attributes(summary, model: str = "") -> Dict[str, Attribute]:
    """gen_ai.* response attributes from a GenerationSummary (usage, finish reason, response id and model)."""
    return {**({"gen_ai.response.model": model} if model else {}),
        "gen_ai.response.id": str(summary.session_id),
        "gen_ai.response.finish_reasons": [finish_reason(summary.finish_reason)],
        "gen_ai.usage.input_tokens": int(summary.prompt_tokens),
        "gen_ai.usage.output_tokens": len(summary.token_ids),
    }

"""OpenAI request bodies (completions, chat completions) read into one `OpenAIRequest`, then a GenerateRequest.

Supported: model, prompt / messages, max_tokens (chat: max_completion_tokens too), temperature, top_p, seed,
stop, stream, stream_options.include_usage, n = 1, user (ignored); SteerSpec's knobs as extra body fields:
k, tree, policy, verification, top_k, draft_top_k, mode and timeout (seconds: 504 past it). Parameters that
would change the output in ways SteerSpec does not serve (n > 1, logprobs, penalties, tools ...) are refused
with 400 naming the parameter, as OpenAI names it in its own error bodies; left at their defaults they pass.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from steerspec.v1 import common_pb2, coordinator_pb2


class APIError(Exception):
    """An HTTP error with OpenAI's error body ({"error": {"message", "type", "param", "code"}})."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             409: "conflict_error", 429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = int(status), message, param, code

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code if self.code is not None else self.status}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


STEERSPEC_FIELDS = ("k", "tree", "policy", "verification", "top_k", "draft_top_k", "mode", "timeout")
COMMON_FIELDS = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n",
                 "user") + STEERSPEC_FIELDS
# parameters served only at these values (None: absent or null passes too)
DEFAULT_ONLY: Dict[str, Dict[str, Tuple[Any, ...]]] = {
    "completion": {"best_of": (1,), "echo": (False,), "logprobs": (), "suffix": ("",), "logit_bias": ({},),
                   "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0)},
    "chat": {"logprobs": (False,), "top_logprobs": (0,), "logit_bias": ({},), "frequency_penalty": (0, 0.0),
             "presence_penalty": (0, 0.0), "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (True, False),
             "response_format": ({"type": "text"},), "store": (False,), "metadata": ({},), "modalities": (["text"],),
             "service_tier": ("auto", "default"), "reasoning_effort": (), "prediction": (), "audio": (),
             "web_search_options": ()},
}


@dataclass
class OpenAIRequest:
    """One OpenAI request, checked: what SteerSpec needs to run it and to answer in OpenAI's shapes."""

    kind: str  # "completion" | "chat"
    model: str
    prompt: Optional[str] = None
    prompt_ids: Optional[List[int]] = None
    messages: Optional[List[Dict[str, str]]] = None
    max_tokens: Optional[int] = None
    temperature: float = 1.0  # OpenAI's default
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: Tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    k: int = 0
    tree: str = ""
    policy: str = ""
    verification: str = ""
    draft_top_k: int = 0
    mode: str = ""
    timeout: Optional[float] = None

    def generate_request(self, prompt_text: Optional[str], max_new_tokens: int) -> coordinator_pb2.GenerateRequest:
        """The coordinator's GenerateRequest for this request (`prompt_text`: the completion's prompt or the chat
        template's rendering); a fresh random seed at T > 0 when none is given, as the gRPC SDK does."""
        seed = self.seed if self.seed is not None else (random.getrandbits(62) if self.temperature > 0 else 0)
        return coordinator_pb2.GenerateRequest(
            prompt=prompt_text or "", prompt_ids=list(self.prompt_ids or []), max_new_tokens=max_new_tokens,
            sampling=common_pb2.SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p),
            seed=seed, k=self.k, draft_top_k=self.draft_top_k, mode=self.mode, policy=self.policy,
            verification=self.verification, tree=self.tree, stop=list(self.stop))


def _number(body: Dict[str, Any], name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(name, f"'{name}' must be a number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        raise bad(name, f"'{name}' must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value:g}")
    return float(value)


def _integer(body: Dict[str, Any], name: str, low: int = 0) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"'{name}' must be an integer, got {value!r}")
    if value < low:
        raise bad(name, f"'{name}' must be >= {low}, got {value}")
    return int(value)


def _string(body: Dict[str, Any], name: str) -> str:
    value = body.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise bad(name, f"'{name}' must be a string, got {value!r}")
    return value


def _stop(value: Any) -> Tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise bad("stop", f"'stop' must be a string or a list of strings, got {value!r}")


def _check_fields(kind: str, body: Dict[str, Any], own: Sequence[str]) -> None:
    """400 naming the first parameter SteerSpec does not serve (or serves only at its default)."""
    allowed = set(COMMON_FIELDS) | set(own)
    defaults = DEFAULT_ONLY[kind]
    for name, value in body.items():
        if name in allowed:
            continue
        if name in defaults:
            if value is None or value in defaults[name]:
                continue
            raise bad(name, f"'{name}' is not supported by SteerSpec (only its default is): leave it out")
        raise bad(name, f"unsupported parameter '{name}': SteerSpec serves model, prompt/messages, max_tokens, "
                        f"temperature, top_p, seed, stop, stream, stream_options, n=1 and its own "
                        f"{', '.join(STEERSPEC_FIELDS)}")


def _prompt(value: Any) -> Tuple[Optional[str], Optional[List[int]]]:
    """A completion's prompt: text, or token ids; one prompt per request."""
    if isinstance(value, str):
        return value, None
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return None, [int(t) for t in value]
    if isinstance(value, list) and len(value) == 1:
        return _prompt(value[0])
    if isinstance(value, list) and len(value) > 1:
        raise bad("prompt", "one prompt per request: SteerSpec does not serve batched prompts (send one request "
                            "per prompt; they run concurrently)")
    raise bad("prompt", f"'prompt' must be a string or a list of token ids, got {value!r}")


def _messages(value: Any) -> List[Dict[str, str]]:
    """Chat messages with their content as plain text (text parts joined); 400 for anything else."""
    if not isinstance(value, list) or not value:
        raise bad("messages", "'messages' must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad("messages", f"messages[{i}] must be an object with a 'role' and a 'content'")
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad("messages", f"messages[{i}]: only text content parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad("messages", f"messages[{i}].content must be a string or a list of text parts")
        out.append({"role": message["role"], "content": content})
    return out


def parse(kind: str, body: Any) -> OpenAIRequest:
    """An OpenAI request body (`kind` "completion" | "chat") -> OpenAIRequest; APIError 400 naming the parameter."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    own = ("prompt",) if kind == "completion" else ("messages", "max_completion_tokens")
    _check_fields(kind, body, own)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "'model' is required: the name GET /v1/models lists")
    n = _integer(body, "n", low=1)
    if n is not None and n != 1:
        raise bad("n", f"'n' must be 1: SteerSpec returns one choice per request, got {n}")
    request = OpenAIRequest(kind=kind, model=model)
    if kind == "completion":
        if "prompt" not in body:
            raise bad("prompt", "'prompt' is required")
        request.prompt, request.prompt_ids = _prompt(body["prompt"])
        request.max_tokens = _integer(body, "max_tokens", low=1)
    else:
        request.messages = _messages(body.get("messages"))
        request.max_tokens = _integer(body, "max_completion_tokens", low=1) or _integer(body, "max_tokens", low=1)
    request.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    request.top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    request.seed = _integer(body, "seed")
    if request.seed is not None and request.seed >= 1 << 64:
        raise bad("seed", "'seed' must fit in 64 bits")
    request.stop = _stop(body.get("stop"))
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream", f"'stream' must be true or false, got {stream!r}")
    request.stream = bool(stream)
    options = body.get("stream_options")
    if options is not None:
        if not request.stream:
            raise bad("stream_options", "'stream_options' is allowed only with 'stream': true")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise bad("stream_options", "'stream_options' supports only include_usage")
        request.include_usage = bool(options.get("include_usage"))
    request.k = _integer(body, "k") or 0
    request.top_k = _integer(body, "top_k") or 0
    request.draft_top_k = _integer(body, "draft_top_k") or 0
    request.tree, request.policy = _string(body, "tree"), _string(body, "policy")
    request.verification, request.mode = _string(body, "verification"), _string(body, "mode")
    if body.get("timeout") is not None:
        request.timeout = _number(body, "timeout", 0.0, 0.0, 86400.0, low_open=True)
    return request


def chat_prompt(tokenizer, messages: List[Dict[str, str]], model: str) -> str:
    """The chat's prompt text, rendered by the model's own chat template (400 when it has none)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, f"model '{model}' has no chat template, so /v1/chat/completions cannot build its "
                            "prompt: use /v1/completions with a prompt you format yourself", param="messages")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - a template that rejects these messages (roles, order)
        raise APIError(400, f"the model's chat template rejected these messages: {exc}", param="messages") from None

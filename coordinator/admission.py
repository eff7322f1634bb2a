"""Admission of a Generate request: size checks before any heavy work, tokenising off the event loop.

A prompt of B UTF-8 bytes has at least ceil(B / L) tokens, L being the longest token of the
vocabulary in bytes, so a prompt whose bound already fills the context is refused with OUT_OF_RANGE
in microseconds, before the tokenizer sees it. What passes is tokenised in a worker thread so that
health checks and other sessions keep their latency; its token count is then checked exactly.
"""

from __future__ import annotations

import asyncio
import math
from typing import List, Optional

import grpc

from coordinator.streams import SessionError

FALLBACK_TOKEN_BYTES = 1024  # when the vocabulary cannot be read: a generous bound on one token's bytes


def max_token_bytes(tokenizer) -> int:
    """Upper bound on the UTF-8 bytes one token of `tokenizer` stands for (its longest vocabulary entry)."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary
        return FALLBACK_TOKEN_BYTES
    # byte-level BPE spells one byte as one (at most 2-byte) character, so len(key.encode()) >= its bytes
    return max((len(str(key).encode()) for key in vocab), default=FALLBACK_TOKEN_BYTES) or FALLBACK_TOKEN_BYTES


class Admission:
    """Checks a request's prompt against the context and tokenises it without blocking the loop."""

    def __init__(self, tokenizer, max_length: Optional[int]) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.token_bytes = max_token_bytes(tokenizer) if tokenizer is not None else FALLBACK_TOKEN_BYTES

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens of `text` (cheap: its UTF-8 length over the longest token)."""
        return math.ceil(len(text.encode("utf-8", "surrogatepass")) / self.token_bytes)

    def _too_long(self, tokens: int, exact: bool) -> SessionError:
        what = f"{tokens} tokens" if exact else f"at least {tokens} tokens"
        return SessionError(grpc.StatusCode.OUT_OF_RANGE,
                            f"the prompt has {what}, and this coordinator's context is {self.max_length} tokens "
                            "(prompt + generated): shorten the prompt")

    def check_ids(self, prompt_ids) -> None:
        """OUT_OF_RANGE when `prompt_ids` leave no room for one generated token."""
        if self.max_length is not None and len(prompt_ids) >= self.max_length:
            raise self._too_long(len(prompt_ids), exact=True)

    async def tokenize(self, text: str) -> List[int]:
        """The prompt's ids: size bound first (OUT_OF_RANGE), then the tokenizer in a worker thread."""
        if self.tokenizer is None:
            raise SessionError(grpc.StatusCode.INVALID_ARGUMENT,
                               "this coordinator has no tokenizer: send prompt_ids instead of prompt text")
        if self.max_length is not None:
            bound = self.min_tokens(text)
            if bound >= self.max_length:
                raise self._too_long(bound, exact=False)
        ids = await asyncio.to_thread(lambda: list(self.tokenizer(text, add_special_tokens=False)["input_ids"]))
        self.check_ids(ids)
        return ids

    async def prompt_ids(self, request) -> Optional[List[int]]:
        """Ids for a GenerateRequest's text prompt (None when it sends prompt_ids, checked here too)."""
        if request.prompt and request.prompt_ids:
            return None  # session_request refuses both
        if request.prompt:
            return await self.tokenize(request.prompt)
        self.check_ids(request.prompt_ids)
        return None

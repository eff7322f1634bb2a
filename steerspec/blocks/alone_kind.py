"""The verifier alone: 0-length blocks, one verifier round trip per token (the autoregressive mode, and a session
whose last drafter is gone). The verifier scores the pending token alone, as a chain of no drafts."""

from __future__ import annotations

from typing import List, Sequence

from steerspec.blocks.block_kind import DraftOutput, register_kind
from steerspec.blocks.chain_kind import ChainKind
from steerspec.decoding.engine import autoregressive_generate


@register_kind
class AloneKind(ChainKind):
    """No drafts: the verifier's own next token each round."""

    name = "verifier"

    def room(self, mode, room: int) -> int:
        return 0

    def draft(self, drafter, sessions: Sequence) -> List[DraftOutput]:
        return [DraftOutput(draft_ids=[], q=None, draft_ms=0.0, batch_size=len(sessions)) for _ in sessions]

    def generate(self, verifier, drafter, prompt_ids, config, mode, *, policy=None, steering=None, tokenizer=None,
                 on_round=None, head=None):
        return autoregressive_generate(verifier, prompt_ids, config, tokenizer=tokenizer)

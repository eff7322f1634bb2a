"""What a generation reports, under the names DESIGN.md uses everywhere.

- block_efficiency τ = generated tokens / verify rounds (prefill is not a round);
- acceptance_rate = accepted draft tokens / drafted tokens (None when nothing was drafted);
- accepted_per_position[i] = fraction of blocks whose draft i+1 was accepted, over the blocks
  that drafted at least i+1 tokens;
- tokens_per_s = generated tokens / wall-clock seconds (prefill included).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass
class GenerationResult:
    """One generated sequence and its speculative-decoding statistics."""

    token_ids: List[int]
    text: str = ""
    mode: str = "speculative"
    prompt_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    block_drafted: List[int] = field(default_factory=list)  # per round: tokens drafted
    block_accepted: List[int] = field(default_factory=list)  # per round: tokens accepted
    wall_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    stop_reason: str = "length"  # length | eos | context

    @property
    def generated(self) -> int:
        return len(self.token_ids)

    @property
    def block_efficiency(self) -> float:
        return self.generated / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> Optional[float]:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def accepted_per_position(self) -> List[float]:
        return accepted_per_position(self.block_drafted, self.block_accepted)

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> Dict[str, object]:
        """A JSON-ready dict with DESIGN.md metric names."""
        rate = self.acceptance_rate
        return {
            "text": self.text,
            "token_ids": list(self.token_ids),
            "mode": self.mode,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "block_efficiency": round(self.block_efficiency, 6),
            "acceptance_rate": None if rate is None else round(rate, 6),
            "accepted_per_position": [round(x, 6) for x in self.accepted_per_position],
            "tokens_per_s": round(self.tokens_per_s, 3),
            "wall_s": round(self.wall_s, 6),
            "draft_ms": round(self.draft_s * 1000, 3),
            "verify_ms": round(self.verify_s * 1000, 3),
            "stop_reason": self.stop_reason,
        }

    def summary(self) -> str:
        """One line: block efficiency, acceptance rate, tokens/s."""
        rate = self.acceptance_rate
        rate_text = "n/a" if rate is None else f"{rate:.3f}"
        return (f"block_efficiency={self.block_efficiency:.3f} acceptance_rate={rate_text} "
                f"tokens_per_s={self.tokens_per_s:.1f} ({self.generated} tokens, {self.rounds} rounds, "
                f"{self.wall_s:.3f}s, {self.mode})")


def accepted_per_position(block_drafted: List[int], block_accepted: List[int]) -> List[float]:
    """Fraction of blocks whose draft i+1 was accepted, over blocks that drafted >= i+1 tokens."""
    width = max(block_drafted, default=0)
    offered = [0] * width
    hits = [0] * width
    for drafted, accepted in zip(block_drafted, block_accepted):
        for i in range(drafted):
            offered[i] += 1
            if i < accepted:
                hits[i] += 1
    return [h / o if o else 0.0 for h, o in zip(hits, offered)]


def aggregate(results: List[GenerationResult]) -> Dict[str, object]:
    """Pooled metrics over many generations (ratios of sums, not means of ratios)."""
    generated = sum(r.generated for r in results)
    rounds = sum(r.rounds for r in results)
    drafted = sum(r.drafted for r in results)
    accepted = sum(r.accepted for r in results)
    wall = sum(r.wall_s for r in results)
    bd = [d for r in results for d in r.block_drafted]
    ba = [a for r in results for a in r.block_accepted]
    return {
        "sequences": len(results),
        "generated_tokens": generated,
        "rounds": rounds,
        "drafted": drafted,
        "accepted": accepted,
        "block_efficiency": generated / rounds if rounds else 0.0,
        "acceptance_rate": accepted / drafted if drafted else None,
        "accepted_per_position": accepted_per_position(bd, ba),
        "tokens_per_s": generated / wall if wall > 0 else 0.0,
        "wall_s": wall,
    }

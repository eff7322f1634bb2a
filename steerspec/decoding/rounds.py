"""One speculative round, written once: the seed split, the block length, the commit and the accounting.

A round drafts k tokens, verifies them and commits d_1..d_a plus the verifier's next token. The
in-process engine (steerspec/decoding/engine.py), the coordinator's session loop (coordinator/loop.py) and
both services call these functions; no other module re-derives any of it.

Randomness: a request's `seed` seeds two generators, the drafter's with `seed` and the verifier's
with `seed + 1` (they live in different processes when distributed), so a seed fixes the output.
The drafter's generator is reseeded per block from the seed and the committed length (`block_seed`), so a
block prepared ahead of its result draws what it would have drawn after it.
Verifier-only decoding samples directly with the seed itself.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

from steerspec.decoding.generation_result import GenerationResult
from steerspec.decoding.sampling import SamplingParams

_SEED_MOD = 2**63


@dataclass
class DecodeConfig:
    """How to decode: sampling parameters, draft top-K, limits, seed."""

    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    draft_top_k: int = 64
    draft_tail: bool = True  # spread the mass outside the draft top-K evenly (sampling.draft_distribution)
    seed: Optional[int] = None
    eos_token_ids: Tuple[int, ...] = ()
    max_length: Optional[int] = None  # context limit: prompt + generated never exceeds it
    acceptance: str = "token"  # at T > 0: "token" (speculative sampling) or "block" (block_verify.py; trees: traversal.py)

    @property
    def greedy(self) -> bool:
        return self.sampling.greedy


# -- seeds ---------------------------------------------------------------------------------------
def drafter_seed(seed: int) -> int:
    """The drafter's generator seed for a request seeded with `seed`."""
    return int(seed) % _SEED_MOD


def verifier_seed(seed: int) -> int:
    """The verifier's generator seed (seed + 1: a different stream from the drafter's)."""
    return (int(seed) + 1) % _SEED_MOD


def autoregressive_stream_seed(seed: int) -> int:
    """The stream seed that makes a verifier (which adds 1) sample with `seed` itself (verifier-only)."""
    return (int(seed) - 1) % _SEED_MOD


def resumed_seed(seed: int, committed_length: int) -> int:
    """The stream seed after a failover: derived from the request's seed and the committed length,
    so random draws after a resume are fresh rather than replayed."""
    return (int(seed) * 1_000_003 + int(committed_length)) % _SEED_MOD


def block_seed(seed: int, committed_length: int) -> int:
    """The drafter's seed for the block drafted after `committed_length` committed tokens (splitmix64 of both): a
    block's draws depend only on the stream's seed and the committed prefix's length, not on whether the block was
    drafted when its result arrived or prepared ahead (drafter_service/ahead.py). A sequence's committed length
    grows every block, so no two blocks of a stream share a seed."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(committed_length) + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) % _SEED_MOD


def seed_block(generator: torch.Generator, seed: int, committed_length: int) -> torch.Generator:
    """Reseed the drafter's generator for the block after `committed_length` committed tokens (`block_seed`)."""
    generator.manual_seed(block_seed(seed, committed_length))
    return generator


def stream_seed(seed: Optional[int]) -> int:
    """The drafter's stream seed for a request seeded with `seed` (a fresh random one when None)."""
    if seed is None:
        return secrets.randbits(62)
    return drafter_seed(seed)


def generator(seed: Optional[int], device="cpu") -> torch.Generator:
    """A generator on `device` seeded with `seed` (non-deterministically when None)."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed) % _SEED_MOD)
    return g


def make_generators(seed: Optional[int], drafter_device="cpu", verifier_device="cpu") -> Tuple[torch.Generator, torch.Generator]:
    """(drafter generator seeded with seed, verifier generator seeded with seed + 1)."""
    if seed is None:
        return generator(None, drafter_device), generator(None, verifier_device)
    return generator(drafter_seed(seed), drafter_device), generator(verifier_seed(seed), verifier_device)


# -- budget, block length, commit ----------------------------------------------------------------
def room(remaining: int, committed_length: int, max_length: Optional[int]) -> int:
    """Tokens a session may still commit: its budget, capped by the context limit (None: no limit)."""
    return remaining if max_length is None else min(remaining, max_length - committed_length)


def stop_before_block(remaining: int, room_left: int) -> Optional[str]:
    """Why no further block can run ("length" / "context"), or None."""
    if remaining <= 0:
        return "length"
    if room_left <= 0:
        return "context"
    return None


def block_k(k: int, room_left: int) -> int:
    """Draft length for the next block: a block commits at most k + 1 tokens, so k <= room - 1."""
    return max(min(int(k), room_left - 1), 0)


def commit_block(drafts: Sequence[int], accepted: int, next_token: int, room_left: int, remaining: int,
                 eos: Sequence[int]) -> Tuple[List[int], Optional[str]]:
    """The tokens a verified block commits (d_1..d_a + next, cut at the room and after the first EOS)
    and why the generation stops after it ("eos" / "length" / "context"), or None to go on."""
    return commit_tokens([int(t) for t in drafts[:accepted]] + [int(next_token)], room_left, remaining, eos)


def commit_tokens(tokens: Sequence[int], room_left: int, remaining: int,
                  eos: Sequence[int]) -> Tuple[List[int], Optional[str]]:
    """Tokens committed as they are (cut at the room and after the first EOS) and why the generation
    stops after them, or None. SPRINTER's kept tokens are committed this way, before their verifier call."""
    new = [int(t) for t in tokens][:max(room_left, 0)]
    for i, t in enumerate(new):
        if t in eos:
            return new[: i + 1], "eos"
    if len(new) >= room_left:
        return new, ("length" if room_left >= remaining else "context")
    return new, None


# -- accounting ----------------------------------------------------------------------------------
def overhead_ms(cycle_ms: float, draft_ms: float, network_ms: float, queue_ms: float, verify_ms: float) -> float:
    """What a block's cycle spent outside drafting, the link, queueing and verifying (never negative)."""
    return max(0.0, cycle_ms - draft_ms - network_ms - queue_ms - verify_ms)


@dataclass
class BlockStats:
    """One round as measured (milliseconds, bytes): the one per-block record behind the generation
    result, the summary message, Prometheus and the block span. In process the link, queue and
    bytes are 0, rtt_ms is the verify time and the cycle runs from the previous block's end."""

    seq: int
    drafted: int
    accepted: int
    committed: int  # tokens this block added to the output (after truncation)
    rtt_ms: float = 0.0  # verifier send -> result (emulated link included)
    draft_ms: float = 0.0  # asking the drafter -> its block arriving
    network_ms: float = 0.0
    queue_ms: float = 0.0
    verify_ms: float = 0.0
    cycle_ms: float = 0.0  # asking for the draft -> the result committed
    bytes_up: int = 0
    bytes_down: int = 0
    batch_size: int = 1
    verifier: str = ""
    draft_compute_ms: float = 0.0  # the drafter's own compute report (drafting ahead: what was left on the critical path)
    ahead: bool = False  # the block before it was drafted ahead for (drafter_service/ahead.py)
    ahead_hit: bool = False  # ... and this block was prepared for its actual verdict
    ahead_prepared: int = 0  # verdicts prepared for the block before it
    ahead_ms: float = 0.0  # drafter time preparing them took

    @property
    def overhead_ms(self) -> float:
        return overhead_ms(self.cycle_ms, self.draft_ms, self.network_ms, self.queue_ms, self.verify_ms)


def record_block(result: GenerationResult, stats: BlockStats) -> None:
    """Add one round to a generation result's counters."""
    result.rounds += 1
    result.drafted += stats.drafted
    result.accepted += stats.accepted
    result.block_drafted.append(stats.drafted)
    result.block_accepted.append(stats.accepted)
    result.draft_s += stats.draft_ms / 1000.0
    result.verify_s += stats.verify_ms / 1000.0

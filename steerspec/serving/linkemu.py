"""Emulated network link for the coordinator↔verifier hop (the remote-verifier regime on one machine).

A message of `n` bytes sent one way is delayed by

    rtt_ms / 2 + jitter + n * 8 / (bandwidth_mbps * 1e6) seconds

where `jitter` is drawn uniformly from [-jitter_ms / 2, +jitter_ms / 2] per message (so a round
trip varies by at most ±jitter_ms) from a seeded `random.Random`, and the total never goes below 0.
The coordinator applies the uplink delay before it writes a block on the verifier stream and the
downlink delay after it reads the result, so only that link is slowed down.

Accuracy: plain `asyncio.sleep` oversleeps by the epoll timeout granularity (measured here: about
0.1–0.6 ms median, up to several ms under load). `Link.delay` therefore sleeps until `spin_ms`
before the deadline and then yields (`asyncio.sleep(0)`) until the deadline passes, which lands
within a few microseconds of it while other sessions keep running. The time actually spent is
returned, and that is what the coordinator reports as `network_ms`.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import time
from dataclasses import dataclass
from typing import Optional

from steerspec.errors import UsageError


@dataclass(frozen=True)
class LinkModel:
    """Parameters of the emulated link; `link(key)` makes one seeded link per session."""

    rtt_ms: float = 0.0
    jitter_ms: float = 0.0
    bandwidth_mbps: float = 0.0  # 0 = unlimited
    seed: int = 0
    spin_ms: float = 1.0  # busy-yield window before each deadline (accuracy vs. CPU)

    def validate(self) -> "LinkModel":
        for name in ("rtt_ms", "jitter_ms", "bandwidth_mbps", "spin_ms"):
            value = getattr(self, name)
            if not (value >= 0.0) or value != value or value == float("inf"):
                raise UsageError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
        if self.jitter_ms > self.rtt_ms:
            raise UsageError(f"--jitter-ms ({self.jitter_ms}) must not exceed --rtt-ms ({self.rtt_ms})")
        return self

    @property
    def enabled(self) -> bool:
        return self.rtt_ms > 0 or self.bandwidth_mbps > 0

    def one_way_s(self, nbytes: int, rng: Optional[random.Random] = None) -> float:
        """Delay in seconds of one message of `nbytes` bytes in one direction."""
        delay_ms = self.rtt_ms / 2.0
        if self.jitter_ms > 0 and rng is not None:
            delay_ms += rng.uniform(-self.jitter_ms / 2.0, self.jitter_ms / 2.0)
        seconds = max(0.0, delay_ms) / 1000.0
        if self.bandwidth_mbps > 0:
            seconds += nbytes * 8.0 / (self.bandwidth_mbps * 1e6)
        return seconds

    def link(self, key: str = "") -> "Link":
        """A link whose jitter stream is seeded from (seed, key): deterministic per session."""
        digest = hashlib.blake2b(f"{self.seed}:{key}".encode(), digest_size=8).digest()
        return Link(self, random.Random(int.from_bytes(digest, "little")))


NO_LINK = LinkModel()


def add_link_arguments(parser: argparse.ArgumentParser) -> None:
    """--rtt-ms, --jitter-ms, --bandwidth-mbps, --link-seed: the emulated coordinator↔verifier link."""
    parser.add_argument("--rtt-ms", type=float, default=0.0,
                        help="emulated coordinator↔verifier round trip in ms (default: 0, no delay)")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="emulated RTT jitter (uniform, ± half each way)")
    parser.add_argument("--bandwidth-mbps", type=float, default=0.0,
                        help="emulated link bandwidth; adds size/bandwidth per message (0 = unlimited)")
    parser.add_argument("--link-seed", type=int, default=0, help="seed of the emulated jitter")


def link_from_args(args: argparse.Namespace) -> LinkModel:
    """The checked LinkModel of `add_link_arguments`' flags (absent flags: no delay)."""
    return LinkModel(rtt_ms=float(getattr(args, "rtt_ms", 0.0) or 0.0),
                     jitter_ms=float(getattr(args, "jitter_ms", 0.0) or 0.0),
                     bandwidth_mbps=float(getattr(args, "bandwidth_mbps", 0.0) or 0.0),
                     seed=int(getattr(args, "link_seed", 0) or 0)).validate()


class Link:
    """One session's view of the link: `await link.up(n)` / `await link.down(n)` -> seconds spent."""

    def __init__(self, model: LinkModel, rng: random.Random):
        self.model = model
        self.rng = rng

    async def up(self, nbytes: int) -> float:
        return await self.delay(self.model.one_way_s(nbytes, self.rng))

    async def down(self, nbytes: int) -> float:
        return await self.delay(self.model.one_way_s(nbytes, self.rng))

    async def delay(self, seconds: float) -> float:
        """Wait `seconds` accurately (see module docstring); returns the time actually spent."""
        start = time.perf_counter()
        if seconds <= 0:
            return 0.0
        deadline = start + seconds
        coarse = seconds - self.model.spin_ms / 1000.0
        if coarse > 0:
            await asyncio.sleep(coarse)
        while time.perf_counter() < deadline:
            await asyncio.sleep(0)
        return time.perf_counter() - start

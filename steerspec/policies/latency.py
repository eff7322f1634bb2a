"""SteerSpec's latency-aware policy for the remote regime: k maximising committed tokens per second.

Model of one block of k drafts: expected committed tokens E(k) = 1 + Σ_{j=1..k} Π_{i≤j} a_i, with
a_i the estimated probability that draft i is accepted given drafts 1..i-1 were (EWMA per
position from feedback, prior a0); cost T(k) = k·d + v0 + v1·k + o, with d the drafter's time
per token, v0 + v1·k the verify time (EWMA of verify_ms per block and per drafted token), and o
the queue + network time per block (EWMA). Before each block k = argmax E(k)/T(k) over 1..max.
Inside the block, after draft i with top drafter probability c, drafting on pays only when the
expected gain per millisecond of one more draft, s·min(a_{i+1}, c)/d (s the survival so far),
is at least the block's best rate E/T; otherwise the block stops. With o = 0 and a fast
verifier this picks a short k; a large o makes long blocks profitable. The estimates survive
`reset` (a new sequence on the same pair and link); the first block of a fresh policy drafts ≤ 4.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from steerspec.policies.base import BlockFeedback, DraftStep, PolicyBase, check_k, check_open_unit
from steerspec.policies.registry import Key, register


@register("latency", {"max": Key(int, 32, "most tokens per block"),
                      "a0": Key(float, 0.7, "prior per-position acceptance"),
                      "beta": Key(float, 0.2, "EWMA weight of new observations"),
                      "stop": Key(bool, True, "stop early on low drafter confidence")},
          doc="latency-aware: argmax expected tokens per second from measured costs", length_keys=("max",))
class LatencyAware(PolicyBase):
    """Chooses k from per-position acceptance estimates and the measured block costs."""

    name = "latency"
    stops_early = True

    def __init__(self, max: int = 32, a0: float = 0.7, beta: float = 0.2, stop: bool = True,
                 context: Optional[Any] = None) -> None:
        self.max_k = check_k(max, "max")
        self.a0 = check_open_unit(a0, "a0")
        self.beta = check_open_unit(beta, "beta")
        self.stops_early = bool(stop)
        self.reset()

    def reset(self) -> None:
        """A new sequence: the learned costs and acceptance describe the pair and the link, not the
        sequence, so they are kept once something was learned (`forget` clears them)."""
        if getattr(self, "seen", 0):
            self._survival, self._rate = 1.0, 0.0
            return
        self.forget()

    def forget(self) -> None:
        """Back to the priors."""
        self.accept: List[float] = [self.a0] * self.max_k
        self.draft_ms = 1.0
        self.verify0_ms = 1.0
        self.verify1_ms = 0.0
        self.overhead_ms = 0.0
        self.seen = 0
        self._survival = 1.0
        self._rate = 0.0

    # --- model ---
    def expected_tokens(self, k: int) -> float:
        total, survival = 1.0, 1.0
        for i in range(k):
            survival *= self.accept[i]
            total += survival
        return total

    def block_ms(self, k: int) -> float:
        return k * self.draft_ms + self.verify0_ms + self.verify1_ms * k + self.overhead_ms

    def rate(self, k: int) -> float:
        return self.expected_tokens(k) / max(self.block_ms(k), 1e-6)

    def next_k(self) -> int:
        best = max(range(1, self.max_k + 1), key=self.rate)
        self._survival, self._rate = 1.0, self.rate(best)
        return best if self.seen else min(best, 4)

    def observe(self, step: DraftStep) -> bool:
        i = step.position
        self._survival *= self.accept[i]
        if i + 1 >= self.max_k:
            return True
        confidence = float(step.probs.max())
        gain_per_ms = self._survival * min(self.accept[i + 1], confidence) / max(self.draft_ms + self.verify1_ms, 1e-6)
        return gain_per_ms < self._rate

    def update(self, feedback: BlockFeedback) -> None:
        drafted, accepted = feedback.drafted, feedback.accepted
        b = self.beta
        for i in range(min(drafted, accepted + 1)):  # positions the verifier judged
            hit = 1.0 if i < accepted else 0.0
            self.accept[i] = min(0.99, max(0.01, (1 - b) * self.accept[i] + b * hit))
        if drafted > 0 and feedback.draft_ms > 0:
            self.draft_ms = (1 - b) * self.draft_ms + b * feedback.draft_ms / drafted if self.seen else feedback.draft_ms / drafted
        if feedback.verify_ms > 0:
            per_token = 0.05 * feedback.verify_ms / max(drafted, 1)  # a small share grows with k
            base = feedback.verify_ms - per_token * drafted
            self.verify0_ms = (1 - b) * self.verify0_ms + b * base if self.seen else base
            self.verify1_ms = (1 - b) * self.verify1_ms + b * per_token if self.seen else per_token
        overhead = feedback.queue_ms + feedback.network_ms
        self.overhead_ms = (1 - b) * self.overhead_ms + b * overhead if self.seen else overhead
        self.seen += 1

    def state_dict(self) -> Dict[str, Any]:
        return {"accept": list(self.accept), "draft_ms": self.draft_ms, "verify0_ms": self.verify0_ms,
                "verify1_ms": self.verify1_ms, "overhead_ms": self.overhead_ms, "seen": self.seen}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        accept = [float(a) for a in state["accept"]]
        if len(accept) != self.max_k:
            raise ValueError(f"state has {len(accept)} positions, policy has max={self.max_k}")
        self.accept = accept
        for key in ("draft_ms", "verify0_ms", "verify1_ms", "overhead_ms"):
            setattr(self, key, float(state[key]))
        self.seen = int(state["seen"])

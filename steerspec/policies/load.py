"""Load-aware block sizes: each block's size maximises committed tokens per second given the verifier's load.

A block of n drafts (a chain's k, or a draft tree's first n nodes breadth-first; n = 0 is the verifier alone, one
token per round trip) commits E(n) = 1 + Σ_{i<n} p_i tokens on average, p_i the chance that slot i ends on the
accepted path (for a chain: the first i + 1 drafts accepted), learned per slot from the verdicts (a running mean
from the prior a0^(i+1), an EWMA with weight beta once settled). Its round takes

    T(n) = d(n) + o + (1 + w) · c(B · (n + 1))

with d(n) the drafter's cost line (`CostLine`, d(0) its per-call part), o the EWMA of network and overhead ms, c the
verifier's pass cost against the rows it scores — measured by the verifier over its own recent passes and sent
with every result (VerifyResult.cost_fixed_ms / cost_per_row_ms) — B the EWMA of blocks per pass
(VerifyResult.batch_size) and w the EWMA of the time a block waited for its pass, in passes (queue_ms /
verify_ms). B · (n + 1) prices the block as if every session sharing the pass sized its blocks alike: they run
this same policy on the same signal, so they converge on the size that is best for all of them, and a session does
not grow its block because its own rows are a small part of a crowded pass (the selfish choice, which on a busy
verifier costs every session more than it gains). Without a report (in process, or an older verifier) c is the
session's own verify cost line and B = 1, w = 0: then the choice is the `latency` policy's without its stop.

A worked example with the pass cost measured on an AMD EPYC VM (2 cores, edge placement, RTT 50: c = 41.6 ms +
4.25 ms per row, docs/results/capacity.md): alone on the verifier, the default tree's 5 nodes round in about 1.3×
the verifier alone's time for about 2.1 tokens, so they pay; at 8 blocks per pass they round in about 2.7× for the
same tokens, and one draft (about 1.35× for 1.65 tokens) pays best.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from steerspec.policies.base import BlockFeedback, PolicyBase, check_k, check_open_unit
from steerspec.policies.catalog import Key, register
from steerspec.policies.costline import CostLine

CLIP = (0.001, 0.999)
PRIOR_COUNT = 2.0  # the prior weighs as this many verdicts
MAX_WAIT = 2.0  # passes a block is modelled to wait for its own, at most
FIRST_K = 4  # the first block's size, before any cost was measured
STALE = 0.01  # a size whose cost-line weight fell below this was not measured recently


def _clip(p: float) -> float:
    return min(CLIP[1], max(CLIP[0], p))


@register("load", {"max": Key(int, 32, "most tokens per block"),
                   "a0": Key(float, 0.7, "prior per-draft acceptance"),
                   "beta": Key(float, 0.1, "EWMA weight of new observations")},
          doc="load-aware: block size maximising tokens per second at the verifier's reported load (0 = no drafts)",
          length_keys=("max",), trees=True)
class LoadAware(PolicyBase):
    """Sizes blocks (0..max drafts or tree nodes) from acceptance per slot, the link and the verifier's load."""

    name = "load"
    warm_start = True  # the pair, the link and the verifier's load, not a sequence: new sessions start from it
    min_k = 0  # a block may carry no drafts: the verifier alone

    def __init__(self, max: int = 32, a0: float = 0.7, beta: float = 0.1, context: Optional[Any] = None) -> None:
        self.max_k = check_k(max, "max")
        self.a0 = check_open_unit(a0, "a0")
        self.beta = check_open_unit(beta, "beta")
        self.forget()

    def forget(self) -> None:
        """Back to the priors."""
        self.include: List[float] = [self.a0 ** (i + 1) for i in range(self.max_k)]
        self.judged: List[float] = [0.0] * self.max_k
        # both lines in rows (n + 1 for n drafts), so blocks of no drafts measure them too
        self.draft = CostLine(self.max_k + 1, self.beta, prior=(0.0, 1.0), prior_share=0.5, min_share=0.1)
        self.verify = CostLine(self.max_k + 1, self.beta, prior=(1.0, 0.0), prior_share=0.05, residuals=True)
        self.overhead_ms = 0.0
        self.blocks = 1.0  # blocks per verifier pass
        self.wait = 0.0  # a block's wait for its pass, in passes
        self.pass_line = (0.0, 0.0)  # the verifier's reported cost: fixed ms, ms per row (0, 0: none)
        self.seen = 0
        self.last_k = 0

    # --- model ---
    def expected_tokens(self, n: int) -> float:
        return 1.0 + sum(self.include[:n])

    def pass_ms(self) -> List[float]:
        """The modelled verify pass for blocks of n = 0..max drafts from every session in it."""
        fixed, per_row = self.pass_line
        if per_row > 0.0 or fixed > 0.0:
            return [fixed + per_row * self.blocks * (n + 1) for n in range(self.max_k + 1)]
        return self.verify.table()  # in process: the session's own verify line

    def block_ms(self) -> List[float]:
        """The modelled round of a block of n = 0..max drafts: drafting, the link and overhead, wait and pass."""
        return [d + self.overhead_ms + (1.0 + self.wait) * v for d, v in zip(self.draft.table(), self.pass_ms())]

    def rates(self) -> List[float]:
        """E(n)/T(n) for n = 0..max."""
        return [self.expected_tokens(n) / max(ms, 1e-6) for n, ms in enumerate(self.block_ms())]

    def best(self) -> int:
        """argmax_n E(n)/T(n) over 0..max (the smaller n on a tie)."""
        rates = self.rates()
        return max(range(len(rates)), key=lambda n: (rates[n], -n))

    def next_k(self) -> int:
        """The best size; while fewer than two sizes were measured recently (the cost lines are not identified),
        the first block drafts min(FIRST_K, max) and later ones the best ± 1."""
        best = self.best()
        recent = self.draft.recent_lengths(STALE)
        if not recent:
            best = min(FIRST_K, self.max_k)
        elif len(recent) < 2 and self.max_k >= 1:
            only = recent[0] - 1  # rows -> drafts
            best = best if best != only else (only + 1 if only < self.max_k else only - 1)
        self.last_k = best
        return best

    def update(self, feedback: BlockFeedback) -> None:
        b = self.beta
        if feedback.batch_size:
            self.blocks = float(feedback.batch_size) if not self.seen else \
                (1 - b) * self.blocks + b * float(feedback.batch_size)
        if feedback.cost_per_row_ms > 0.0 or feedback.cost_fixed_ms > 0.0:
            self.pass_line = (float(feedback.cost_fixed_ms), float(feedback.cost_per_row_ms))
        if feedback.verify_ms > 0.0:
            wait = min(MAX_WAIT, feedback.queue_ms / feedback.verify_ms)
            self.wait = wait if not self.seen else (1 - b) * self.wait + b * wait
        overhead = feedback.network_ms + feedback.overhead_ms
        self.overhead_ms = overhead if not self.seen else (1 - b) * self.overhead_ms + b * overhead
        self.seen += 1
        drafted = min(int(feedback.drafted), self.max_k)
        self.draft.add(drafted + 1, feedback.draft_ms)
        self.verify.add(drafted + 1, feedback.verify_ms)
        on_path = set(feedback.path) if feedback.path else set(range(int(feedback.accepted)))
        for i in range(drafted):  # every drafted slot was judged: on the accepted path or not
            w = max(b, 1.0 / (self.judged[i] + PRIOR_COUNT + 1.0))
            self.include[i] = _clip((1 - w) * self.include[i] + w * (1.0 if i in on_path else 0.0))
            self.judged[i] += 1.0

    def state_dict(self) -> Dict[str, Any]:
        return {"include": list(self.include), "judged": list(self.judged), "draft": self.draft.state_dict(),
                "verify": self.verify.state_dict(), "overhead_ms": self.overhead_ms, "blocks": self.blocks,
                "wait": self.wait, "pass_line": list(self.pass_line), "seen": self.seen}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        include = [float(p) for p in state["include"]]
        judged = [float(n) for n in state["judged"]]
        if len(include) != self.max_k or len(judged) != self.max_k:
            raise ValueError(f"state has {len(include)} slots, policy has max={self.max_k}")
        self.draft.load_state_dict(state["draft"])
        self.verify.load_state_dict(state["verify"])
        fixed, per_row = (float(v) for v in state["pass_line"])
        self.include, self.judged, self.pass_line = include, judged, (fixed, per_row)
        self.overhead_ms, self.blocks, self.wait = float(state["overhead_ms"]), float(state["blocks"]), \
            float(state["wait"])
        self.seen = int(state["seen"])

    def __repr__(self) -> str:
        return f"LoadAware(max={self.max_k})"

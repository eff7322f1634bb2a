"""SteerSpec's latency-aware policy for the remote regime: k maximising committed tokens per second.

Model of a block of k drafts. Expected committed tokens E(k) = 1 + Σ_{j=1..k} s_j, s_j = Π_{i≤j}
a_i, with a_i the probability that draft i is accepted given drafts 1..i-1 were (per position over
the positions the verifier judged, clipped to [0.01, 0.99]: the prior a0 counts as two judgments and
the estimate is their running mean until its weight falls to beta, an EWMA from then on; a plain
EWMA from a0 took ~20 blocks to forget the prior, and the first blocks on the real pair drafted 4
where 2 was best). Expected time T(k) = d0 + d1·k + V(k) + o: the draft line is fitted to the
measured draft_ms of past blocks against their drafted length (`CostLine`), so d0 holds the drafter
call's per-block cost (RPC, the first step's prefill) and d1 one drafter step; V(k) = v0 + v1·k +
r_k, the verify line plus a per-length residual, made non-decreasing in k, because a verifier's cost
need not be a line in k (SteerSpec's on a CPU: about flat for 1–2 drafts, 15–20 ms more from 3,
where its out-major weight copies stop; a straight line priced the longer blocks too cheaply: 0.95×
the best fixed k at RTT 50); o is the EWMA of queue + network + overhead ms per block (everything
else a block waits for, whatever its length). Priors: d0 + d1·k = k ms, v0 + v1·k = 1 ms, o = 0; a
line measured at one length only puts half (draft) or 5% (verify) of its cost per token. Before each
block k = argmax E(k)/T(k) over 1..max, with R that best rate.

Inside the block, after draft i with top drafter probability c, the survival becomes
s_i = s_{i-1}·clip(a_i·f(c)), f(c) the observed ÷ predicted acceptance of judged drafts in c's
quarter of [0, 1] (EWMA; 1 until such drafts were judged), so c counts only as far as it has
predicted acceptance. j more drafts add Σ_{m=1..j} s_i·a_{i+1}···a_{i+m} expected committed tokens
for j·d1 + V(i+j) − V(i) ms; the block stops when no j earns more than the long-run rate R would
in that time (look-ahead: the per-position acceptance often rises along the block, so a one-step test
stopped blocks that two more drafts would have paid for: 0.95× no stop in process, one run). o
is no part of a draft's marginal cost: a large o keeps drafting.

Exploration: the first block drafts min(4, max); until blocks of two lengths were measured (the
lines are not identified), for at most the first 4 blocks, k avoids the measured length (best,
else that length ± 2) and the stop is off. Later, whenever only one length was measured recently
(every other length's weight in the lines fell below STALE: about 90 blocks at the default beta
0.05, 20 at 0.2), one block drafts best ± 1 with the stop off: otherwise a slope tilted by a few
slow blocks would keep the policy at one length and never be corrected. beta = 0.05 by default
(an effective memory of about 20 blocks): at 0.2 the per-position acceptance followed the last ~5
blocks, and on the real pair its noise made the policy draft too little (`bench policies`, RTT 50:
0.93× the best fixed k at 0.2, 1.01× at 0.05, per prompt). The estimates survive `reset` (a new
sequence on the same pair and link) and, through the services, a drafter service starts each new
`latency` session from the state of its latest one (`warm_start`), so only the first session
explores.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from steerspec.policies.base import BlockFeedback, DraftStep, PolicyBase, check_k, check_open_unit
from steerspec.policies.catalog import Key, register
from steerspec.policies.costline import CostLine

FIRST_K = 4
EXPLORE_BLOCKS = 4
BINS = 4  # confidence quarters for f(c)
STALE = 0.01  # a length whose cost-line weight fell below this (~90 blocks at beta 0.05) is stale
CLIP = (0.01, 0.99)
PRIOR_COUNT = 2.0  # the prior a0 weighs as this many judgments


def _clip(a: float) -> float:
    return min(CLIP[1], max(CLIP[0], a))


@register("latency", {"max": Key(int, 32, "most tokens per block"),
                      "a0": Key(float, 0.7, "prior per-position acceptance"),
                      "beta": Key(float, 0.05, "EWMA weight of new observations"),
                      "stop": Key(bool, True, "stop early when no further drafts would pay")},
          doc="latency-aware: argmax expected tokens per second from measured costs", length_keys=("max",))
class LatencyAware(PolicyBase):
    """Chooses k from per-position acceptance estimates and the measured block costs."""

    name = "latency"
    stops_early = True
    warm_start = True  # a drafter service starts new sessions from what the last one learned

    def __init__(self, max: int = 32, a0: float = 0.7, beta: float = 0.05, stop: bool = True,
                 context: Optional[Any] = None) -> None:
        self.max_k = check_k(max, "max")
        self.a0 = check_open_unit(a0, "a0")
        self.beta = check_open_unit(beta, "beta")
        self.stops_early = bool(stop)
        self.forget()

    def reset(self) -> None:
        """A new sequence: the learned costs and acceptance describe the pair and the link, not the
        sequence, so they are kept (`forget` clears them)."""
        self._block()

    def forget(self) -> None:
        """Back to the priors."""
        self.accept: List[float] = [self.a0] * self.max_k
        self.judged: List[float] = [0.0] * self.max_k  # judgments seen per position (for the prior's fade)
        self.draft = CostLine(self.max_k, self.beta, prior=(0.0, 1.0), prior_share=0.5, min_share=0.1)
        self.verify = CostLine(self.max_k, self.beta, prior=(1.0, 0.0), prior_share=0.05, residuals=True)
        self.overhead_ms = 0.0
        self.hits = [self.a0] * BINS       # EWMA of judged drafts' acceptance, per confidence bin
        self.predicted = [self.a0] * BINS  # EWMA of a_i predicted for the same drafts
        self.seen = 0
        self._tabulate()
        self._block()

    def _block(self, rate: float = 0.0, exploring: bool = True) -> None:
        self._survival, self._rate, self._exploring = 1.0, rate, exploring
        self._bins: Dict[int, int] = {}  # position -> confidence bin of the drafts observed in this block

    # --- model ---
    def expected_tokens(self, k: int) -> float:
        total, survival = 1.0, 1.0
        for i in range(k):
            survival *= self.accept[i]
            total += survival
        return total

    def _tabulate(self) -> None:
        """Cache the modelled draft and verify ms of every length: they change only with feedback, and
        the stop reads them after every draft."""
        self._draft_ms, self._verify_ms = self.draft.table(), self.verify.table()

    def block_ms(self, k: int) -> float:
        return self._draft_ms[k - 1] + self._verify_ms[k - 1] + self.overhead_ms

    def rate(self, k: int) -> float:
        return self.expected_tokens(k) / max(self.block_ms(k), 1e-6)

    def best(self) -> int:
        """argmax_k E(k)/T(k) over 1..max."""
        best_k, best_rate, total, survival = 1, -1.0, 1.0, 1.0
        for k in range(1, self.max_k + 1):
            survival *= self.accept[k - 1]
            total += survival
            rate = total / max(self.block_ms(k), 1e-6)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def calibration(self, confidence: float) -> float:
        """f(c): observed ÷ predicted acceptance of judged drafts in c's bin."""
        b = self._bin(confidence)
        return self.hits[b] / max(self.predicted[b], 1e-6)

    @staticmethod
    def _bin(confidence: float) -> int:
        return min(BINS - 1, max(0, int(confidence * BINS)))

    def next_k(self) -> int:
        best = self.best()
        measured = self.draft.lengths()
        exploring = len(measured) < 2 and self.seen < EXPLORE_BLOCKS
        k = best
        if not measured:
            k = min(FIRST_K, self.max_k)
        elif exploring and best in measured:
            only = measured[0]
            k = only + 2 if only + 2 <= self.max_k else max(1, only - 2)
        elif len(measured) >= 2 and len(self.verify.recent_lengths(STALE)) < 2 and self.max_k > 1:
            # the lines rest on one recent length: re-measure a neighbour, or a stale slope stays
            exploring = True
            k = best + 1 if best < self.max_k else best - 1
        self._block(self.rate(best), exploring)
        return k

    def observe(self, step: DraftStep) -> bool:
        i = step.position
        confidence = float(step.probs.max())
        self._bins[i] = self._bin(confidence)
        self._survival *= _clip(self.accept[i] * self.calibration(confidence))
        if i + 1 >= self.max_k:
            return True
        if self._exploring:
            return False
        # look ahead: go on while drafting some j more earns more than the long-run rate would in
        # their time (positions further on are often likelier to pass than the next one)
        drafted, step, verify_ms = i + 1, max(self.draft.c1, 1e-6), self._verify_ms
        base = verify_ms[i]
        survival, value = self._survival, 0.0
        for j in range(drafted, self.max_k):
            survival *= self.accept[j]
            value += survival
            extra_ms = (j + 1 - drafted) * step + max(0.0, verify_ms[j] - base)
            if value > self._rate * extra_ms:
                return False
        return True

    def update(self, feedback: BlockFeedback) -> None:
        drafted, accepted = feedback.drafted, feedback.accepted
        if drafted <= 0:
            return
        b = self.beta
        for i in range(min(drafted, accepted + 1, self.max_k)):  # positions the verifier judged
            hit = 1.0 if i < accepted else 0.0
            if i in self._bins:
                j = self._bins[i]
                self.hits[j] = (1 - b) * self.hits[j] + b * hit
                self.predicted[j] = (1 - b) * self.predicted[j] + b * self.accept[i]
            w = max(b, 1.0 / (self.judged[i] + PRIOR_COUNT + 1.0))  # a running mean until the EWMA takes over
            self.accept[i] = _clip((1 - w) * self.accept[i] + w * hit)
            self.judged[i] += 1.0
        self._bins = {}
        self.draft.add(drafted, feedback.draft_ms)
        self.verify.add(drafted, feedback.verify_ms)
        self._tabulate()
        overhead = feedback.queue_ms + feedback.network_ms + feedback.overhead_ms
        self.overhead_ms = (1 - b) * self.overhead_ms + b * overhead if self.seen else overhead
        self.seen += 1

    # --- shorthand for the fitted lines ---
    @property
    def costs(self) -> Dict[str, float]:
        """d0, d1, v0, v1 and o in ms."""
        return {"d0": self.draft.c0, "d1": self.draft.c1, "v0": self.verify.c0, "v1": self.verify.c1,
                "o": self.overhead_ms}

    def state_dict(self) -> Dict[str, Any]:
        return {"accept": list(self.accept), "draft": self.draft.state_dict(), "verify": self.verify.state_dict(),
                "overhead_ms": self.overhead_ms, "hits": list(self.hits), "predicted": list(self.predicted),
                "seen": self.seen, "judged": list(self.judged)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        accept = [float(a) for a in state["accept"]]
        if len(accept) != self.max_k:
            raise ValueError(f"state has {len(accept)} positions, policy has max={self.max_k}")
        hits, predicted = [float(h) for h in state["hits"]], [float(p) for p in state["predicted"]]
        if len(hits) != BINS or len(predicted) != BINS:
            raise ValueError(f"state has {len(hits)} confidence bins, policy has {BINS}")
        self.draft.load_state_dict(state["draft"])
        self.verify.load_state_dict(state["verify"])
        judged = [float(n) for n in state.get("judged", [1.0 / self.beta] * self.max_k)]  # older states: settled
        if len(judged) != self.max_k:
            raise ValueError(f"state has {len(judged)} judged counts, policy has max={self.max_k}")
        self.accept, self.hits, self.predicted, self.judged = accept, hits, predicted, judged
        self.overhead_ms = float(state["overhead_ms"])
        self.seen = int(state["seen"])
        self._tabulate()

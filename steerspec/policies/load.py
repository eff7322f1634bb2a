"""Load-aware block sizes: each block's size maximises committed tokens per second given the verifier's load.

A block of n drafts (a chain's k, or a draft tree's first n nodes in `cut_order`; n = 0 is the verifier alone, one
token per round trip) commits E(n) = 1 + Σ_{i<n} p_i tokens on average, p_i the chance that slot i ends on the
accepted path (for a chain: the first i + 1 drafts accepted), learned per slot from the verdicts (a running mean
from the prior a0^(i+1), an EWMA with weight beta once settled). Its round takes

    T(n) = d(n) + o + W + P,   P = c(B, B · (n + 1)),   B = 1 + (N − 1) · P / T,   W = ρ · P / 2

d(n) the drafter's compute line (`CostLine` over the drafter's own compute per block, against the block's depth + 1
— one drafter pass per level, so a tree's siblings cost no extra pass and blocks of no drafts measure it too), o
the EWMA of the rest of the round that does not grow with the block (network, the hops to the drafter and its
queue, overhead), c(B, R) = fixed + per_block · B + per_row · R the verifier's pass cost
against the blocks and rows it scores — measured by the verifier over its own passes and sent with every result
(VerifyResult.cost_fixed_ms / cost_per_block_ms / cost_per_row_ms; a block's own term is each session's attention
over its own cache, which on the batch-invariant path outweighs its rows: verifier_service/pass_costs.py), in the units
of the verifier's kernel path (cost_row_bucket / cost_block_rows, `steerspec.models.pass_shape`): on the batch-invariant
path B counts attention products (one per 5 rows of a block on SmolLM2) and R the rows padded to the bucket of 16,
averaged over how many blocks a pass holds, so a size that tips the pass into another product pays for all of it
(at 8 sessions on the Intel Xeon VM, about 4 blocks per pass: 3-row blocks fit one product, 5-row ones need two)
— and N the sessions sharing the verifier, read from what it reports: blocks per pass B_obs
(VerifyResult.batch_size) over the share of a session's cycle its pass takes, N = 1 + (B_obs − 1) · T_obs / P_obs. For each n the closed loop is solved
as a fixed point: every session sends blocks of n drafts (they run this same policy on the same signal, so they
converge on the size that is best for all of them, and a session does not grow its block because its own rows are a
small part of a crowded pass — the selfish choice, which on a busy verifier costs every session more than it
gains); B of them arrive during a pass and share the next one; a block waits on average half a pass times ρ, the
busy share the other sessions keep the verifier at. Without a report (in process, or an older verifier) P is the
session's own verify cost line and N = 1: then the choice is the `latency` policy's without its stop.

A tree session's block is the tree's first n nodes in `cut_order` — the top-1 chain first, then the paths with one
second choice, and so on — rather than breadth-first: a draft's top-1 child is accepted far more often than its
sibling (the default tree "0,1,2,00,10" on smollm2-sd2: "00" 45% of blocks, "1" 12%), so a cut of two nodes is the
chain "0,00" (τ 1 + .65 + .45) and not the siblings "0,1" (1 + .65 + .12), and on the batch-invariant verifier a
path is also the cheaper block (its keys read in place, not gathered: the verifier prices a branching block's rows
apart, VerifyResult.cost_per_branched_row_ms, and so does the model). A cut that is not a breadth-first prefix of the
session's tree travels as DraftBlock.parents (`blocks.tree_kind`); slot i is the tree's i-th node in this order.

A worked example with the pass cost measured on an AMD EPYC VM (2 cores, edge placement, RTT 50, float32: c = 41.6 ms
+ 4.25 ms per row, no block term, docs/results/capacity.md) and the default tree's slots accepted 65, 12, 5, 45 and 8% of the time:
alone on the verifier the model prices the tree's first 4 nodes at 1.8× the verifier alone's tokens per second;
at about 4 sessions still 4 nodes (1.5×), at 8 and 16 one draft (1.4×, 1.2×), at about 40 none (each extra row
then costs every session more than the draft earns).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from steerspec.models.pass_shape import PassShape
from steerspec.policies.base import BlockFeedback, PolicyBase, check_k, check_open_unit
from steerspec.policies.catalog import Key, register
from steerspec.policies.costline import CostLine

CLIP = (0.001, 0.999)
PRIOR_COUNT = 2.0  # the prior weighs as this many verdicts
LOAD_BETA = 0.3  # EWMA weight of the load's observations (blocks per pass, cycle, pass): it changes faster
FIXED_POINT_STEPS = 12
FIRST_K = 4  # the first block's size, before any cost was measured
STALE = 0.01  # a size whose cost-line weight fell below this was not measured recently
PROBE_EVERY = 16  # blocks after which the slot just past the best size is drafted once to refresh its estimate


Path = Tuple[int, ...]


def _clip(p: float) -> float:
    return min(CLIP[1], max(CLIP[0], p))


def cut_order(paths: Sequence[Sequence[int]]) -> List[Path]:
    """A tree's nodes (rank paths) in the order blocks smaller than the tree take them: by rank sum (the top-1 chain
    first), then depth, then path. A parent comes before its children (no larger rank sum, shallower), so every
    prefix of the order is a tree."""
    return sorted((tuple(int(r) for r in p) for p in paths), key=lambda p: (sum(p), len(p), p))


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
        self.last_judged: List[int] = [-PROBE_EVERY] * self.max_k  # the block (`seen`) each slot was last judged in
        # both lines in rows (n + 1 for n drafts), so blocks of no drafts measure them too
        self.draft = CostLine(self.max_k + 1, LOAD_BETA, prior=(0.0, 1.0), prior_share=0.5, min_share=0.1)
        self.verify = CostLine(self.max_k + 1, self.beta, prior=(1.0, 0.0), prior_share=0.05, residuals=True)
        self.overhead_ms = 0.0
        self.blocks = 1.0  # blocks per verifier pass (reported), EWMA
        self.cycle_ms = 0.0  # a block's whole round: drafting, link, overhead, queue and pass, EWMA
        self.pass_obs_ms = 0.0  # the passes that verified this session's blocks, EWMA
        # the verifier's reported cost: fixed ms, ms per block, ms per row, ms per branched row (0s: none)
        self.pass_line = (0.0, 0.0, 0.0, 0.0)
        self.pass_shape = PassShape()  # the units of that cost (the verifier's kernel path)
        self.seen = 0
        self.load_seen = False  # the load signals of this sequence observed yet (the first result sets them)
        self.last_k = 0
        self.slots: Dict[Path, int] = {}  # a tree's nodes (rank paths) -> slots, set by next_shape
        self.depths: List[int] = []  # a tree cut of n nodes -> its depth, set by next_shape (none: a chain's n)

    def reset(self) -> None:
        """A new sequence: what describes the pair and the link (acceptance per slot, the drafter's cost) carries
        over; the load signals are taken afresh from the sequence's first result, since the load may have moved
        while no session of this policy ran (a warm-started session would otherwise follow it block by block)."""
        self.load_seen = False
        self.pass_line = (0.0, 0.0, 0.0, 0.0)  # a verifier reports it again with the first result; in process none does
        self.pass_shape = PassShape()

    # --- model ---
    def expected_tokens(self, n: int) -> float:
        return 1.0 + sum(self.include[:n])

    @property
    def reported(self) -> bool:
        return any(value > 0.0 for value in self.pass_line)

    @property
    def sessions(self) -> float:
        """N, the sessions sharing the verifier: blocks per pass over the share of a cycle a pass takes."""
        if not self.reported or self.pass_obs_ms <= 0.0:
            return 1.0
        return 1.0 + max(self.blocks - 1.0, 0.0) * max(self.cycle_ms, self.pass_obs_ms) / self.pass_obs_ms

    def round_ms(self, sizes: Sequence[int], draft_ms: Sequence[float]) -> np.ndarray:
        """T(n) for each n of `sizes` (draft_ms its drafting): the closed loop's fixed point with every session sending
        blocks of n drafts. The pass is priced in the verifier's units (`PassShape`): its rows padded to the row
        bucket are averaged over how many blocks a pass holds — the session's own and each other session's with
        chance (B − 1)/(N − 1) — since on a bucketed path that, not the mean, decides how many products it
        runs."""
        sizes_a, drafting = np.asarray(sizes, dtype=float), np.asarray(draft_ms, dtype=float)
        if not self.reported:
            table = self.verify.table()
            return drafting + self.overhead_ms + np.array([table[int(n)] for n in sizes])
        fixed, per_block, per_row, per_branched = self.pass_line
        shape, sessions = self.pass_shape, self.sessions
        others = max(int(math.ceil(sessions - 1.0 - 1e-9)), 0)
        rows = sizes_a + 1.0
        units = np.array([shape.block_units(r) for r in rows])
        gathered = np.array([r * per_branched if self.branched(int(n)) else 0.0 for n, r in zip(sizes, rows)])
        padded = np.array([[shape.padded_rows((1 + j) * r) for j in range(others + 1)] for r in rows])  # [S, others+1]
        log_comb = np.array([math.lgamma(others + 1) - math.lgamma(k + 1) - math.lgamma(others - k + 1)
                             for k in range(others + 1)])  # log C(others, j), for `_mean_over_passes`
        blocks = np.full(len(rows), max(self.blocks, 1.0))
        total = drafting + self.overhead_ms + fixed
        for _ in range(FIXED_POINT_STEPS):
            rows_ms = per_row * _mean_over_passes(padded, blocks, log_comb)
            pass_ms = fixed + blocks * (per_block * units + gathered) + rows_ms
            busy = np.minimum(1.0, (sessions - 1.0) * pass_ms / np.maximum(total * blocks, 1e-6))  # the others' share
            total = drafting + self.overhead_ms + busy * pass_ms / 2.0 + pass_ms
            blocks = np.minimum(sessions, 1.0 + (sessions - 1.0) * pass_ms / total)
        return total

    def depth(self, n: int) -> int:
        """Drafter passes a block of n drafts takes: a chain's n, a tree cut's deepest node (`next_shape`)."""
        return self.depths[n] if n < len(self.depths) else n

    def branched(self, n: int) -> bool:
        """Whether a block of n drafts is a tree that branches: fewer levels than nodes (a chain's never is)."""
        return self.depth(n) < n

    @property
    def limit(self) -> int:
        """The largest block: max, or a tree session's node count (`next_shape`)."""
        return min(self.max_k, len(self.depths) - 1) if self.depths else self.max_k

    def block_ms(self) -> List[float]:
        """The modelled round of a block of n = 0..max drafts."""
        draft = self.draft.table()
        sizes = list(range(self.max_k + 1))
        return [float(ms) for ms in self.round_ms(sizes, [draft[self.depth(n)] for n in sizes])]

    def rates(self) -> List[float]:
        """E(n)/T(n) for n = 0..max."""
        return [self.expected_tokens(n) / max(ms, 1e-6) for n, ms in enumerate(self.block_ms())]

    def best(self) -> int:
        """argmax_n E(n)/T(n) over 0..max, or 0..the tree's nodes (the smaller n on a tie)."""
        rates = self.rates()[:self.limit + 1]
        return max(range(len(rates)), key=lambda n: (rates[n], -n))

    def next_shape(self, tree: Sequence[Sequence[int]]) -> Tuple[Path, ...]:
        """A tree session's block: the tree's first next_k() nodes in `cut_order`, breadth-first."""
        order = cut_order(tree)
        self.slots = {path: i for i, path in enumerate(order)}
        self.depths = [0]
        for path in order:
            self.depths.append(max(self.depths[-1], len(path)))
        chosen = order[:min(self.next_k(), len(order))]
        return tuple(sorted(chosen, key=lambda p: (len(p), p)))

    def next_k(self) -> int:
        """The best size; while fewer than two depths were drafted recently (the drafter's cost line is not
        identified), the first block drafts min(FIRST_K, max) and a later one whose depth is the only one measured
        drafts the nearest size of another depth, deeper first (a chain's best ± 1). In depths, not sizes: a tree's
        cuts of 2 to 5 nodes may all be 2 deep, and taking them for new depths bumped every block past its best.
        Otherwise, once every PROBE_EVERY blocks, one node more than the best: a slot never drafted keeps its
        estimate from the few verdicts it had (a tree's third sibling, judged 5 times, stuck at 5% where it ends on
        the accepted path of about one block in six), and only drafting it again can show that it pays."""
        best = self.best()
        recent = self.draft.recent_lengths(STALE)
        if not recent:
            best = min(FIRST_K, self.limit)
        elif len(recent) < 2 and self.depth(best) == recent[0] - 1:  # the line's lengths are depth + 1
            only = recent[0] - 1
            deeper = [n for n in range(best + 1, self.limit + 1) if self.depth(n) != only]
            shallower = [n for n in range(best - 1, -1, -1) if self.depth(n) != only]
            best = (deeper or shallower or [best])[0]
        elif best < self.limit and self.seen - self.last_judged[best] >= PROBE_EVERY:
            best += 1
        self.last_k = best
        return best

    def update(self, feedback: BlockFeedback) -> None:
        b, fast = self.beta, LOAD_BETA  # the load moves faster than the pair and the link
        first = not self.load_seen
        if feedback.batch_size:
            self.blocks = float(feedback.batch_size) if first else (1 - fast) * self.blocks + fast * feedback.batch_size
        line = (float(feedback.cost_fixed_ms), float(feedback.cost_per_block_ms), float(feedback.cost_per_row_ms),
                float(feedback.cost_per_branched_row_ms))
        if any(value > 0.0 for value in line):
            self.pass_line = line
            self.pass_shape = PassShape(max(int(feedback.cost_row_bucket), 1),
                                        max(float(feedback.cost_block_rows), 0.0))
        if feedback.verify_ms > 0.0:
            cycle = feedback.draft_ms + feedback.network_ms + feedback.overhead_ms + feedback.queue_ms + \
                feedback.verify_ms
            self.cycle_ms = cycle if first else (1 - fast) * self.cycle_ms + fast * cycle
            self.pass_obs_ms = feedback.verify_ms if first else (1 - fast) * self.pass_obs_ms + fast * feedback.verify_ms
        # the drafter's own compute grows with the block; the hop to it and its queue do not: they join the overhead
        compute = feedback.draft_compute_ms if feedback.draft_compute_ms > 0.0 else feedback.draft_ms
        overhead = feedback.network_ms + feedback.overhead_ms + max(feedback.draft_ms - compute, 0.0)
        self.overhead_ms = overhead if first else (1 - fast) * self.overhead_ms + fast * overhead
        self.seen += 1
        self.load_seen = self.load_seen or feedback.verify_ms > 0.0
        drafted = min(int(feedback.drafted), self.max_k)
        depth = max((len(p) for p in feedback.shape), default=drafted)  # a chain's block (no shape): its drafts
        self.draft.add(min(depth, self.max_k) + 1, compute)
        self.verify.add(drafted + 1, feedback.verify_ms)
        judged, on_path = self._slots(feedback, drafted)
        for i in judged:  # every drafted slot was judged: on the accepted path or not
            w = max(b, 1.0 / (self.judged[i] + PRIOR_COUNT + 1.0))
            self.include[i] = _clip((1 - w) * self.include[i] + w * (1.0 if i in on_path else 0.0))
            self.judged[i] += 1.0
            self.last_judged[i] = self.seen

    def _slots(self, feedback: BlockFeedback, drafted: int) -> Tuple[List[int], set]:
        """The slots a block drafted and those on its accepted path: a tree block's nodes by their place in the
        tree's `cut_order` (its shape names them), else the first `drafted` slots and a chain's accepted prefix."""
        if feedback.shape and all(tuple(p) in self.slots for p in feedback.shape):
            slot = [self.slots[tuple(p)] for p in feedback.shape]
            return [i for i in slot if i < self.max_k], {slot[node] for node in feedback.path}
        on_path = set(feedback.path) if feedback.path else set(range(int(feedback.accepted)))
        return list(range(drafted)), on_path

    def state_dict(self) -> Dict[str, Any]:
        return {"include": list(self.include), "judged": list(self.judged), "last_judged": list(self.last_judged),
                "draft": self.draft.state_dict(),
                "verify": self.verify.state_dict(), "overhead_ms": self.overhead_ms, "blocks": self.blocks,
                "cycle_ms": self.cycle_ms, "pass_obs_ms": self.pass_obs_ms, "pass_line": list(self.pass_line),
                "pass_shape": list(self.pass_shape), "seen": self.seen}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        include = [float(p) for p in state["include"]]
        judged = [float(n) for n in state["judged"]]
        if len(include) != self.max_k or len(judged) != self.max_k:
            raise ValueError(f"state has {len(include)} slots, policy has max={self.max_k}")
        self.draft.load_state_dict(state["draft"])
        self.verify.load_state_dict(state["verify"])
        line = [float(v) for v in state["pass_line"]]
        if len(line) == 2:  # a state saved before the verifier reported a block's own cost
            line = [line[0], 0.0, line[1]]
        line += [0.0] * (4 - len(line))  # ... or a branched row's
        self.include, self.judged, self.pass_line = include, judged, (line[0], line[1], line[2], line[3])
        self.overhead_ms, self.blocks = float(state["overhead_ms"]), float(state["blocks"])
        self.cycle_ms, self.pass_obs_ms = float(state["cycle_ms"]), float(state["pass_obs_ms"])
        bucket, block_rows = state.get("pass_shape", (1, 0.0))  # a state saved before the verifier named its units
        self.pass_shape = PassShape(int(bucket), float(block_rows))
        self.seen = int(state["seen"])
        last = state.get("last_judged")  # absent from a state saved before probing: probe soon
        self.last_judged = [int(b) for b in last] if last and len(last) == self.max_k else [-PROBE_EVERY] * self.max_k

    def __repr__(self) -> str:
        return f"LoadAware(max={self.max_k})"


def _mean_over_passes(padded: np.ndarray, blocks: np.ndarray, log_comb: np.ndarray) -> np.ndarray:
    """Per size s, Σ_j P(j) · padded[s, j]: a pass holds the session's own block and j of the other sessions' ones
    (len(log_comb) − 1 of them, log_comb[j] = log C(others, j)), j binomial with mean blocks[s] − 1 (each other
    session's block in it with the same chance)."""
    others = len(log_comb) - 1
    if others == 0:
        return padded[:, 0]
    chance = np.clip((blocks - 1.0) / others, 1e-12, 1.0 - 1e-12)[:, None]
    j = np.arange(others + 1, dtype=float)[None, :]
    weights = np.exp(log_comb[None, :] + j * np.log(chance) + (others - j) * np.log1p(-chance))
    return (weights * padded).sum(axis=1)

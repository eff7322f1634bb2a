"""Load-aware block shapes: each block's shape maximises committed tokens per second given the verifier's load.

A block is a shape of n drafts (n = 0 is the verifier alone, one token per round trip): a chain of n, a breadth-
first prefix of the session's draft tree, or a tree grown greedily from acceptance (`shapes.candidates`). It commits
E(S) = 1 + Σ_v Π_{u ≤ v} a(u) tokens on average, a(u) the chance that node u (a rank path: "0", "00", "1", ...) is
accepted when its parent was, learned per node from the verdicts (a running mean from the prior — a0 for a top-1
child, a0·(1 − a0)^r for rank r, or what a shallower node of the same rank has learned — then an EWMA with weight
beta), so chains and trees are priced by the same estimates. Its round takes

    T(S) = d(depth S) + o + W + P,   P = c(B, B · (n + 1)),   B = 1 + (N − 1) · P / T,   W = ρ · P / 2

d the drafter's part of the round: the hop to it (h, from blocks of no drafts, which run no drafter pass) plus one
pass per level of the shape, each priced at what the coordinator waited per level of its recent blocks, the
drafter's queue included (a 5-node tree of depth 2 two passes, a chain of 4 four) — the edge drafter is shared too,
so at high load its queue grows with the depth every session drafts, and pricing that wait as a fixed overhead
would make deeper blocks look free and deepen them further; o the EWMA of the rest of the round that does not
grow with the block (network, the verifier hop, overhead), c(B, R) = fixed + per_block · B + per_row · R the
verifier's pass cost against the blocks and rows it scores — measured by the verifier over its own passes and sent
with every result (VerifyResult.cost_fixed_ms / cost_per_block_ms / cost_per_row_ms; a block's own term is each
session's attention over its own cache, which on the batch-invariant path outweighs its rows:
verifier_service/pass_costs.py) — and N the sessions
sharing the verifier, read from what it reports: blocks per pass B_obs (VerifyResult.batch_size) over the share
of a session's cycle its pass takes, N = 1 + (B_obs − 1) · T_obs / P_obs. For each n the closed loop is solved
as a fixed point: every session sends blocks of n drafts (they run this same policy on the same signal, so they
converge on the size that is best for all of them, and a session does not grow its block because its own rows are a
small part of a crowded pass — the selfish choice, which on a busy verifier costs every session more than it
gains); B of them arrive during a pass and share the next one; a block waits on average half a pass times ρ, the
busy share the other sessions keep the verifier at. Without a report (in process, or an older verifier) P is the
session's own verify cost line and N = 1: then the choice is the `latency` policy's without its stop.

A tree session asks `next_shape(tree)` (the shape travels on the wire as DraftBlock.parents when it is not a prefix
of the session's tree); a chain session `next_k()`, the best chain. Where a tree's side branches rarely pay, the
model picks a chain (deep and narrow) at light load and short chains at heavy load.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from steerspec.policies import shapes
from steerspec.policies.base import BlockFeedback, PolicyBase, check_k, check_open_unit
from steerspec.policies.catalog import Key, register
from steerspec.policies.costline import CostLine
from steerspec.policies.shapes import Path, Shape

CLIP = (0.001, 0.999)
PRIOR_COUNT = 2.0  # the prior weighs as this many verdicts
LOAD_BETA = 0.3  # EWMA weight of the load's observations (blocks per pass, cycle, pass): it changes faster
FIXED_POINT_STEPS = 12
FIRST_K = 4  # the first block's size, before any cost was measured
RATE_SLACK = 0.05  # shapes within this share of the best rate count as tied: the one committing most is taken
PROBE_EVERY = 16  # after this many blocks of no drafts in a row, one block drafts (acceptance and costs go stale)
FLOOR_DRIFT = 0.01  # how fast the least wait per level follows larger ones
STALE = 0.01  # a depth whose cost-line weight fell below this was not measured recently


def _clip(p: float) -> float:
    return min(CLIP[1], max(CLIP[0], p))


@register("load", {"max": Key(int, 32, "most tokens per block"),
                   "a0": Key(float, 0.7, "prior per-draft acceptance"),
                   "beta": Key(float, 0.1, "EWMA weight of new observations")},
          doc="load-aware: block shape (chain, tree prefix or grown tree; 0 = no drafts) maximising tokens per "
              "second at the verifier's reported load",
          length_keys=("max",), trees=True)
class LoadAware(PolicyBase):
    """Shapes blocks (0..max drafts: chains or trees) from acceptance per node, the link and the verifier's load."""

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
        self.acc: Dict[str, float] = {}  # per node (rank path): accepted when its parent was, running mean/EWMA
        self.judged: Dict[str, float] = {}
        self.hop_ms = 0.0  # the coordinator's wait for a block of no drafts (no drafter pass), EWMA
        self.level_ms = 0.0  # its wait per level of a block beyond the hop, the drafter's queue included, EWMA
        self.level_floor_ms = 0.0  # the least of those waits (a drafter pass without a queue), drifting up slowly
        self.empty_run = 0  # blocks of no drafts in a row
        self.verify = CostLine(self.max_k + 1, self.beta, prior=(1.0, 0.0), prior_share=0.05, residuals=True)
        self.overhead_ms = 0.0
        self.blocks = 1.0  # blocks per verifier pass (reported), EWMA
        self.cycle_ms = 0.0  # a block's whole round: drafting, link, overhead, queue and pass, EWMA
        self.pass_obs_ms = 0.0  # the passes that verified this session's blocks, EWMA
        self.pass_line = (0.0, 0.0, 0.0)  # the verifier's reported cost: fixed ms, ms per block, ms per row (0s: none)
        self.seen = 0
        self.load_seen = False  # the load signals of this sequence observed yet (the first result sets them)
        self.last_k = 0
        self.last_shape: Shape = ()

    def reset(self) -> None:
        """A new sequence: what describes the pair and the link (acceptance per node, the drafter's cost) carries
        over; the load signals are taken afresh from the sequence's first result, since the load may have moved
        while no session of this policy ran (a warm-started session would otherwise follow it block by block)."""
        self.load_seen = False
        self.pass_line = (0.0, 0.0, 0.0)  # a verifier reports it again with the first result; in process none does

    # --- model ---
    def acceptance(self, path: Path) -> float:
        """a(path): the node accepted when its parent was; unjudged, what the same rank one level up learned
        (at the root, the prior)."""
        name = shapes.key(path)
        if name in self.acc:
            return self.acc[name]
        if len(path) > 1:
            return self.acceptance(path[:-2] + path[-1:])
        return self.a0 * (1.0 - self.a0) ** path[-1]

    def expected_tokens(self, n: int) -> float:
        """E of a chain of n drafts."""
        return shapes.expected_tokens(shapes.chain(n), self.acceptance)

    @property
    def reported(self) -> bool:
        return any(value > 0.0 for value in self.pass_line)

    @property
    def sessions(self) -> float:
        """N, the sessions sharing the verifier: blocks per pass over the share of a cycle a pass takes."""
        if not self.reported or self.pass_obs_ms <= 0.0:
            return 1.0
        return 1.0 + max(self.blocks - 1.0, 0.0) * max(self.cycle_ms, self.pass_obs_ms) / self.pass_obs_ms

    def round_ms(self, n: int, draft_ms: float) -> float:
        """T(n): the closed loop's fixed point with every session sending blocks of n drafts."""
        if not self.reported:
            return draft_ms + self.overhead_ms + self.verify.table()[n]
        fixed, per_block, per_row = self.pass_line
        sessions, blocks = self.sessions, max(self.blocks, 1.0)
        total = draft_ms + self.overhead_ms + fixed
        for _ in range(FIXED_POINT_STEPS):
            pass_ms = fixed + blocks * (per_block + per_row * (n + 1))
            busy = min(1.0, (sessions - 1.0) * pass_ms / max(total * blocks, 1e-6))  # the others' share
            total = draft_ms + self.overhead_ms + busy * pass_ms / 2.0 + pass_ms
            blocks = min(sessions, 1.0 + (sessions - 1.0) * pass_ms / total)
        return total

    def draft_ms(self, depth: int) -> float:
        """d: the wait for a block of this depth, the hop and one drafter pass per level."""
        return self.hop_ms + depth * self.level_ms

    def shape_ms(self, shape: Shape) -> float:
        """T(S): the modelled round of a block of this shape."""
        return self.round_ms(len(shape), self.draft_ms(shapes.depth(shape)))

    def rate(self, shape: Shape) -> float:
        """E(S)/T(S), tokens per ms."""
        return shapes.expected_tokens(shape, self.acceptance) / max(self.shape_ms(shape), 1e-6)

    def block_ms(self) -> List[float]:
        """The modelled round of a chain of n = 0..max drafts."""
        return [self.shape_ms(shapes.chain(n)) for n in range(self.max_k + 1)]

    def rates(self) -> List[float]:
        """E(n)/T(n) for chains of n = 0..max."""
        return [self.rate(shapes.chain(n)) for n in range(self.max_k + 1)]

    def best(self) -> int:
        """argmax_n E(n)/T(n) over chains of 0..max (the smaller n on a tie)."""
        rates = self.rates()
        return max(range(len(rates)), key=lambda n: (rates[n], -n))

    def _pick(self, options: Sequence[Shape], first: Shape) -> Shape:
        """The best-rated option — of those within RATE_SLACK of the best rate, the one expected to commit most (at
        one session on the Intel VM near-ties went to small blocks that paid less than the whole tree); `first`
        before any block; without the verifier's report, while fewer than two sizes were verified recently (the
        session's own verify line is not identified), the best of another size, the nearest to the only one
        measured."""
        if not self.seen:
            return first
        rated = [(self.rate(s), -len(s), s) for s in options]
        top = max(r[0] for r in rated)
        best = max((r for r in rated if r[0] >= (1.0 - RATE_SLACK) * top),
                   key=lambda r: (shapes.expected_tokens(r[2], self.acceptance), r[0]))[2]
        if not best and self.empty_run >= PROBE_EVERY:  # a probe: the best block that drafts
            best = max((r for r in rated if r[2]), key=lambda r: r[:2], default=(0.0, 0, ()))[2]
        recent = [] if self.reported else self.verify.recent_lengths(STALE)
        if len(recent) == 1 and len(best) + 1 == recent[0]:
            only = recent[0] - 1
            others = [r for r in rated if len(r[2]) != only]
            if others:
                near = min(abs(len(r[2]) - only) for r in others)
                best = max((r for r in others if abs(len(r[2]) - only) == near), key=lambda r: r[:2])[2]
        return best

    def next_shape(self, tree: Sequence[Sequence[int]]) -> Shape:
        """The best shape for a session drafting `tree` (rank paths): no drafts, a chain, a prefix of the tree or a
        grown tree, of at most max nodes and the tree's (what the verifier accepts of a block)."""
        tree = shapes.ordered(tree)
        nodes = min(self.max_k, len(tree))
        options = shapes.candidates(tree, nodes, self.acceptance)
        self.last_shape = self._pick(options, tuple(tree[:min(FIRST_K, nodes)]))
        self.last_k = len(self.last_shape)
        return self.last_shape

    def next_k(self) -> int:
        """The best chain length (a chain session's block)."""
        options = [shapes.chain(n) for n in range(self.max_k + 1)]
        self.last_shape = self._pick(options, shapes.chain(min(FIRST_K, self.max_k)))
        self.last_k = len(self.last_shape)
        return self.last_k

    def _block_shape(self, feedback: BlockFeedback) -> Shape:
        """The answered block's nodes: as the feedback names them, else the last shape chosen cut to the block's
        drafts when that fits, else a chain."""
        drafted = int(feedback.drafted)
        if feedback.shape:
            return tuple(tuple(int(r) for r in p) for p in feedback.shape)
        if len(self.last_shape) >= drafted:
            return self.last_shape[:drafted]
        return shapes.chain(drafted)

    def update(self, feedback: BlockFeedback) -> None:
        b, fast = self.beta, LOAD_BETA  # the load moves faster than the pair and the link
        first = not self.load_seen
        if feedback.batch_size:
            self.blocks = float(feedback.batch_size) if first else (1 - fast) * self.blocks + fast * feedback.batch_size
        line = (float(feedback.cost_fixed_ms), float(feedback.cost_per_block_ms), float(feedback.cost_per_row_ms))
        if any(value > 0.0 for value in line):
            self.pass_line = line
        if feedback.verify_ms > 0.0:
            cycle = feedback.draft_ms + feedback.network_ms + feedback.overhead_ms + feedback.queue_ms + \
                feedback.verify_ms
            self.cycle_ms = cycle if first else (1 - fast) * self.cycle_ms + fast * cycle
            self.pass_obs_ms = feedback.verify_ms if first else (1 - fast) * self.pass_obs_ms + fast * feedback.verify_ms
        overhead = feedback.network_ms + feedback.overhead_ms
        self.overhead_ms = overhead if first else (1 - fast) * self.overhead_ms + fast * overhead
        self.seen += 1
        self.load_seen = self.load_seen or feedback.verify_ms > 0.0
        shape = self._block_shape(feedback)[:self.max_k]
        depth = shapes.depth(shape)
        self.empty_run = self.empty_run + 1 if depth == 0 else 0
        if depth == 0:  # no drafter pass: the hop alone; the drafter's queue drains, so a level's price relaxes
            self.hop_ms = (1 - fast) * self.hop_ms + fast * feedback.draft_ms if self.hop_ms else feedback.draft_ms
            self.level_ms = (1 - b) * self.level_ms + b * self.level_floor_ms
        else:
            level = max(feedback.draft_ms - self.hop_ms, 0.0) / depth
            self.level_ms = (1 - fast) * self.level_ms + fast * level if self.level_ms else level
            floor = self.level_floor_ms
            self.level_floor_ms = level if not floor else min(level, floor + FLOOR_DRIFT * (level - floor))
        self.verify.add(len(shape) + 1, feedback.verify_ms)
        on_path = {shape[i] for i in feedback.path if 0 <= i < len(shape)} if feedback.path else \
            set(shape[:int(feedback.accepted)])
        for path in shape:  # every node whose parent was accepted was judged: on the accepted path or not
            if len(path) > 1 and path[:-1] not in on_path:
                continue
            name = shapes.key(path)
            p = self.acceptance(path)
            n = self.judged.get(name, 0.0)
            w = max(b, 1.0 / (n + PRIOR_COUNT + 1.0))
            self.acc[name] = _clip((1 - w) * p + w * (1.0 if path in on_path else 0.0))
            self.judged[name] = n + 1.0

    def state_dict(self) -> Dict[str, Any]:
        return {"acc": dict(self.acc), "judged": dict(self.judged), "hop_ms": self.hop_ms, "level_ms": self.level_ms,
                "level_floor_ms": self.level_floor_ms,
                "verify": self.verify.state_dict(), "overhead_ms": self.overhead_ms, "blocks": self.blocks,
                "cycle_ms": self.cycle_ms, "pass_obs_ms": self.pass_obs_ms, "pass_line": list(self.pass_line),
                "seen": self.seen, "max": self.max_k}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if int(state.get("max", self.max_k)) != self.max_k:
            raise ValueError(f"state is of a policy with max={state['max']}, this one has max={self.max_k}")
        acc = state.get("acc")
        if not isinstance(acc, dict):  # an older state (acceptance per breadth-first slot): the priors again
            acc, judged = {}, {}
        else:
            judged = state.get("judged", {})
        self.hop_ms, self.level_ms = float(state.get("hop_ms", 0.0)), float(state.get("level_ms", 0.0))
        self.level_floor_ms = float(state.get("level_floor_ms", 0.0))
        self.verify.load_state_dict(state["verify"])
        line = [float(v) for v in state["pass_line"]]
        if len(line) == 2:  # a state saved before the verifier reported a block's own cost
            line = [line[0], 0.0, line[1]]
        fixed, per_block, per_row = line
        self.acc = {str(k): _clip(float(v)) for k, v in acc.items()}
        self.judged = {str(k): float(v) for k, v in judged.items()}
        self.pass_line = (fixed, per_block, per_row)
        self.overhead_ms, self.blocks = float(state["overhead_ms"]), float(state["blocks"])
        self.cycle_ms, self.pass_obs_ms = float(state["cycle_ms"]), float(state["pass_obs_ms"])
        self.seen = int(state["seen"])

    def __repr__(self) -> str:
        return f"LoadAware(max={self.max_k})"

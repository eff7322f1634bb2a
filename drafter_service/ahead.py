"""Drafting ahead: while a session's block is away being verified, the drafter prepares the session's next block
for the verdicts it finds likeliest, in idle time, so that a hit sends the next block at once.

After a block leaves (the stream has written it), `Ahead.start` schedules a task on the event loop that
1. ranks the block's verdicts (`BlockKind.outcomes`: the accepted drafts, a tree's path, and the next token after
   them, by the drafter's own probabilities, from one idle pass), then
2. per verdict, likeliest first, within the budget (`AheadConfig.outcomes` verdicts and `budget_ms` of drafter time
   per block): commits the verdict to a shadow of the session (`BlockKind.feedback` on a copy: the same cache
   rollback or path keep the real verdict makes), reseeds a generator from the session's seed and the shadow's
   committed length (`rounds.block_seed`), drafts the shadow's block (`Drafter.draft_many`) and copies what that
   left in the cache after the committed prefix (`FastCachedLM.save`), then puts the cache back as the block left it.
Between verdicts the task yields to the event loop and waits while any session's real draft is queued or computing,
so prepared work yields to real requests within one prepared block (on a CPU the passes run on the loop's thread:
steerspec/serving/compute.py). At every yield the session's cache is exactly as its block left it.

When the result arrives, `take` stops the task and returns the prepared block for the actual verdict, if any: the
server commits the verdict as always and `use` loads the prepared cache slots (`FastCachedLM.load`), which then
hold the committed prefix and the prepared block's drafts exactly as drafting after the result would have left
them. Otherwise it drafts as without drafting ahead.

Exactness: a prepared block is drawn from the drafter's distribution given exactly the committed prefix, with the
generator drafting after the result would have used, and carries the q it was drawn from. Unsteered, a seed gives
the same tokens with drafting ahead on or off. Steered (SD²), the next block's steering vector comes with the
result; a prepared block is drafted with the vector of the block in flight (`steered_stale` counts them), and is
still exact, since the verifier tests it against the q it was drawn from; with SD² a seed fixes the output for a
given setting of drafting ahead.

Sessions whose cache is not the lean one (`FastCachedLM`: a GPU's graphed slot, transformers' cache), whose kind
ranks no verdicts (`BlockKind.outcomes` []: SPRINTER runs) or whose policy stops blocks early (it learns while
drafting) do not draft ahead.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence

from drafter_service.draft_sessions import Drafter, DrafterSession, DraftOutput
from steerspec.blocks.block_kind import Verdict
from steerspec.decoding import rounds
from steerspec.decoding.outcomes import Outcome
from steerspec.models.kv import CacheSlice, FastCachedLM

DEFAULT_OUTCOMES = 3
DEFAULT_BUDGET_MS = 60.0


@dataclass(frozen=True)
class AheadConfig:
    """Whether sessions draft ahead by default, and the budget per block in flight."""

    enabled: bool = True
    outcomes: int = DEFAULT_OUTCOMES  # verdicts prepared per block at most
    budget_ms: float = DEFAULT_BUDGET_MS  # drafter time spent preparing per block (0: no limit but `outcomes`)


@dataclass
class Prepared:
    """A block drafted ahead for one verdict of the block in flight."""

    outcome: Outcome
    out: DraftOutput
    cache: CacheSlice
    compute_ms: float
    steered_stale: bool  # drafted with the vector of the block in flight (SD²)


@dataclass
class AheadReport:
    """What drafting ahead did for a session's next block (its DraftBlock's ahead fields)."""

    on: bool = False
    hit: bool = False
    prepared: int = 0  # verdicts prepared for the block before it
    ahead_ms: float = 0.0  # drafter time spent preparing them
    steered_stale: bool = False


class Ahead:
    """The drafter service's drafting ahead: one task per session with a block in flight."""

    def __init__(self, drafter: Drafter, config: AheadConfig, busy: Callable[[], bool]) -> None:
        self.drafter = drafter
        self.config = config
        self.busy = busy  # whether a real draft is queued or computing
        self.tasks: Dict[str, asyncio.Task] = {}
        self.ready: Dict[str, List[Prepared]] = {}
        self.spent_ms: Dict[str, float] = {}
        self.blocks = 0  # blocks answered while drafting ahead
        self.hits = 0
        self.prepared_total = 0
        self.ahead_ms_total = 0.0
        self.stale_steered = 0  # hits drafted with the previous steering vector
        self.pending: Dict[str, Prepared] = {}  # a hit between `take` and `use`
        self.seqs: Dict[str, int] = {}  # the block each session prepares for

    def wants(self, session: DrafterSession) -> bool:
        """Whether the session drafts ahead (its own setting, else the server's) and can."""
        on = self.config.enabled if session.ahead is None else session.ahead
        policy = session.policy
        return bool(on) and isinstance(session.lm, FastCachedLM) and not getattr(policy, "stops_early", False)

    def start(self, session: DrafterSession) -> None:
        """Start preparing the session's next block for its block in flight (once the block has been sent)."""
        proposal = session.proposal
        if proposal is None or session.closed or not self.wants(session) or self.limits(session) == (0, 0.0):
            return
        if self.seqs.get(session.session_id) == proposal.seq:  # already preparing for it (an in-stream error reply)
            return
        self.stop(session)
        self.seqs[session.session_id] = proposal.seq
        self.ready[session.session_id] = []
        self.spent_ms[session.session_id] = 0.0
        self.tasks[session.session_id] = asyncio.get_running_loop().create_task(self.prepare(session, proposal.seq))

    def limits(self, session: DrafterSession):
        """(verdicts, milliseconds) the session may prepare per block."""
        outcomes = self.config.outcomes if session.ahead_outcomes is None else session.ahead_outcomes
        budget = self.config.budget_ms if session.ahead_budget_ms is None else session.ahead_budget_ms
        return max(int(outcomes), 0), max(float(budget), 0.0)

    async def idle(self) -> None:
        """Yield to the event loop, then wait while real drafting is queued or computing."""
        await asyncio.sleep(0)
        while self.busy():
            await asyncio.sleep(0.0005)

    async def prepare(self, session: DrafterSession, seq: int) -> None:
        """Rank the block's verdicts, then prepare the likeliest within the budget (see the module docstring)."""
        sid = session.session_id
        count, budget_ms = self.limits(session)
        await self.idle()
        if not self.current(session, seq):
            return
        start = time.perf_counter()
        outcomes = session.kind.outcomes(self.drafter, session, count)
        self.spent_ms[sid] += (time.perf_counter() - start) * 1e3
        for outcome in outcomes:
            if budget_ms and self.spent_ms[sid] >= budget_ms:
                break
            await self.idle()
            if not self.current(session, seq):
                return
            start = time.perf_counter()
            prepared = self.prepare_one(session, outcome)
            ms = (time.perf_counter() - start) * 1e3
            self.spent_ms[sid] += ms
            prepared.compute_ms = ms
            self.ready[sid].append(prepared)

    @staticmethod
    def current(session: DrafterSession, seq: int) -> bool:
        return not session.closed and session.proposal is not None and session.proposal.seq == seq

    def prepare_one(self, session: DrafterSession, outcome: Outcome) -> Prepared:
        """The session's next block if the block in flight gets `outcome`; the cache is put back after."""
        lm = session.lm
        n = session.proposal.committed_length
        base = lm.save(n)
        shadow = replace(session, committed=list(session.committed),
                         generator=rounds.generator(0, self.drafter.model.device))
        try:
            session.kind.feedback(self.drafter, shadow, Verdict(outcome.accepted, outcome.next_token, None,
                                                                list(outcome.path), None))
            shadow.proposal = None
            rounds.seed_block(shadow.generator, session.seed, len(shadow.committed))
            out = self.drafter.draft_many([shadow])[0]
            piece = lm.save(n)
        finally:
            lm.set_up_bias(None)
            lm.load(base)
        return Prepared(outcome, out, piece, 0.0, session.steering is not None)

    def stop(self, session: DrafterSession) -> None:
        """Stop the session's preparing task (its cache is as its block left it at every yield)."""
        task = self.tasks.pop(session.session_id, None)
        if task is not None and not task.done():
            task.cancel()

    def take(self, session: DrafterSession, accepted: int, next_token: int, path: Sequence[int]) -> AheadReport:
        """Stop preparing; the report for the next block, with the prepared block for the actual verdict if any
        (`report.hit`; `use` then loads it after the verdict is committed)."""
        sid = session.session_id
        running = sid in self.tasks
        self.stop(session)
        self.seqs.pop(sid, None)
        prepared = self.ready.pop(sid, [])
        spent = self.spent_ms.pop(sid, 0.0)
        report = AheadReport(on=running, prepared=len(prepared), ahead_ms=spent)
        if not running:
            return report
        self.blocks += 1
        self.prepared_total += len(prepared)
        self.ahead_ms_total += spent
        want = (int(accepted), int(next_token), tuple(int(node) for node in path))
        for item in prepared:
            o = item.outcome
            if (o.accepted, o.next_token, o.path) == want:
                self.hits += 1
                self.stale_steered += int(item.steered_stale)
                report.hit, report.steered_stale = True, item.steered_stale
                self.pending[sid] = item
                break
        return report

    def use(self, session: DrafterSession) -> Optional[DraftOutput]:
        """The hit `take` found, its cache slots loaded (the verdict committed first); None when it missed."""
        item = self.pending.pop(session.session_id, None)
        if item is None:
            return None
        start = time.perf_counter()
        session.lm.load(item.cache)
        out = replace(item.out, draft_ms=(time.perf_counter() - start) * 1e3)
        return out

    def drop(self, session: DrafterSession) -> None:
        """Forget a closing session's work."""
        self.stop(session)
        for table in (self.ready, self.spent_ms, self.pending, self.seqs):
            table.pop(session.session_id, None)

"""Drafting ahead: while a session's block is away being verified, the drafter prepares the session's next block
for the verdicts it finds likeliest, in idle time, so that a hit sends the next block at once.

After a block leaves (the stream has written it), `Ahead.start` schedules a task on the event loop that
1. ranks the block's verdicts (`BlockKind.outcomes`: the accepted drafts, a tree's path, and the next token after
   them, by the drafter's own probabilities, from one idle pass), then
2. prepares the likeliest `AheadConfig.outcomes` together: per verdict a fork of the session's cache
   (`FastCachedLM.fork`) and a shadow session with the verdict committed to it (`BlockKind.feedback` on the fork:
   the same rollback or path keep the real verdict makes) and its generator seeded from the session's seed and the
   shadow's committed length (`rounds.block_seed`); then the kind drafts every shadow's block in one batch
   (`BlockKind.draft_steps`: one batched pass per draft step, as for sessions drafted together); past `budget_ms`
   of drafter time (a loaded host) it stops and prepares nothing for this block.
The task yields to the event loop after every drafter pass and waits while any session's real draft is queued, so
prepared work yields to real requests within one drafter step (on a CPU every pass runs on the loop's thread:
steerspec/serving/compute.py). The session's own cache is never touched by prepared work (the ranking pass puts it
back before yielding), so `stop` only ends the task.

When the result arrives, `take` stops the task and returns the prepared block for the actual verdict, if any: the
server commits the verdict as always and `use` copies the fork's slots after the committed prefix into the
session's cache (`FastCachedLM.save` / `load`), which then holds the committed prefix and the prepared block's
drafts exactly as drafting after the result would have left them. Otherwise it drafts as without drafting ahead.

Exactness: a prepared block is drawn from the drafter's distribution given exactly the committed prefix, with the
generator drafting after the result would have used, and carries the q it was drawn from. Unsteered, a seed gives
the same tokens with drafting ahead on or off (to the float rounding of batched passes, as for sessions drafted
together: ~1e-6 in the logits). Steered (SD²), the next block's steering vector comes with the
result; a prepared block is drafted with the vector of the block in flight (`steered_stale` counts them), and is
still exact, since the verifier tests it against the q it was drawn from; with SD² a seed fixes the output for a
given setting of drafting ahead.

A drafter whose passes run on a compute thread (a GPU: steerspec/serving/compute.py) does not draft ahead, since
prepared passes run on the event loop's thread and must not overlap real ones. Sessions whose cache is not the
lean one (`FastCachedLM`: a GPU's graphed slot, transformers' cache), whose kind
ranks no verdicts (`BlockKind.outcomes` []: SPRINTER runs) or whose policy stops blocks early (it learns while
drafting) do not draft ahead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Generator, List, Optional, Sequence

from drafter_service.ahead_args import DEFAULT_BUDGET_MS, DEFAULT_ENABLED, DEFAULT_OUTCOMES
from drafter_service.draft_sessions import Drafter, DrafterSession, DraftOutput
from steerspec.blocks.block_kind import Verdict
from steerspec.decoding import rounds
from steerspec.decoding.outcomes import Outcome
from steerspec.models.kv import FastCachedLM

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class AheadConfig:
    """Whether sessions draft ahead by default, and the budget per block in flight."""

    enabled: bool = DEFAULT_ENABLED
    outcomes: int = DEFAULT_OUTCOMES  # verdicts prepared per block at most
    budget_ms: float = DEFAULT_BUDGET_MS  # drafter time spent preparing per block (0: no limit but `outcomes`)


@dataclass
class Prepared:
    """A block drafted ahead for one verdict of the block in flight, in its own fork of the session's cache."""

    outcome: Outcome
    out: DraftOutput
    cache: FastCachedLM
    steered_stale: bool  # drafted with the vector of the block in flight (SD²)


@dataclass
class Work:
    """One session's preparing: its task, the block it prepares for, what it prepared and the time it took."""

    seq: int
    task: Optional[asyncio.Task] = None
    ready: List[Prepared] = field(default_factory=list)
    spent_ms: float = 0.0
    steps: Optional[Generator] = None  # the batched draft in progress
    stopped: bool = False


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

    def __init__(self, drafter: Drafter, config: AheadConfig, busy: Callable[[], bool], inline: bool = True) -> None:
        self.drafter = drafter
        self.config = config
        self.inline = inline  # the drafter's passes run on the event loop's thread (a CPU), as prepared ones do
        self.busy = busy  # whether a real draft is queued
        self.work: Dict[str, Work] = {}
        self.pending: Dict[str, Prepared] = {}  # a hit between `take` and `use`
        self.blocks = 0  # blocks answered while drafting ahead
        self.hits = 0
        self.prepared_total = 0
        self.ahead_ms_total = 0.0
        self.stale_steered = 0  # hits drafted with the previous steering vector

    def wants(self, session: DrafterSession) -> bool:
        """Whether the session drafts ahead (its own setting, else the server's) and can."""
        on = self.config.enabled if session.ahead is None else session.ahead
        return bool(on) and self.inline and isinstance(session.lm, FastCachedLM) and \
            not getattr(session.policy, "stops_early", False)

    def limits(self, session: DrafterSession):
        """(verdicts, milliseconds; 0 = no time limit) the session may prepare per block."""
        outcomes = self.config.outcomes if session.ahead_outcomes is None else session.ahead_outcomes
        budget = self.config.budget_ms if session.ahead_budget_ms is None else session.ahead_budget_ms
        return max(int(outcomes), 0), max(float(budget), 0.0)

    def start(self, session: DrafterSession) -> None:
        """Start preparing the session's next block for its block in flight (once the block has been sent)."""
        proposal = session.proposal
        if proposal is None or session.closed or not self.wants(session) or self.limits(session)[0] == 0:
            return
        old = self.work.get(session.session_id)
        if old is not None and old.seq == proposal.seq:  # already preparing for it (an in-stream error reply)
            return
        self.stop(session)
        if session.lm.length < proposal.committed_length:  # nothing drafted to rank (a block of no drafts)
            return
        work = Work(seq=proposal.seq)
        work.task = asyncio.get_running_loop().create_task(self.guarded(session, work))
        self.work[session.session_id] = work

    async def idle(self, work: Work) -> bool:
        """Yield to the event loop, then wait while real drafting is queued; False once stopped."""
        await asyncio.sleep(0)
        while self.busy() and not work.stopped:
            await asyncio.sleep(0.0005)
        return not work.stopped

    async def guarded(self, session: DrafterSession, work: Work) -> None:
        """`prepare`, a failure logged (the result then drafts as without drafting ahead)."""
        try:
            await self.prepare(session, work)
        except asyncio.CancelledError:
            raise
        except Exception:  # e.g. out of memory: drafting ahead is an optimisation, never the session's failure
            log.exception("drafting ahead failed for session %s; it drafts after its results", session.session_id)
            work.ready.clear()

    async def prepare(self, session: DrafterSession, work: Work) -> None:
        """Rank the block's verdicts, then draft the next block for the likeliest, batched (the module docstring)."""
        count, budget_ms = self.limits(session)
        if not await self.idle(work):
            return
        start = time.perf_counter()
        outcomes = session.kind.outcomes(self.drafter, session, count)
        shadows = [self.shadow(session, outcome) for outcome in outcomes]
        work.spent_ms += (time.perf_counter() - start) * 1e3
        if not shadows or (budget_ms and work.spent_ms >= budget_ms):
            return
        if not await self.idle(work):
            return
        work.steps = session.kind.draft_steps(self.drafter, shadows)
        while True:
            start = time.perf_counter()
            try:
                next(work.steps)
                outs = None
            except StopIteration as done:
                outs = done.value
            finally:
                work.spent_ms += (time.perf_counter() - start) * 1e3
            if outs is not None:
                break
            if budget_ms and work.spent_ms >= budget_ms:  # a loaded host: give the time back, prepare nothing
                work.steps.close()
                work.steps = None
                return
            if not await self.idle(work):
                return  # `stop` closed the draft
        work.steps = None
        stale = session.steering is not None
        work.ready = [Prepared(o, out, shadow.lm, stale) for o, out, shadow in zip(outcomes, outs, shadows)]

    def shadow(self, session: DrafterSession, outcome: Outcome) -> DrafterSession:
        """A copy of the session in a fork of its cache, with `outcome` committed (the fork rolled back or its path
        kept, as the real verdict would) and the generator the block after it draws from (`rounds.block_seed`)."""
        shadow = replace(session, lm=session.lm.fork(), committed=list(session.committed),
                         generator=rounds.generator(0, self.drafter.model.device))
        session.kind.feedback(self.drafter, shadow, Verdict(outcome.accepted, outcome.next_token, None,
                                                            list(outcome.path), None))
        shadow.proposal = None
        rounds.seed_block(shadow.generator, session.seed, len(shadow.committed))
        return shadow

    def stop(self, session: DrafterSession) -> Optional[Work]:
        """Stop the session's preparing now (its own cache is untouched by it); the work, or None."""
        work = self.work.pop(session.session_id, None)
        if work is None:
            return None
        work.stopped = True
        if work.task is not None and not work.task.done():
            work.task.cancel()
        if work.steps is not None:
            work.steps.close()  # its cleanup (the forks' up_bias) runs now
            work.steps = None
        return work

    def take(self, session: DrafterSession, accepted: int, next_token: int, path: Sequence[int]) -> AheadReport:
        """Stop preparing; the report for the next block, with the prepared block for the actual verdict if any
        (`report.hit`; `use` then loads it once the verdict is committed)."""
        work = self.stop(session)
        if work is None:
            return AheadReport()
        report = AheadReport(on=True, prepared=len(work.ready), ahead_ms=work.spent_ms)
        self.blocks += 1
        self.prepared_total += len(work.ready)
        self.ahead_ms_total += work.spent_ms
        want = (int(accepted), int(next_token), tuple(int(node) for node in path))
        for item in work.ready:
            o = item.outcome
            if (o.accepted, o.next_token, o.path) == want:
                self.hits += 1
                self.stale_steered += int(item.steered_stale)
                report.hit, report.steered_stale = True, item.steered_stale
                self.pending[session.session_id] = item
                break
        return report

    def use(self, session: DrafterSession) -> Optional[DraftOutput]:
        """The hit `take` found, its cache slots loaded (the verdict committed first); None when it missed."""
        item = self.pending.pop(session.session_id, None)
        if item is None:
            return None
        start = time.perf_counter()
        session.lm.load(item.cache.save(len(session.committed) - 1 - item.outcome.accepted))
        return replace(item.out, draft_ms=(time.perf_counter() - start) * 1e3)

    def drop(self, session: DrafterSession) -> None:
        """Forget a session's work (closing, or its last result)."""
        self.stop(session)
        self.pending.pop(session.session_id, None)

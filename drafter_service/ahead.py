"""Drafting ahead: while a session's block is away being verified, the drafter prepares the session's next block
for the verdicts it finds likeliest, in idle time, so that a hit sends the next block at once.

After a block leaves (the stream has written it), `Ahead.start` schedules a task on the event loop that
1. ranks the block's verdicts (`BlockKind.outcomes`: the accepted drafts, a tree's path, and the next token after
   them, by the drafter's own probabilities, from one idle pass), then
2. prepares the likeliest `AheadConfig.outcomes` together (split among the sessions preparing at once, at least
   one each: `share`): per verdict a fork of the session's cache
   (`FastCachedLM.fork`) and a shadow session with the verdict committed to it (`BlockKind.feedback` on the fork:
   the same rollback or path keep the real verdict makes) and its generator seeded from the session's seed and the
   shadow's committed length (`rounds.block_seed`); then the kind drafts every shadow's block in one batch
   (`BlockKind.draft_steps`: one batched pass per draft step, as for sessions drafted together); past `budget_ms`
   of drafter time (a loaded host) it stops and prepares nothing for this block.
The compute runs on the drafter's `PriorityWorker` (steerspec/serving/priority_worker.py: the one thread that owns
the model), off the event loop, as background jobs of one drafter pass each (the ranking; each draft step): a real
draft request of any session is an urgent job, which runs before any queued background job, so prepared work
delays it by at most the one step running when it arrives; the task also waits while real drafts are queued in
the batcher. Meanwhile the loop keeps serving streams and timers. The session's own cache is only read by the
ranking job (which puts it back); `take` stops the task and waits for a job still running, so the result is
committed to a cache no other thread is using.

When the result arrives, `take` returns the prepared block for the actual verdict, if any: the server commits the
verdict as always and `use` copies the fork's slots after the committed prefix into the session's cache
(`FastCachedLM.save` / `load`, on the worker), which then holds the committed prefix and the prepared block's
drafts exactly as drafting after the result would have left them. Otherwise it drafts as without drafting ahead.

Exactness: a prepared block is drawn from the drafter's distribution given exactly the committed prefix, with the
generator drafting after the result would have used, and carries the q it was drawn from. Unsteered, a seed gives
the same tokens with drafting ahead on or off (to the float rounding of batched passes, as for sessions drafted
together: ~1e-6 in the logits). Steered (SD²), the next block's steering vector comes with the
result; a prepared block is drafted with the vector of the block in flight (`steered_stale` counts them), and is
still exact, since the verifier tests it against the q it was drawn from; with SD² a seed fixes the output for a
given setting of drafting ahead.

A drafter without a worker (a GPU model, whose passes run on the batcher's compute thread) does not draft ahead.
Sessions whose cache is not the lean one (`FastCachedLM`: transformers' cache), whose kind ranks no verdicts
(`BlockKind.outcomes` []: SPRINTER runs) or whose policy stops blocks early (it learns while drafting) do not draft
ahead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from concurrent.futures import Future
from typing import Any, Callable, Dict, Generator, List, Optional, Sequence, Tuple

from drafter_service.ahead_args import DEFAULT_BUDGET_MS, DEFAULT_ENABLED, DEFAULT_OUTCOMES
from drafter_service.draft_sessions import Drafter, DrafterSession, DraftOutput
from steerspec.blocks.block_kind import Verdict
from steerspec.decoding import rounds
from steerspec.decoding.outcomes import Outcome
from steerspec.models.kv import FastCachedLM
from steerspec.serving.batching import free_cache
from steerspec.serving.priority_worker import BACKGROUND, URGENT, PriorityWorker

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
    running: Optional[Future] = None  # the background job last handed to the worker


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

    def __init__(self, drafter: Drafter, config: AheadConfig, busy: Callable[[], bool],
                 worker: Optional[PriorityWorker]) -> None:
        self.drafter = drafter
        self.config = config
        self.worker = worker  # the thread that owns the model (None: this drafter does not draft ahead)
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
        return bool(on) and self.worker is not None and isinstance(session.lm, FastCachedLM) and \
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
            work.ready.clear()
            if not self.worker.closed:  # shutting down is no failure
                log.exception("drafting ahead failed for session %s; it drafts after its results",
                              session.session_id)

    async def background(self, session: DrafterSession, work: Work, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` as a background job on the worker, the session's cache kept until it has returned even if
        the session closes meanwhile (`free_cache`); its result (cancelling the wait cancels a job not started)."""
        loop = asyncio.get_running_loop()
        future = self.worker.submit(fn, *args, priority=BACKGROUND)
        work.running = future
        session.in_compute += 1

        def release() -> None:  # on the event loop, once the job has finished or was cancelled
            session.in_compute -= 1
            free_cache(session)

        def done(_future: Future) -> None:  # on the worker (or the loop, when cancelled before it ran)
            try:
                loop.call_soon_threadsafe(release)
            except RuntimeError:  # the loop has closed (shutdown): nothing is left to free
                pass

        future.add_done_callback(done)
        return await asyncio.wrap_future(future, loop=loop)

    async def prepare(self, session: DrafterSession, work: Work) -> None:
        """Rank the block's verdicts, then draft the next block for the likeliest, batched (the module docstring)."""
        count, budget_ms = self.limits(session)
        if not await self.idle(work):
            return
        count = self.share(count)
        outcomes, shadows, ms = await self.background(session, work, self.rank, session, count)
        work.spent_ms += ms
        if not shadows or (budget_ms and work.spent_ms >= budget_ms):
            return
        work.steps = session.kind.draft_steps(self.drafter, shadows)
        while True:
            if not await self.idle(work):
                return  # `stop` closes the draft
            outs, ms = await self.background(session, work, self.step, work.steps)
            work.spent_ms += ms
            if outs is not None:
                break
            if budget_ms and work.spent_ms >= budget_ms:  # a loaded host: give the time back, prepare nothing
                self.close_steps(work)
                return
        work.steps = None
        stale = session.steering is not None
        work.ready = [Prepared(o, out, shadow.lm, stale) for o, out, shadow in zip(outcomes, outs, shadows)]

    def share(self, count: int) -> int:
        """This session's share of `count` verdicts when others prepare too (at least one): the one worker drafts
        every session's prepared blocks, and work finished after the result is wasted."""
        preparing = sum(1 for work in self.work.values() if work.task is not None and not work.task.done())
        return max(1, count // max(1, preparing)) if count else 0

    def rank(self, session: DrafterSession, count: int) -> Tuple[List[Outcome], List[DrafterSession], float]:
        """On the worker: the likeliest `count` verdicts, a shadow session for each, and the milliseconds taken."""
        start = time.perf_counter()
        outcomes = session.kind.outcomes(self.drafter, session, count)
        shadows = [self.shadow(session, outcome) for outcome in outcomes]
        return outcomes, shadows, (time.perf_counter() - start) * 1e3

    @staticmethod
    def step(steps: Generator) -> Tuple[Optional[List[DraftOutput]], float]:
        """On the worker: one drafter pass of a batched draft; (its outputs once finished else None, ms taken)."""
        start = time.perf_counter()
        try:
            next(steps)
            outs = None
        except StopIteration as finished:
            outs = finished.value
        return outs, (time.perf_counter() - start) * 1e3

    def close_steps(self, work: Work) -> None:
        """End a batched draft on the worker (its cleanup, the forks' up_bias, runs after a step in flight)."""
        steps, work.steps = work.steps, None
        if steps is None:
            return
        try:
            self.worker.submit(steps.close, priority=URGENT)
        except RuntimeError:  # the worker has shut down: the draft is dropped with it
            pass

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
        self.close_steps(work)
        return work

    async def take(self, session: DrafterSession, accepted: int, next_token: int,
                   path: Sequence[int]) -> AheadReport:
        """Stop preparing and wait for a job still running (at most one drafter pass), so that the session's cache
        is the loop's again; the report for the next block, with the prepared block for the actual verdict if any
        (`report.hit`; `use` then loads it once the verdict is committed)."""
        work = self.stop(session)
        if work is None:
            return AheadReport()
        if work.running is not None and not work.running.done():
            await asyncio.wait([asyncio.wrap_future(work.running)])  # its result or error is dropped
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

    async def use(self, session: DrafterSession) -> Optional[DraftOutput]:
        """The hit `take` found, its cache slots loaded on the worker (the verdict committed first); None when it
        missed. Its draft_ms is the load's: the drafting left on the critical path."""
        item = self.pending.pop(session.session_id, None)
        if item is None:
            return None
        ms = await asyncio.wrap_future(self.worker.submit(self.load, session, item, priority=URGENT))
        return replace(item.out, draft_ms=ms)

    @staticmethod
    def load(session: DrafterSession, item: Prepared) -> float:
        """On the worker: the prepared fork's slots after the committed prefix into the session's cache; ms taken."""
        start = time.perf_counter()
        session.lm.load(item.cache.save(len(session.committed) - 1 - item.outcome.accepted))
        return (time.perf_counter() - start) * 1e3

    def drop(self, session: DrafterSession) -> None:
        """Forget a session's work (closing, or its last result)."""
        self.stop(session)
        self.pending.pop(session.session_id, None)

"""The drafter's compute thread (steerspec/serving/priority_worker.py): urgent jobs (real drafts) run before queued
background jobs (drafting ahead), so background work delays a real request by at most the one job running when it
arrives; every job runs on the one thread; a job cancelled while queued never runs. Ordered by events, not timed."""

from __future__ import annotations

import threading

import pytest

from steerspec.serving.priority_worker import BACKGROUND, URGENT, PriorityWorker


def test_an_urgent_job_overtakes_queued_background_jobs():
    worker = PriorityWorker("test")
    try:
        started, release, order, threads = threading.Event(), threading.Event(), [], set()

        def job(name):
            threads.add(threading.get_ident())
            if name == "running":
                started.set()
                assert release.wait(30)
            order.append(name)
            return name

        running = worker.submit(job, "running", priority=BACKGROUND)
        assert started.wait(30)
        later = [worker.submit(job, f"step{i}", priority=BACKGROUND) for i in range(3)]
        urgent = worker.submit(job, "real", priority=URGENT)
        assert worker.waiting(BACKGROUND) == 3 and worker.waiting(URGENT) == 1
        release.set()
        assert urgent.result(30) == "real" and all(f.result(30) for f in later) and running.result(30)
        assert order == ["running", "real", "step0", "step1", "step2"]  # one background job before it, at most
        assert threads == {worker.thread.ident}
    finally:
        worker.shutdown(wait=True)


def test_a_cancelled_job_never_runs_and_errors_reach_the_caller():
    worker = PriorityWorker("test")
    try:
        release, ran = threading.Event(), []
        blocker = worker.submit(release.wait, 30)
        dropped = worker.submit(ran.append, "dropped", priority=BACKGROUND)
        assert dropped.cancel()
        failing = worker.submit(lambda: 1 / 0)
        release.set()
        assert blocker.result(30)
        with pytest.raises(ZeroDivisionError):
            failing.result(30)
        assert worker.submit(ran.append, "kept").result(30) is None and ran == ["kept"]
    finally:
        worker.shutdown(wait=True)
    with pytest.raises(RuntimeError, match="shut down"):
        worker.submit(print)

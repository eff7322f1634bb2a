"""One-row verifier passes on one computing thread, and once a second thread has computed too.

    python scripts/omp_pools.py --model smollm2 --threads 2

Prints the median of `--repeats` one-row passes (ms) in four phases of one process: the main thread
alone; a worker thread computing while the main thread's OpenMP pool exists; the main thread again
while that worker (and its pool) lives; the main thread after the worker has exited. The second and
third phases are the state a server was in when it loaded its model on the loop's thread and
verified on an executor thread (steerspec/serving/compute.py). `--gaps 0,10,50,100` then times passes with
that many idle ms before each (the remote regime's rhythm: a verifier waits out the round trip).
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch


def passes(lm, repeats: int, gap_ms: float = 0.0) -> float:
    """Median ms of a one-row pass at the cache's current length (each rolled back, `gap_ms` idle before)."""
    times = []
    for _ in range(repeats):
        if gap_ms:
            time.sleep(gap_ms / 1e3)
        start = time.perf_counter()
        lm.extend(torch.tensor([[500]]))
        times.append(time.perf_counter() - start)
        lm.rollback(lm.length - 1)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--gaps", default="", help="comma-separated idle ms before each pass, timed at the end")
    args = parser.parse_args()
    from steerspec.models import load_model
    from steerspec.models.kv import FastCachedLM

    torch.set_num_threads(args.threads)
    lm = FastCachedLM(load_model(args.model))
    lm.extend(torch.arange(100, 228).view(1, -1))
    passes(lm, args.repeats)  # warm-up
    rows = [("main thread alone", passes(lm, args.repeats))]
    worker = ThreadPoolExecutor(1)
    rows.append(("worker thread, main's pool alive", worker.submit(passes, lm, args.repeats).result()))
    rows.append(("main thread, worker's pool alive", passes(lm, args.repeats)))
    worker.shutdown(wait=True)  # its thread exits, and its pool with it
    rows.append(("main thread, worker exited", passes(lm, args.repeats)))
    print(f"one-row pass of {args.model}, {args.threads} torch threads, median of {args.repeats}")
    for name, ms in rows:
        print(f"  {name:<36} {ms:6.1f} ms")
    for gap in [float(g) for g in args.gaps.split(",") if g.strip()]:
        print(f"  {f'main thread, {gap:g} ms idle before each':<36} {passes(lm, args.repeats, gap):6.1f} ms")


if __name__ == "__main__":
    main()

"""Where a server's model passes run: on the event loop's thread on a CPU, on one compute thread on a GPU.

libgomp (the OpenMP runtime of torch's CPU wheels) gives every thread that runs a parallel region
its own pool of worker threads. Once a process holds more such threads than it has CPUs, every
pool's barriers stop spinning and sleep instead (GOMP's throttled spin count), and each of the
hundreds of small parallel regions in a pass pays a futex wake-up. On 2 cores a one-row
SmolLM2-135M pass takes 33-35 ms on the only computing thread and 44-57 ms on either thread once a
second one has computed (`python scripts/omp_pools.py`, two runs). A server that loads its model on the
loop's thread and then verifies or drafts on an executor thread, or makes its weight copies in
`asyncio.to_thread`, is in that state for good. On a CPU the passes therefore run inline on the
loop's thread, where the model was loaded; a GPU pass leaves the CPU idle while it runs, so there
the loop hands it to one compute thread and keeps reading streams. The drafter service is the exception: its
CPU passes run on one `PriorityWorker` thread that owns the model (priority_worker.py), so drafting ahead computes
off the loop; with one torch thread per drafter process (`--threads 1`, as `bench capacity` runs it) no OpenMP pool
exists to contend.
"""

from __future__ import annotations

import os
from typing import Any

INLINE_ENV = "STEERSPEC_INLINE_COMPUTE"  # 1: inline everywhere, 0: a compute thread everywhere


def inline_compute(model: Any) -> bool:
    """Whether a server holding `model` runs its passes on the event loop's thread (a CPU model),
    rather than on a compute thread (a GPU model); STEERSPEC_INLINE_COMPUTE=1/0 decides when set."""
    forced = os.environ.get(INLINE_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    device = getattr(model, "device", None)
    return getattr(device, "type", "cpu") == "cpu"

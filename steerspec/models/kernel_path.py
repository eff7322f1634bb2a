"""The kernel path a verifier computes on: batch-invariant or not, and the invariant row bucket, chosen on the machine.

`apply_invariance(model, mode)` is what the entry points call after loading a verifier: "off" leaves the model's
passes as they are; "on" makes them batch-invariant (models/invariant_pass.py) with the row bucket timed fastest here;
"auto" turns them on where, on this machine, an invariant one-token step plus a chain k = 4 verify pass cost at most
1/0.9 of the ordinary ones (`INVARIANT_MIN_SPEED`), in any dtype (float32's invariant passes cost 1.2-2x on the VMs
measured, so it stays ordinary there). Both timings are made once per machine (CPU model and flags), model, dtype
and thread count and kept in ~/.cache/steerspec/kernel-paths.json; $STEERSPEC_INVARIANT (on|off|auto) and
$STEERSPEC_INVARIANT_ROWS override. Invariance is a CPU path: asking for it on another device is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, Optional

import torch

from steerspec.errors import UsageError
from steerspec.models.invariant_pass import InvariantPlan, set_invariant
from steerspec.models.smollm2 import cache_root

MODES = ("auto", "on", "off")
ENV = "STEERSPEC_INVARIANT"
ROWS_ENV = "STEERSPEC_INVARIANT_ROWS"
ROW_BUCKETS = (8, 16)  # the invariant row buckets timed at load
INVARIANT_MIN_SPEED = 0.9  # "auto" turns invariance on where its passes keep at least this share of the speed
CACHE_FILE = "kernel-paths.json"
TIMED_ROWS = (1, 5)  # a one-token step and a chain k = 4 verify pass: what greedy decoding runs


def check_mode(mode: str) -> str:
    """`mode`, or a UsageError naming the choices."""
    if mode not in MODES:
        raise UsageError(f"unknown invariant mode {mode!r}: use one of {', '.join(MODES)}")
    return mode


def machine_key() -> str:
    """The CPU model and its flags, hashed: timings made here hold for this kind of machine."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return f"{model or 'unknown-cpu'} [{hashlib.sha256(flags.encode()).hexdigest()[:12]}]"


def apply_invariance(model, mode: str = "off") -> Optional[InvariantPlan]:
    """Set `model`'s invariant plan for `mode` (overridden by $STEERSPEC_INVARIANT); returns the plan, or None (off)."""
    mode = check_mode(os.environ.get(ENV) or mode)
    device = next(model.parameters()).device
    if mode == "off":
        set_invariant(model, None)
        return None
    if device.type != "cpu":
        if mode == "on":
            raise UsageError(f"batch-invariant verification is implemented on the CPU only, not on {device.type}: "
                             "use --invariant off (or auto) there")
        set_invariant(model, None)
        return None
    verdict = machine_verdict(model)
    if mode == "auto" and not verdict["invariant"]:
        set_invariant(model, None)
        return None
    plan = InvariantPlan(rows=rows_override() or int(verdict["rows"]))
    set_invariant(model, plan)
    return plan


def rows_override() -> Optional[int]:
    """$STEERSPEC_INVARIANT_ROWS as a row bucket, or None."""
    text = os.environ.get(ROWS_ENV)
    if not text:
        return None
    try:
        rows = int(text)
    except ValueError:
        raise UsageError(f"{ROWS_ENV} must be a row count (e.g. 8), got {text!r}") from None
    if rows < 1:
        raise UsageError(f"{ROWS_ENV} must be at least 1, got {text!r}")
    return rows


def cache_key(model) -> str:
    """The kernel-path cache key of `model` here: machine, model name and size, dtype, thread count."""
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    name = getattr(model, "name_or_path", "") or type(model).__name__
    size = sum(p.numel() for p in model.parameters())
    return f"{machine_key()}|{Path(str(name)).name}:{size}|{dtype}|threads={torch.get_num_threads()}"


def machine_verdict(model) -> Dict[str, object]:
    """{"invariant": bool, "rows": R, "ms": {...}} for `model` on this machine: cached, else timed now and cached."""
    return cached(cache_key(model), lambda: time_paths(model))


def cached(key: str, compute: Callable[[], Dict[str, object]]) -> Dict[str, object]:
    """The kernel-path cache's entry `key`, else compute() stored under it (a read-only cache: computed each time)."""
    path = cache_root() / CACHE_FILE
    entries = _read(path)
    if key in entries:
        return entries[key]
    value = compute()
    entries = _read(path)
    entries[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass
    return value


def _read(path: Path) -> Dict[str, Dict[str, object]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def time_rows(lms: Dict[str, object], plans: Dict[str, Optional[InvariantPlan]], rows, ids, prefix: int,
              repeats: int) -> Dict[str, Dict[str, float]]:
    """Median ms of a pass of each of `rows` rows after a `prefix`-token cache, for each named cached LM (its model
    under its plan), interleaved; the first round warms up."""
    times: Dict[str, Dict[int, list]] = {name: {n: [] for n in rows} for name in lms}
    for attempt in range(repeats + 1):
        for n in rows:
            for name, lm in lms.items():
                set_invariant(lm.model, plans[name])
                t0 = time.perf_counter()
                lm.extend(ids[prefix:prefix + n])
                elapsed = time.perf_counter() - t0
                lm.rollback(prefix)
                if attempt:
                    times[name][n].append(elapsed)
    return {name: {str(n): round(statistics.median(t) * 1e3, 3) for n, t in by_n.items()} for name, by_n in times.items()}


def time_paths(model, repeats: int = 5, prefix: int = 64) -> Dict[str, object]:
    """Time the ordinary and the invariant passes (each row bucket) of TIMED_ROWS rows after a `prefix`-token cache,
    interleaved, medians; the verdict takes the fastest bucket and compares the sums."""
    # lazy: kv.py imports loading.py, which imports this module
    from steerspec.models.kv import FastCachedLM

    ids = [i % int(model.config.vocab_size) for i in range(1, prefix + max(TIMED_ROWS) + 1)]
    paths: Dict[str, Optional[InvariantPlan]] = {"plain": None}
    paths.update({f"rows{r}": InvariantPlan(rows=r) for r in ROW_BUCKETS})
    lms = {}
    for name, plan in paths.items():
        set_invariant(model, plan)
        lms[name] = FastCachedLM(model, capacity=prefix + 32)
        lms[name].extend(ids[:prefix])
    ms = time_rows(lms, paths, TIMED_ROWS, ids, prefix, repeats)
    set_invariant(model, None)
    cost = {name: sum(by_n.values()) for name, by_n in ms.items()}
    best = min(ROW_BUCKETS, key=lambda r: cost[f"rows{r}"])
    return {"invariant": cost["plain"] >= INVARIANT_MIN_SPEED * cost[f"rows{best}"], "rows": best, "ms": ms}

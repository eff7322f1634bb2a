"""`--dtype auto`: the verifier's dtype chosen on the machine — bfloat16 on its batch-invariant path where the CPU
computes bfloat16 natively and, timed here, those passes beat float32's; float32 elsewhere.

Only exact paths are candidates: float32 (greedy output the verifier's own in every test) and invariant bfloat16
(bit-identical to one-token decoding). Ordinary bfloat16, often faster still, departs from the verifier alone's
greedy output, so `auto` never picks it; `--dtype bfloat16` asks for it (invariance then follows `--invariant`).

Timed once per machine (CPU model and flags), model and thread count, kept beside the invariance verdicts in
~/.cache/steerspec/kernel-paths.json; $STEERSPEC_DTYPE (float32|bfloat16|float16) overrides the choice. On a GPU
`auto` is float32: batch invariance is a CPU path, and float32 is where greedy output is the verifier's own there.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, Optional, Tuple, Union
from pathlib import Path

import torch

from steerspec.errors import UsageError
from steerspec.models.checkpoints import resolve_model_dir
from steerspec.models.invariant_pass import InvariantPlan
from steerspec.models.kernel_path import cached, machine_key, machine_verdict, rows_override, time_rows

ENV = "STEERSPEC_DTYPE"
CHOICES = ("auto", "float32", "float16", "bfloat16")
# the passes the default decoding runs: a one-token step (the verifier alone, a block of no drafts), the default
# tree's verify pass (5 drafts + 1) and two sessions' trees packed into one pass (a served verifier)
TIMED_ROWS = (1, 6, 12)


def resolve_path(dtype: str, invariant: Optional[str], model: Union[str, Path],
                 device: Union[str, torch.device] = "cpu", threads: Optional[int] = None) -> Tuple[str, Optional[str]]:
    """(dtype, invariant mode) to load and run `model` with: `auto` resolved (see `resolve`); when it chose bfloat16,
    an `auto` (or unset) invariant mode becomes "on", since that dtype was chosen for its invariant path."""
    chosen = resolve(dtype, model, device, threads)
    if dtype == "auto" and chosen != "float32" and invariant in (None, "auto"):
        return chosen, "on"
    return chosen, invariant


def resolve(dtype: str, model: Union[str, Path], device: Union[str, torch.device] = "cpu",
            threads: Optional[int] = None) -> str:
    """`dtype`, or for "auto" the dtype this machine runs `model`'s verifier passes fastest in (see module doc).

    `threads` is the torch thread count the verifier will run at (None: as set now; 0: the `apply_threads` rule)."""
    if dtype not in CHOICES:
        raise UsageError(f"unknown dtype {dtype!r}: use one of {', '.join(CHOICES)}")
    if dtype != "auto":
        return dtype
    override = os.environ.get(ENV)
    if override:
        if override not in CHOICES[1:]:
            raise UsageError(f"${ENV} must be one of {', '.join(CHOICES[1:])}, got {override!r}")
        return override
    # lazy: loading.py imports this module's neighbours; layouts reads /proc/cpuinfo
    from steerspec.models.layouts import native_bf16

    where = str(device).split(":")[0]
    if where not in ("cpu", "auto") or (where == "auto" and torch.cuda.is_available()) or not native_bf16():
        return "float32"
    verdict = cached(_key(model, threads), lambda: time_dtypes(model, threads))
    return str(verdict["dtype"])


def _key(model: Union[str, Path], threads: Optional[int]) -> str:
    path = resolve_model_dir(model)
    text = (path / "config.json").read_text()
    config = hashlib.sha256(text.encode()).hexdigest()[:12]
    return f"dtype|{machine_key()}|{path.name}:{config}|threads={effective_threads(threads, json.loads(text))}"


def effective_threads(threads: Optional[int], config: Dict[str, object]) -> int:
    """The torch threads a verifier with this config runs at: `threads`, the count set now (None), or for 0 the
    `apply_threads` rule (one thread for a model under SMALL_MODEL_PARAMS, its size estimated from the config)."""
    if threads:
        return int(threads)
    if threads == 0:
        from steerspec.models.loading import SMALL_MODEL_PARAMS  # lazy: loading.py imports the model stack

        hidden, inter = int(config.get("hidden_size", 0)), int(config.get("intermediate_size", 0))
        heads = int(config.get("num_attention_heads", 1)) or 1
        kv = int(config.get("num_key_value_heads", heads)) * hidden // heads
        layer = hidden * (2 * hidden + 2 * kv) + 3 * hidden * inter
        size = int(config.get("vocab_size", 0)) * hidden + int(config.get("num_hidden_layers", 0)) * layer
        if size < SMALL_MODEL_PARAMS:
            return 1
    return torch.get_num_threads()


def time_dtypes(model: Union[str, Path], threads: Optional[int] = None, repeats: int = 5,
                prefix: int = 64) -> Dict[str, object]:
    """Time `model`'s float32 passes against its invariant bfloat16 ones (the row bucket `kernel_path` picks), at
    TIMED_ROWS rows after a `prefix`-token cache, interleaved; {"dtype", "ms", "rows"}: the smaller sum wins."""
    # lazy: loading.py and kv.py import the model stack
    from steerspec.models.kv import FastCachedLM
    from steerspec.models.loading import apply_threads, load_model

    before = torch.get_num_threads()
    models = {"float32": load_model(model, dtype="float32"), "bfloat16": load_model(model, dtype="bfloat16")}
    try:
        if threads is not None:
            apply_threads(threads, models["float32"])
        rows = rows_override() or int(machine_verdict(models["bfloat16"])["rows"])
        plans = {"float32": None, "bfloat16": InvariantPlan(rows=rows)}
        vocab = int(models["float32"].config.vocab_size)
        ids = [(7 * i) % (vocab - 1) + 1 for i in range(prefix + max(TIMED_ROWS))]
        lms = {}
        for name, m in models.items():
            lms[name] = FastCachedLM(m, capacity=prefix + max(TIMED_ROWS) + 8)
            lms[name].extend(ids[:prefix])
        ms = time_rows(lms, plans, TIMED_ROWS, ids, prefix, repeats)
    finally:
        torch.set_num_threads(before)
    cost = {name: sum(by_n.values()) for name, by_n in ms.items()}
    return {"dtype": "bfloat16" if cost["bfloat16"] < cost["float32"] else "float32", "ms": ms, "rows": rows}

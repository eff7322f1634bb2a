"""What batch invariance costs per pass: the lean forward's ordinary passes against its invariant ones, per row count
and dtype, interleaved repetition by repetition (steerspec/models/invariant_pass.py).

For each dtype the verifier extends a cached prompt by n tokens (then rolls back) on the ordinary path and on the
invariant path of each row bucket; prints median milliseconds per pass and the invariant/ordinary ratios, checks
that the invariant rows equal one-token decoding bit for bit, and writes JSON with the machine (`--out`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from steerspec.bench.host import host_info
from steerspec.errors import UsageError
from steerspec.models import load_model
from steerspec.models.invariant_pass import InvariantPlan, set_invariant
from steerspec.models.kv import FastCachedLM
from steerspec.models.layouts import native_bf16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier", default="smollm2", help="model directory or bundled name (default: smollm2)")
    parser.add_argument("--rows", default="1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,65",
                        help="row counts per pass (comma-separated)")
    parser.add_argument("--buckets", default="8,16", help="invariant row buckets to time (comma-separated)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="dtypes (bfloat16 only where the CPU has it)")
    parser.add_argument("--repeats", type=int, default=7, help="timed passes per row count and path")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="cached prefix each pass extends")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--out", default=None, help="write the report as JSON here")


def parse_counts(text: str, flag: str) -> List[int]:
    """Comma-separated counts of at least 1, or a UsageError naming `flag`."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise UsageError(f"{flag} must list counts of at least 1, got {text!r}")
    return counts


def time_paths(model, plans: Dict[str, Optional[InvariantPlan]], rows: List[int], repeats: int,
               prompt: List[int]) -> Dict[str, Dict[int, List[float]]]:
    """{path: {n: [ms per pass]}}: the paths alternate inside every repetition (order flipped every other one)."""
    lms = {}
    for name, plan in plans.items():
        set_invariant(model, plan)
        lms[name] = FastCachedLM(model, capacity=len(prompt) + max(rows) + 64)
        lms[name].extend(prompt)
    samples: Dict[str, Dict[int, List[float]]] = {name: {n: [] for n in rows} for name in plans}
    for n in rows:
        feed = [(7 * i + 11) % 1000 + 100 for i in range(n)]
        for rep in range(repeats + 1):  # the first round warms up
            order = list(plans.items()) if rep % 2 == 0 else list(reversed(list(plans.items())))
            for name, plan in order:
                set_invariant(model, plan)
                lm = lms[name]
                start = time.perf_counter()
                lm.extend(feed)
                elapsed = (time.perf_counter() - start) * 1e3
                lm.rollback(len(prompt))
                if rep:
                    samples[name][n].append(elapsed)
    set_invariant(model, None)
    return samples


def bit_equal(model, plan: InvariantPlan, prompt: List[int], rows: List[int]) -> bool:
    """Whether every row of each invariant n-row pass equals one-token decoding's logits for it."""
    set_invariant(model, plan)
    try:
        feed = [(7 * i + 11) % 1000 + 100 for i in range(max(rows))]
        one = FastCachedLM(model)
        one.extend(prompt)
        reference = torch.cat([one.extend([t]).logits for t in feed])
        lm = FastCachedLM(model)
        lm.extend(prompt)
        for n in rows:
            if not torch.equal(lm.extend(feed[:n]).logits, reference[:n]):
                return False
            lm.rollback(len(prompt))
        return True
    finally:
        set_invariant(model, None)


def run(args) -> int:
    rows = parse_counts(args.rows, "--rows")
    buckets = parse_counts(args.buckets, "--buckets")
    dtypes = [d for d in args.dtypes.split(",") if d.strip()]
    if args.repeats < 1 or args.prompt_tokens < 1:
        raise UsageError("--repeats and --prompt-tokens must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt = [(13 * i + 5) % 1000 + 100 for i in range(args.prompt_tokens)]
    report: dict = {"command": "steerspec bench invariance " + " ".join(sys.argv[3:])
                    if sys.argv[1:3] == ["bench", "invariance"] else None,
                    "machine": host_info(), "native_bf16": native_bf16(), "threads": torch.get_num_threads(),
                    "dtypes": {}}
    for dtype in dtypes:
        if dtype == "bfloat16" and not native_bf16():
            print("bfloat16: skipped (emulated on this CPU)")
            continue
        model = load_model(args.verifier, dtype=dtype)
        plans: Dict[str, Optional[InvariantPlan]] = {"ordinary": None}
        plans.update({f"invariant R={r}": InvariantPlan(rows=r) for r in buckets})
        samples = time_paths(model, plans, rows, args.repeats, prompt)
        equal = {name: bit_equal(model, plan, prompt, rows) for name, plan in plans.items() if plan is not None}
        table = []
        for n in rows:
            row: dict = {"rows": n}
            for name in plans:
                row[name] = round(statistics.median(samples[name][n]), 2)
            for name in plans:
                if name != "ordinary":
                    row[f"{name} / ordinary"] = round(row[name] / row["ordinary"], 3)
            table.append(row)
        names = list(plans)
        print(f"{dtype}: median ms per pass ({torch.get_num_threads()} threads)")
        print(f"{'rows':>4} | " + " | ".join(f"{n:>16}" for n in names) + " | " +
              " | ".join(f"{n.split()[-1]}/ord" for n in names[1:]))
        for r in table:
            print(f"{r['rows']:>4} | " + " | ".join(f"{r[n]:>16.1f}" for n in names) + " | " +
                  " | ".join(f"{r[f'{n} / ordinary']:>9.3f}" for n in names[1:]))
        print("bit-identical to one-token decoding: " + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in equal.items()))
        report["dtypes"][dtype] = {"table": table, "bit_identical": equal, "samples": {
            name: {str(n): [round(x, 3) for x in v] for n, v in per.items()} for name, per in samples.items()}}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0

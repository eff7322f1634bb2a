"""Which weight layout a CPU pass of n rows runs faster on: input-major (the one-row default) or out-major.

For each row count n the model extends a cached prompt by n tokens (then rolls back), with every
linear weight read input-major and, interleaved repetition by repetition, read from its out-major
copy (`steerspec/models/layouts.py`). Prints median milliseconds per pass for both, their ratio,
and the `STEERSPEC_OUT_MAJOR_ROWS` value this machine calls for (the row counts where the
out-major copy is faster by more than `--margin`); writes JSON with every sample (`--out`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

from steerspec.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier", default="smollm2", help="model directory or bundled name (default: smollm2)")
    parser.add_argument("--rows", default="1,2,3,4,5,9", help="row counts per pass (comma-separated)")
    parser.add_argument("--repeats", type=int, default=9, help="timed passes per row count and layout")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="cached prefix each pass extends")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--margin", type=float, default=0.03, help="how much faster out-major must be to pick it")
    parser.add_argument("--out", default=None, help="write the report as JSON here")


def _parse_rows(text: str) -> List[int]:
    try:
        rows = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--rows must be comma-separated integers, got {text!r}") from None
    if not rows or min(rows) < 1:
        raise UsageError(f"--rows must list counts of at least 1, got {text!r}")
    return rows


def measure(lms: Dict[str, object], rows: List[int], repeats: int, prompt: List[int]) -> Dict[str, Dict[int, List[float]]]:
    """{layout: {n: [ms per pass]}}: the layouts alternate inside every repetition."""
    samples: Dict[str, Dict[int, List[float]]] = {name: {n: [] for n in rows} for name in lms}
    for lm in lms.values():
        lm.reset()
        lm.extend(prompt)
    for n in rows:
        feed = [(7 * i + 11) % 1000 + 100 for i in range(n)]
        for rep in range(repeats + 1):  # the first round warms up
            for name, lm in (lms.items() if rep % 2 == 0 else reversed(list(lms.items()))):
                lm.rollback(len(prompt))
                start = time.perf_counter()
                lm.extend(feed)
                elapsed = (time.perf_counter() - start) * 1e3
                if rep:
                    samples[name][n].append(elapsed)
    return samples


def run(args) -> int:
    import torch

    from steerspec.models import load_model
    from steerspec.models.kv import FastCachedLM
    from steerspec.models.layouts import ENV

    rows = _parse_rows(args.rows)
    if args.repeats < 1 or args.prompt_tokens < 1:
        raise UsageError("--repeats and --prompt-tokens must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.verifier)  # CPU layout: weights stored input-major
    if not FastCachedLM.supports(model):
        raise UsageError(f"{args.verifier}: the lean forward does not support {type(model).__name__}")
    input_major, out_major = FastCachedLM(model), FastCachedLM(model)
    input_major.set_out_major_rows(())
    out_major.set_out_major_rows(rows)
    if not out_major.out_major_rows:
        raise UsageError(f"{args.verifier}: no input-major CPU weights to compare (is it on a CPU?)")
    prompt = [(13 * i + 5) % 1000 + 100 for i in range(args.prompt_tokens)]
    samples = measure({"input-major": input_major, "out-major": out_major}, rows, args.repeats, prompt)
    table = []
    for n in rows:
        a, b = statistics.median(samples["input-major"][n]), statistics.median(samples["out-major"][n])
        table.append({"rows": n, "input_major_ms": round(a, 2), "out_major_ms": round(b, 2), "ratio": round(b / a, 3)})
    pick = [r["rows"] for r in table if r["ratio"] < 1.0 - args.margin]
    print(f"{'rows':>4} | {'input-major ms':>14} | {'out-major ms':>12} | out/in")
    for r in table:
        print(f"{r['rows']:>4} | {r['input_major_ms']:>14.1f} | {r['out_major_ms']:>12.1f} | {r['ratio']:.3f}")
    print(f"{ENV}={','.join(map(str, pick))}   (out-major where it is more than {args.margin:.0%} faster)")
    command = "steerspec bench layouts " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "layouts"] else None
    report = {"command": command, "threads": torch.get_num_threads(), "table": table, "recommended_rows": pick, "samples": {
                  name: {str(n): [round(x, 3) for x in v] for n, v in per.items()} for name, per in samples.items()}}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0

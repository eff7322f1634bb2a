"""Which weight layout a CPU pass of n rows runs fastest on: input-major (the one-row default), out-major
or oneDNN-packed.

For each row count n the model extends a cached prompt by n tokens (then rolls back), with every
linear weight read input-major and, interleaved repetition by repetition, from its out-major copy and
from its oneDNN-packed copy (`steerspec/models/layouts.py`). Prints median milliseconds per pass for
each, their ratios to input-major, and the `STEERSPEC_OUT_MAJOR_ROWS` / `STEERSPEC_ONEDNN_MIN_ROWS`
values this machine calls for (a copy where it is faster by more than `--margin`); writes JSON with
every sample (`--out`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from steerspec.bench.host import host_info
from steerspec.errors import UsageError
from steerspec.models import load_model
from steerspec.models.kv import FastCachedLM
from steerspec.models.layouts import ENV, ONEDNN_ENV, onednn_available

LAYOUTS = ("input-major", "out-major", "onednn")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier", default="smollm2", help="model directory or bundled name (default: smollm2)")
    parser.add_argument("--rows", default="1,2,3,4,5,9", help="row counts per pass (comma-separated)")
    parser.add_argument("--repeats", type=int, default=9, help="timed passes per row count and layout")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="cached prefix each pass extends")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--margin", type=float, default=0.03, help="how much faster a copy must be to pick it")
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


def _key(layout: str) -> str:
    return f"{layout.replace('-', '_')}_ms"


def recommend(table: List[dict], margin: float, packed: bool) -> Tuple[List[int], int]:
    """(out-major row counts, oneDNN minimum rows) from a measured table: oneDNN from the smallest
    measured count from which it is fastest, by more than `margin`, at every larger count; out-major
    at the other counts where it beats input-major by more than `margin` (0 = no oneDNN)."""
    def wins(row: dict, name: str) -> bool:
        others = [row[_key(o)] for o in LAYOUTS if o != name and row.get(_key(o)) is not None]
        return row.get(_key(name)) is not None and row[_key(name)] < (1.0 - margin) * min(others)
    packed_from = 0
    if packed:
        for row in sorted(table, key=lambda r: r["rows"], reverse=True):
            if not wins(row, "onednn"):
                break
            packed_from = row["rows"]
    out_rows = [r["rows"] for r in table if (not packed_from or r["rows"] < packed_from)
                and r["out_major_ms"] < (1.0 - margin) * r["input_major_ms"]]
    return out_rows, packed_from


def run(args) -> int:
    rows = _parse_rows(args.rows)
    if args.repeats < 1 or args.prompt_tokens < 1:
        raise UsageError("--repeats and --prompt-tokens must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.verifier)  # CPU layout: weights stored input-major
    if not FastCachedLM.supports(model):
        raise UsageError(f"{args.verifier}: the lean forward does not support {type(model).__name__}")
    lms = {name: FastCachedLM(model) for name in LAYOUTS}
    for lm in lms.values():
        lm.set_out_major_rows(())
        lm.set_onednn_min_rows(0)
    lms["out-major"].set_out_major_rows(rows)
    if not lms["out-major"].out_major_rows:
        raise UsageError(f"{args.verifier}: no input-major CPU weights to compare (is it on a CPU?)")
    if onednn_available():
        lms["onednn"].set_onednn_min_rows(1)
    if not lms["onednn"].onednn_min_rows:
        del lms["onednn"]  # this torch build has no oneDNN linear, or the weights are not float32
    prompt = [(13 * i + 5) % 1000 + 100 for i in range(args.prompt_tokens)]
    samples = measure(lms, rows, args.repeats, prompt)
    table = []
    for n in rows:
        row: dict = {"rows": n}
        for name in LAYOUTS:
            row[_key(name)] = round(statistics.median(samples[name][n]), 2) if name in lms else None
        row["out_major_ratio"] = round(row["out_major_ms"] / row["input_major_ms"], 3)
        row["onednn_ratio"] = None if row["onednn_ms"] is None else round(row["onednn_ms"] / row["input_major_ms"], 3)
        table.append(row)
    out_rows, packed_from = recommend(table, args.margin, "onednn" in lms)
    print(f"{'rows':>4} | {'input-major ms':>14} | {'out-major ms':>12} | {'oneDNN ms':>9} | out/in | oneDNN/in")
    for r in table:
        dnn = "–" if r["onednn_ms"] is None else f"{r['onednn_ms']:.1f}"
        dnn_ratio = "–" if r["onednn_ratio"] is None else f"{r['onednn_ratio']:.3f}"
        print(f"{r['rows']:>4} | {r['input_major_ms']:>14.1f} | {r['out_major_ms']:>12.1f} | {dnn:>9} | "
              f"{r['out_major_ratio']:.3f}  | {dnn_ratio}")
    print(f"{ENV}={','.join(map(str, out_rows))} {ONEDNN_ENV}={packed_from}   (a copy where it is more than "
          f"{args.margin:.0%} faster{'' if 'onednn' in lms else '; no oneDNN linear in this torch build'})")
    command = "steerspec bench layouts " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "layouts"] else None
    report = {"command": command, "machine": host_info(), "threads": torch.get_num_threads(), "table": table,
              "recommended_rows": out_rows, "recommended_onednn_min_rows": packed_from, "samples": {
                  name: {str(n): [round(x, 3) for x in v] for n, v in per.items()} for name, per in samples.items()}}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0

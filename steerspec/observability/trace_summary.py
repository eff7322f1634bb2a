"""Round-trip cost breakdown from a JSONL trace file: per stage, median and p90 over the blocks.

Reads the per-block spans (``steerspec.block``) written by ``--trace-file`` and reports their
``steerspec.draft_ms``, ``network_ms``, ``queue_ms``, ``verify_ms``, ``overhead_ms`` and
``rtt_ms`` attributes and the span's own duration (``block``: the whole round trip), plus mean
accepted tokens and bytes per block.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any, Dict, Iterable, List, Optional, Sequence

from rich.console import Console
from rich.table import Table

from steerspec.errors import UsageError
from steerspec.observability.tracing import BLOCK_SPAN, STAGES

ROWS = tuple(STAGES) + ("rtt", "block")
ROW_HELP = {
    "rtt": "verifier round trip as the coordinator sees it (emulated link included)",
    "block": "the whole block: duration of its steerspec.block span = draft + network + queue + verify + overhead",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="JSONL trace file written with --trace-file")
    parser.add_argument("--trace-id", default=None, help="only this trace (32 hex digits)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty sequence."""
    data = sorted(values)
    if not data:
        return math.nan
    pos = (len(data) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def read_spans(path: str) -> List[Dict[str, Any]]:
    """All spans of a JSONL trace file; UsageError (one line) when it is not one."""
    if not os.path.isfile(path):
        raise UsageError(f"trace file not found: {path}")
    spans: List[Dict[str, Any]] = []
    try:
        with open(path, "r", encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                line = line.strip()
                if not line:
                    continue
                try:
                    span = json.loads(line)
                except json.JSONDecodeError:
                    raise UsageError(f"{path}:{number}: not a JSON span (expected one JSON object per line)") from None
                if not isinstance(span, dict) or "name" not in span or "trace_id" not in span:
                    raise UsageError(f"{path}:{number}: not a span (needs 'name' and 'trace_id')")
                spans.append(span)
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a text trace file") from None
    return spans


def summarize_spans(spans: Iterable[Dict[str, Any]], trace_id: Optional[str] = None) -> Dict[str, Any]:
    """Per-stage median/p90 (ms) over block spans, plus block/trace counts and means."""
    blocks = [
        s for s in spans
        if s.get("name") == BLOCK_SPAN and (trace_id is None or s.get("trace_id") == trace_id)
    ]
    stages: Dict[str, Dict[str, float]] = {}
    for stage in ROWS:
        if stage == "block":
            values = [(b["end_ns"] - b["start_ns"]) / 1e6 for b in blocks
                      if isinstance(b.get("end_ns"), int) and isinstance(b.get("start_ns"), int)]
        else:
            values = [float(b["attributes"][f"steerspec.{stage}_ms"]) for b in blocks
                      if f"steerspec.{stage}_ms" in b.get("attributes", {})]
        stages[stage] = {
            "median_ms": percentile(values, 50) if values else None,
            "p90_ms": percentile(values, 90) if values else None,
            "mean_ms": sum(values) / len(values) if values else None,
            "blocks": len(values),
        }

    def mean_attr(name: str) -> Optional[float]:
        values = [float(b["attributes"][name]) for b in blocks if name in b.get("attributes", {})]
        return sum(values) / len(values) if values else None

    return {
        "blocks": len(blocks),
        "traces": len({b["trace_id"] for b in blocks}),
        "stages": stages,
        "mean_accepted": mean_attr("steerspec.accepted"),
        "mean_k": mean_attr("steerspec.k"),
        "bytes_up": mean_attr("steerspec.bytes_up"),
        "bytes_down": mean_attr("steerspec.bytes_down"),
    }


def _fmt(value: Optional[float], digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(summary: Dict[str, Any], title: str) -> None:
    table = Table(title=title)
    table.add_column("stage")
    table.add_column("median ms", justify="right")
    table.add_column("p90 ms", justify="right")
    table.add_column("mean ms", justify="right")
    table.add_column("blocks", justify="right")
    for stage in ROWS:
        row = summary["stages"][stage]
        table.add_row(stage, _fmt(row["median_ms"]), _fmt(row["p90_ms"]), _fmt(row["mean_ms"]), str(row["blocks"]))
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    console.print(table)
    for name, text in ROW_HELP.items():
        console.print(f"{name}: {text}")
    console.print(
        f"blocks={summary['blocks']} traces={summary['traces']} "
        f"mean_k={_fmt(summary['mean_k'], 2)} mean_accepted={_fmt(summary['mean_accepted'], 2)} "
        f"bytes_up={_fmt(summary['bytes_up'], 1)} bytes_down={_fmt(summary['bytes_down'], 1)} (mean per block)"
    )


def run(args: argparse.Namespace) -> int:
    spans = read_spans(args.file)
    summary = summarize_spans(spans, trace_id=args.trace_id)
    if summary["blocks"] == 0:
        raise UsageError(f"{args.file}: no '{BLOCK_SPAN}' spans (was it written by a generation with --trace-file?)")
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_table(summary, f"round-trip breakdown: {os.path.basename(args.file)}")
    return 0

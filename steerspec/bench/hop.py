"""The cost of one gRPC hop that wakes an idle process, under grpc's two TCP transports.

A grpc.aio bidirectional stream echoes one message of `--payload-bytes` each way after the client
sat idle for `--idle-ms` (as the coordinator does during an emulated network wait or a verifier
forward), and back to back (`--idle-ms 0`). Each transport runs in its own fresh process, because
grpc reads ``GRPC_EXPERIMENTS`` once when it is imported: ``event_engine`` is grpc's default,
``iomgr`` is what SteerSpec's processes select (`steerspec.serving.grpc_env`). Runs alternate between the
two `--repeats` times so that drift of the machine hits both alike. Prints a table of median and
p90 microseconds per round trip and writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import grpc
from rich.console import Console
from rich.table import Table

from steerspec.errors import UsageError
from steerspec.observability.trace_summary import percentile
from steerspec.serving.grpc_env import LEGACY_TCP_EXPERIMENTS, OPT_OUT_VAR

TRANSPORTS = ("event_engine", "iomgr")
METHOD = "/steerspec.bench.Hop/Echo"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--idle-ms", default="0,25", help="idle gaps before each message (comma-separated)")
    parser.add_argument("--messages", type=int, default=150, help="round trips per gap and run")
    parser.add_argument("--payload-bytes", type=int, default=1846, help="bytes per message (default: a k=8 block)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per transport")
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")


def child_env(transport: str) -> Dict[str, str]:
    """The environment of a measuring process for `transport`."""
    env = {k: v for k, v in os.environ.items() if k not in ("GRPC_EXPERIMENTS", OPT_OUT_VAR)}
    if transport == "iomgr":
        env["GRPC_EXPERIMENTS"] = LEGACY_TCP_EXPERIMENTS
    return env


async def _echo_round_trips(idle_ms: List[float], messages: int, payload: int) -> Dict[str, List[float]]:
    """In this process: {idle_ms: [µs per round trip]} over one echo stream on 127.0.0.1."""
    async def echo(requests, context):
        async for message in requests:
            yield message

    handler = grpc.method_handlers_generic_handler("steerspec.bench.Hop", {
        "Echo": grpc.stream_stream_rpc_method_handler(echo)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    out: Dict[str, List[float]] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream(METHOD)()
            body = os.urandom(payload)
            for gap in idle_ms:
                times = []
                for i in range(messages + 10):  # 10 warm-up round trips per gap
                    if gap > 0:
                        await asyncio.sleep(gap / 1000.0)
                    start = time.perf_counter()
                    await call.write(body)
                    await call.read()
                    if i >= 10:
                        times.append((time.perf_counter() - start) * 1e6)
                out[f"{gap:g}"] = times
            await call.done_writing()
    finally:
        await server.stop(None)
    return out


def _child_main(argv: List[str]) -> int:
    idle = [float(x) for x in argv[0].split(",")]
    print(json.dumps(asyncio.run(_echo_round_trips(idle, int(argv[1]), int(argv[2])))))
    return 0


def _measure(transport: str, args) -> Dict[str, List[float]]:
    cmd = [sys.executable, "-m", "steerspec.bench.hop", "--child", args.idle_ms, str(args.messages),
           str(args.payload_bytes)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=child_env(transport), timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{transport} run failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> int:
    try:
        gaps = [float(x) for x in args.idle_ms.split(",")]
    except ValueError:
        raise UsageError(f"--idle-ms must be comma-separated numbers, got '{args.idle_ms}'") from None
    if not gaps or any(not (0 <= g <= 1000) for g in gaps):
        raise UsageError("--idle-ms values must be in [0, 1000]")
    if args.messages < 1 or args.repeats < 1 or not (1 <= args.payload_bytes <= 4 << 20):
        raise UsageError("--messages and --repeats must be >= 1 and --payload-bytes in [1, 4 MiB]")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        raise UsageError(f"--out: directory {Path(args.out).resolve().parent} does not exist")

    runs: Dict[str, Dict[str, List[List[float]]]] = {t: {f"{g:g}": [] for g in gaps} for t in TRANSPORTS}
    for _ in range(args.repeats):
        for transport in TRANSPORTS:
            for gap, times in _measure(transport, args).items():
                runs[transport][gap].append(times)
    rows = []
    for gap in (f"{g:g}" for g in gaps):
        row = {"idle_ms": float(gap)}
        for transport in TRANSPORTS:
            medians = [statistics.median(t) for t in runs[transport][gap]]
            pooled = [x for t in runs[transport][gap] for x in t]
            row[transport] = {"median_us": round(statistics.median(pooled), 1), "p90_us": round(percentile(pooled, 90), 1),
                              "run_medians_us": [round(m, 1) for m in medians]}
        row["iomgr_vs_event_engine"] = round(row["iomgr"]["median_us"] / row["event_engine"]["median_us"], 3)
        rows.append(row)
    report = {"command": f"steerspec bench hop --idle-ms {args.idle_ms} --messages {args.messages} "
                         f"--payload-bytes {args.payload_bytes} --repeats {args.repeats}",
              "rows": rows, "cpus": os.cpu_count()}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps(report, indent=2))
        return 0

    table = Table(title=f"gRPC echo round trip, {args.payload_bytes} B each way (µs; median of "
                        f"{args.repeats}×{args.messages})")
    for name in ("idle ms", "event_engine median", "p90", "iomgr median", "p90", "iomgr / event_engine"):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(f"{r['idle_ms']:g}", f"{r['event_engine']['median_us']:.0f}", f"{r['event_engine']['p90_us']:.0f}",
                      f"{r['iomgr']['median_us']:.0f}", f"{r['iomgr']['p90_us']:.0f}", f"{r['iomgr_vs_event_engine']:.2f}")
    Console().print(table)
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    raise SystemExit(_child_main(sys.argv[2:]))

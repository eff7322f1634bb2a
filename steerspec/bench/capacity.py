"""Capacity: many edge sessions sharing one verifier, each mode against the verifier alone at the same load.

The services run as their own processes on 127.0.0.1 (one verifier, `--drafters` drafter processes and one
coordinator per emulated RTT, each link emulated by its coordinator), pinned to CPUs by placement:

- `edge`: the verifier on its own cores, the drafters, coordinators and clients (this process) on the others
  (on 2 cores: core 0 and core 1, one torch thread each);
- `colocated`: the drafters on the verifier's cores, the coordinators and clients on the others.

In each cell N clients (closed loop) generate back to back from an eval set's prompts, `--max-new-tokens`
tokens at `--temperature` (seeded), for `--cell-s` seconds; `--arrival-rate` replaces the closed loop by
Poisson arrivals at those rates (sessions/s). Modes: `verifier` (the verifier alone: one token per round trip,
batched across sessions), `k<N>` (chains of N drafts), `tree` (the default draft tree; `tree=SPEC` another),
`default` (what a request that names nothing gets); `<mode>+ahead` is the mode with drafting ahead on
(drafter_service/ahead.py; the plain mode takes the drafter's default), `<mode>+aheadN` preparing N verdicts per
block. The modes run interleaved cell by cell (their order
rotates each repeat), and every cell is repeated `--repeats` times.

Per cell: goodput (tokens committed in the cell's window over all clients, per second), time per output token
and time to first token (p50 / p99 over the generations), the verifier's mean rows per pass and busy fraction
and the drafters' busy fraction (from the services' GetStats counters). Per mode, the clients served within
the SLO: the largest concurrency whose p99 time per output token stays within `--slo-factor` × the verifier
alone's p50 at the lowest concurrency. Beside the measurement, a model: from the measured pass cost against
rows per pass (a line fitted over the placement's cells), τ and draft time at the lowest concurrency and the
link, the goodput each mode should reach, and the edge/colocated ratio drafting offload predicts.
Table, JSON (`--out`, with the CPU and the command) and PNG (`--png`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import grpc
from rich.console import Console
from rich.table import Table

from coordinator.client import Chunk, Client, Summary
from steerspec.bench.host import host_info
from steerspec.bench.processes import Part, free_port
from steerspec.data.evalsets import load_eval_set
from steerspec.errors import UsageError
from steerspec.models.dtype_choice import CHOICES as DTYPE_CHOICES, resolve as resolve_dtype
from steerspec.models.loading import load_tokenizer
from steerspec.observability.run_record import command_line
from steerspec.observability.trace_summary import percentile
from steerspec.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

PLACEMENTS = ("edge", "colocated")
DEFAULT_MODES = "verifier,k1,k2,k4,tree,default"
MAX_IN_FLIGHT = 256  # open loop: arrivals beyond this many running generations are dropped (and counted)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier", default="smollm2", help="verifier (default: smollm2, the real pair)")
    parser.add_argument("--drafter", default="smollm2-sd2", help="drafter (default: smollm2-sd2)")
    parser.add_argument("--eval-set", default="fresh", help="bundled eval set the prompts come from (default: fresh)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompts cut to this many tokens (default: 128)")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32", help="closed-loop clients per cell (default: 1..32)")
    parser.add_argument("--arrival-rate", default=None,
                        help="open loop instead: Poisson arrival rates in sessions/s, comma-separated")
    parser.add_argument("--modes", default=DEFAULT_MODES,
                        help=f"modes (default: {DEFAULT_MODES}); `<mode>+ahead` or `<mode>+aheadN`: with drafting "
                             "ahead on (N verdicts per block)")
    parser.add_argument("--rtt-ms", default="0,50,100", help="emulated RTTs, one coordinator each (default: 0,50,100)")
    parser.add_argument("--placements", default="edge,colocated", help="edge, colocated or both (default: both)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of every cell (default: 3)")
    parser.add_argument("--cell-s", type=float, default=20.0, help="seconds of generation per cell (default: 20)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="the verifier's dtype (default: auto, the machine's choice; the JSON records what it was)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drafters", type=int, default=1, help="drafter processes (default: 1; they batch sessions)")
    parser.add_argument("--slo-factor", type=float, default=2.0,
                        help="SLO: p99 time per output token within this many times the verifier alone's p50 "
                             "at the lowest concurrency (default: 2)")
    parser.add_argument("--session-timeout-s", type=float, default=300.0)
    parser.add_argument("--out", default="bench-results/capacity.json", help="JSON output path")
    parser.add_argument("--png", default="bench-results/capacity.png", help="figure path ('' for none)")


# ------------------------------------------------------------------------------------------ the request


def _numbers(text: str, name: str, kind=int, low: float = 0) -> List:
    try:
        values = [kind(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{name}: expected comma-separated numbers, got {text!r}") from None
    if not values or any(v < low for v in values):
        raise UsageError(f"{name}: expected numbers >= {low}, got {text!r}")
    return values


AHEAD_SUFFIX = "+ahead"


def mode_request(name: str) -> Dict[str, object]:
    """The SDK keywords of a mode: `verifier`, `k<N>`, `tree` / `tree=SPEC`, `load`, `default` (what a request that
    names nothing gets), any but `verifier` with `+ahead` (drafting ahead on) or `+aheadN` (N verdicts prepared per
    block); UsageError otherwise."""
    if AHEAD_SUFFIX in name and not name.startswith(AHEAD_SUFFIX):
        base, count = name.rsplit(AHEAD_SUFFIX, 1)
        if count and not count.isdigit():
            raise UsageError(f"unknown mode {name!r}: `+ahead` takes an optional verdict count, e.g. tree+ahead16")
        if base == "verifier":
            raise UsageError("verifier+ahead: the verifier alone drafts nothing to draft ahead")
        return {**mode_request(base), "draft_ahead": "on", **({"ahead_outcomes": int(count)} if count else {})}
    if name == "verifier":
        return {"mode": "autoregressive"}
    if name == "default":
        return {}
    if name == "tree":
        return {"tree": "default"}
    if name == "load":
        return {"policy": "load"}  # chains sized by the load-aware policy (the default sizes the default tree)
    if name.startswith("tree="):
        return {"tree": name.split("=", 1)[1]}
    if name.startswith("k") and name[1:].isdigit() and int(name[1:]) >= 1:
        return {"k": int(name[1:]), "policy": "fixed"}
    raise UsageError(f"unknown mode {name!r}: use verifier, k<N> (e.g. k4), tree, tree=SPEC, load or default")


def validate(args) -> argparse.Namespace:
    """The parsed lists on `args` (UsageError naming a bad option)."""
    args.rtt_list = _numbers(args.rtt_ms, "--rtt-ms", float)
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in args.mode_list:
        mode_request(mode)
    if "verifier" not in args.mode_list:
        raise UsageError("--modes must include verifier: every mode is compared with the verifier alone")
    args.placement_list = [p.strip() for p in args.placements.split(",") if p.strip()]
    if not args.placement_list or any(p not in PLACEMENTS for p in args.placement_list):
        raise UsageError(f"--placements: use {' and/or '.join(PLACEMENTS)}, got {args.placements!r}")
    args.rates = _numbers(args.arrival_rate, "--arrival-rate", float, 1e-9) if args.arrival_rate else []
    args.loads = args.rates or _numbers(args.concurrency, "--concurrency", int, 1)
    for name, value in (("--repeats", args.repeats), ("--drafters", args.drafters),
                        ("--max-new-tokens", args.max_new_tokens), ("--prompt-tokens", args.prompt_tokens)):
        if value < 1:
            raise UsageError(f"{name} must be at least 1, got {value}")
    if not args.cell_s > 0 or not args.slo_factor > 0:
        raise UsageError("--cell-s and --slo-factor must be positive")
    return args


# ------------------------------------------------------------------------------------------ placement


def placement_cpus(placement: str, cpus: Sequence[int]) -> Dict[str, List[int]]:
    """Which CPUs the verifier, the drafters and the edge (coordinators and clients) run on."""
    cpus = sorted(cpus)
    if len(cpus) < 2:
        return {"verifier": cpus, "drafter": cpus, "edge": cpus}
    half = (len(cpus) + 1) // 2
    server, edge = cpus[:half], cpus[half:]
    return {"verifier": server, "drafter": edge if placement == "edge" else server, "edge": edge}


class Deployment:
    """One verifier, the drafters and one coordinator per RTT as `steerspec serve` processes, pinned."""

    def __init__(self, args, placement: str, workdir: Path) -> None:
        self.cpus = placement_cpus(placement, sorted(os.sched_getaffinity(0)))
        py = [sys.executable, "-m", "steerspec", "serve"]
        quiet = ["--log-level", "warning"]
        self.verifier = Part("verifier", "verifier", [], free_port(), workdir, cpus=self.cpus["verifier"],
                             threads=len(self.cpus["verifier"]))
        self.verifier.argv = py + ["verifier", "--port", str(self.verifier.port), "--model", str(args.verifier),
                                   "--threads", str(len(self.cpus["verifier"])), "--dtype", args.dtype, *quiet]
        self.drafters = [Part(f"drafter-{i}", "drafter", [], free_port(), workdir, cpus=self.cpus["drafter"])
                         for i in range(args.drafters)]
        for part in self.drafters:
            part.argv = py + ["drafter", "--port", str(part.port), "--model", str(args.drafter), "--threads", "1",
                              *quiet]
        self.coordinators: Dict[float, Part] = {}
        for rtt in args.rtt_list:
            part = Part(f"coordinator-rtt{rtt:g}", "coordinator", [], free_port(), workdir, cpus=self.cpus["edge"])
            part.argv = py + ["coordinator", "--port", str(part.port), "--tokenizer", str(args.verifier),
                              "--verifier", self.verifier.address,
                              "--drafter", ",".join(p.address for p in self.drafters), "--rtt-ms", f"{rtt:g}", *quiet]
            self.coordinators[rtt] = part

    @property
    def parts(self) -> List[Part]:
        return [self.verifier, *self.drafters, *self.coordinators.values()]

    async def start(self) -> None:
        """Start the replicas, then the coordinators; UsageError naming a part that did not come up."""
        for group in ([self.verifier, *self.drafters], list(self.coordinators.values())):
            for part in group:
                part.start()
            for part in group:
                if not await part.wait_ready():
                    raise UsageError(f"{part.name} did not start: {part.tail(400).strip().splitlines()[-1:]}")

    def stop(self) -> None:
        for part in self.parts:
            if part.proc is not None and part.proc.poll() is None:
                part.proc.terminate()
        for part in reversed(self.parts):
            part.stop()


@dataclass
class Counters:
    """The services' cumulative load counters (ServiceStats) at one moment."""

    at: float
    verifier: Tuple[int, int, float, int]  # passes, rows, busy_s, blocks
    drafters: Tuple[int, int, float, int]  # summed over the drafter processes

    def minus(self, earlier: "Counters") -> Dict[str, float]:
        wall = max(self.at - earlier.at, 1e-9)
        vp, vr, vb, vn = (a - b for a, b in zip(self.verifier, earlier.verifier))
        dp, dr, db, _ = (a - b for a, b in zip(self.drafters, earlier.drafters))
        return {"wall_s": wall, "verifier_passes": vp, "verifier_rows": vr, "verifier_busy_s": vb,
                "verifier_blocks": vn, "drafter_calls": dp, "drafter_blocks": dr, "drafter_busy_s": db}


async def counters(deployment: Deployment) -> Counters:
    async def one(address: str, stub_type, request, method: str) -> Tuple[int, int, float, int]:
        async with grpc.aio.insecure_channel(address) as channel:
            response = await getattr(stub_type(channel), method)(request, timeout=10)
        s = response.stats
        return int(s.passes_total), int(s.rows_total), float(s.busy_s), int(s.blocks_total)

    verifier = await one(deployment.verifier.address, verifier_pb2_grpc.VerifierServiceStub,
                         verifier_pb2.GetVerifierStatsRequest(), "GetVerifierStats")
    drafters = [await one(p.address, drafter_pb2_grpc.DrafterServiceStub, drafter_pb2.GetDrafterStatsRequest(),
                          "GetDrafterStats") for p in deployment.drafters]
    summed = tuple(sum(d[i] for d in drafters) for i in range(4))
    return Counters(time.monotonic(), verifier, summed)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ one cell


@dataclass
class Generation:
    start: float
    first: Optional[float] = None
    end: float = 0.0
    tokens: int = 0
    in_window: int = 0  # tokens committed before the cell's window closed
    rounds: int = 0
    critical_draft_ms: float = 0.0  # summed over its blocks: drafting left on the critical path
    ahead_blocks: int = 0
    ahead_hits: int = 0
    error: str = ""


async def _generate(client: Client, prompt: List[int], request: Dict[str, object], args, seed: int,
                    stop_at: float, out: List[Generation]) -> None:
    g = Generation(start=time.monotonic())
    out.append(g)
    try:
        async for item in client.agenerate(prompt_ids=prompt, max_new_tokens=args.max_new_tokens,
                                           temperature=args.temperature, seed=seed, timeout=args.session_timeout_s,
                                           **request):
            if isinstance(item, Chunk) and item.token_ids:
                now = time.monotonic()
                g.first = now if g.first is None else g.first
                g.tokens += len(item.token_ids)
                g.in_window += len(item.token_ids) if now <= stop_at else 0
            elif isinstance(item, Summary):
                g.rounds = item.rounds
                g.critical_draft_ms = item.draft_compute_ms * item.rounds
                g.ahead_blocks, g.ahead_hits = item.ahead_blocks, item.ahead_hits
    except grpc.aio.AioRpcError as exc:
        g.error = exc.code().name
    finally:
        g.end = time.monotonic()


async def run_cell(deployment: Deployment, rtt: float, mode: str, load: float, prompts: Sequence[List[int]],
                   args, seed: int) -> Dict[str, object]:
    """One cell: `load` closed-loop clients (or Poisson arrivals at `load`/s) for `--cell-s` seconds."""
    request = mode_request(mode)
    target = deployment.coordinators[rtt].address
    rng = random.Random(seed)
    gens: List[Generation] = []
    dropped = 0
    before = await counters(deployment)
    start = time.monotonic()
    stop_at = start + args.cell_s
    window: Dict[str, Counters] = {}

    async def at_window_end() -> None:
        await asyncio.sleep(max(0.0, stop_at - time.monotonic()))
        window["end"] = await counters(deployment)

    async with Client(target, retries=3) as client:
        closer = asyncio.create_task(at_window_end())
        if args.rates:
            tasks: List[asyncio.Task] = []
            while True:
                await asyncio.sleep(rng.expovariate(load))
                if time.monotonic() >= stop_at:
                    break
                if sum(not t.done() for t in tasks) >= MAX_IN_FLIGHT:
                    dropped += 1
                    continue
                tasks.append(asyncio.create_task(_generate(client, prompts[rng.randrange(len(prompts))], request, args,
                                                           rng.randrange(1 << 30), stop_at, gens)))
            await asyncio.gather(*tasks)
        else:
            async def user(index: int) -> None:
                turn = 0
                while time.monotonic() < stop_at:
                    prompt = prompts[(index * 7 + turn) % len(prompts)]
                    await _generate(client, prompt, request, args, seed + 1000 * index + turn, stop_at, gens)
                    turn += 1

            await asyncio.gather(*(user(i) for i in range(int(load))))
        await closer
    load_used = window["end"].minus(before)
    done = [g for g in gens if not g.error and g.first is not None]
    tpot = [(g.end - g.first) / (g.tokens - 1) * 1e3 for g in done if g.tokens > 1]
    ttft = [(g.first - g.start) * 1e3 for g in done]
    rounds = sum(g.rounds for g in done)
    ahead_blocks = sum(g.ahead_blocks for g in done)
    wall = load_used["wall_s"]
    return {
        "rtt_ms": rtt, "mode": mode, "load": load, "seed": seed,
        "generations": len(done), "errors": sum(1 for g in gens if g.error), "dropped": dropped,
        "goodput": round(sum(g.in_window for g in gens) / args.cell_s, 3),
        "tpot_ms_p50": _pct(tpot, 50), "tpot_ms_p99": _pct(tpot, 99),
        "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p99": _pct(ttft, 99),
        "tau": round(sum(g.tokens for g in done) / rounds, 4) if rounds else None,
        "verifier_rows_per_pass": _ratio(load_used["verifier_rows"], load_used["verifier_passes"]),
        "verifier_pass_ms": _ratio(load_used["verifier_busy_s"] * 1e3, load_used["verifier_passes"]),
        "verifier_blocks_per_pass": _ratio(load_used["verifier_blocks"], load_used["verifier_passes"]),
        "verifier_rows_per_block": _ratio(load_used["verifier_rows"], load_used["verifier_blocks"]),
        "verifier_busy": round(min(1.0, load_used["verifier_busy_s"] / wall), 4),
        "drafter_busy": round(min(1.0, load_used["drafter_busy_s"] / (wall * max(1, len(deployment.drafters)))), 4),
        "draft_ms_per_block": _ratio(load_used["drafter_busy_s"] * 1e3, load_used["drafter_blocks"]),
        "critical_draft_ms": _ratio(sum(g.critical_draft_ms for g in done), rounds),
        "ahead_hit_rate": _ratio(sum(g.ahead_hits for g in done), ahead_blocks),
        "drain_s": round(time.monotonic() - stop_at, 3),
    }


def _pct(values: Sequence[float], q: float) -> Optional[float]:
    return round(percentile(values, q), 3) if values else None


def _ratio(a: float, b: float) -> Optional[float]:
    return round(a / b, 4) if b else None


# ------------------------------------------------------------------------------------------ summaries


def summarize(cells: Sequence[Dict[str, object]]) -> List[Dict[str, object]]:
    """Per (placement, RTT, load, mode): the mean of each figure over the repeats and goodput's spread."""
    groups: Dict[tuple, List[Dict[str, object]]] = {}
    for c in cells:
        groups.setdefault((c["placement"], c["rtt_ms"], c["load"], c["mode"]), []).append(c)
    out = []
    keys = ("tpot_ms_p50", "tpot_ms_p99", "ttft_ms_p50", "ttft_ms_p99", "tau", "verifier_rows_per_pass",
            "verifier_pass_ms", "verifier_blocks_per_pass", "verifier_rows_per_block", "verifier_busy", "drafter_busy",
            "draft_ms_per_block", "critical_draft_ms", "ahead_hit_rate")
    for (placement, rtt, load, mode), group in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        goodputs = [float(c["goodput"]) for c in group]
        row = {"placement": placement, "rtt_ms": rtt, "load": load, "mode": mode, "repeats": len(group),
               "goodput": round(statistics.fmean(goodputs), 3),
               "goodput_spread": round(statistics.stdev(goodputs), 3) if len(goodputs) > 1 else 0.0,
               "errors": sum(int(c["errors"]) for c in group)}
        for key in keys:
            values = [float(c[key]) for c in group if c.get(key) is not None]
            row[key] = round(statistics.fmean(values), 4) if values else None
        out.append(row)
    alone = {(r["placement"], r["rtt_ms"], r["load"]): r["goodput"] for r in out if r["mode"] == "verifier"}
    for r in out:
        base = alone.get((r["placement"], r["rtt_ms"], r["load"]))
        r["over_verifier_alone"] = round(r["goodput"] / base, 3) if base else None
    by_mode = {(r["placement"], r["rtt_ms"], r["load"], r["mode"]): r["goodput"] for r in out}
    for r in out:  # drafting ahead against the same mode drafting after the result
        if AHEAD_SUFFIX in r["mode"]:
            base = by_mode.get((r["placement"], r["rtt_ms"], r["load"], r["mode"].rsplit(AHEAD_SUFFIX, 1)[0]))
            r["over_without_ahead"] = round(r["goodput"] / base, 3) if base else None
    return out


def slo(summary: Sequence[Dict[str, object]], factor: float) -> List[Dict[str, object]]:
    """Per (placement, RTT, mode): the largest load whose p99 time per output token is within the bound."""
    out = []
    for placement, rtt in sorted({(r["placement"], r["rtt_ms"]) for r in summary}):
        rows = [r for r in summary if r["placement"] == placement and r["rtt_ms"] == rtt]
        lowest = min(r["load"] for r in rows)
        base = next((r["tpot_ms_p50"] for r in rows if r["mode"] == "verifier" and r["load"] == lowest), None)
        if base is None:
            continue
        bound = factor * base
        for mode in dict.fromkeys(r["mode"] for r in rows):
            within = [r["load"] for r in rows if r["mode"] == mode and r["tpot_ms_p99"] is not None
                      and r["tpot_ms_p99"] <= bound]
            out.append({"placement": placement, "rtt_ms": rtt, "mode": mode, "tpot_bound_ms": round(bound, 3),
                        "served_within_slo": max(within) if within else 0})
    return out


def fit_pass_cost(cells: Sequence[Dict[str, object]]) -> Optional[Tuple[float, float]]:
    """(a, b) of pass ms ≈ a + b · rows, least squares over cells' (mean rows per pass, mean pass ms)."""
    points = [(float(c["verifier_rows_per_pass"]), float(c["verifier_pass_ms"])) for c in cells
              if c.get("verifier_rows_per_pass") and c.get("verifier_pass_ms")]
    if len({x for x, _ in points}) < 2:
        return None
    mx, my = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


def model(summary: Sequence[Dict[str, object]], cells: Sequence[Dict[str, object]], closed_loop: bool
          ) -> List[Dict[str, object]]:
    """Predicted goodput per cell: N sessions of τ tokens per round, each round at least its own critical path
    (RTT + draft + one pass of r rows) and the verifier's share (one pass of N·r rows, plus N drafts when the
    drafters run on its cores); `edge_over_colocated` = 1 + N·t_draft / c(N·r) where the verifier bounds it."""
    out = []
    for placement in sorted({c["placement"] for c in cells}):
        fit = fit_pass_cost([c for c in cells if c["placement"] == placement])
        if fit is None or not closed_loop:
            continue
        a, b = fit
        cost = lambda rows: a + b * rows  # noqa: E731  (ms)
        for rtt in sorted({r["rtt_ms"] for r in summary if r["placement"] == placement}):
            rows = [r for r in summary if r["placement"] == placement and r["rtt_ms"] == rtt]
            lowest = min(r["load"] for r in rows)
            for r in rows:
                base = next((x for x in rows if x["mode"] == r["mode"] and x["load"] == lowest), None)
                if base is None:
                    continue
                per_block = base["verifier_rows_per_pass"] or 1.0
                tau = base["tau"] or 1.0
                draft = 0.0 if r["mode"] == "verifier" else (base["draft_ms_per_block"] or 0.0)
                n = float(r["load"])
                own = rtt + draft + cost(per_block)
                shared = cost(n * per_block) + (n * draft if placement == "colocated" else 0.0)
                predicted = n * tau / max(own, shared) * 1e3
                out.append({"placement": placement, "rtt_ms": rtt, "load": r["load"], "mode": r["mode"],
                            "pass_ms_fit": [round(a, 3), round(b, 3)], "predicted_goodput": round(predicted, 2),
                            "measured_goodput": r["goodput"],
                            "edge_over_colocated_predicted": round(1 + n * draft / cost(n * per_block), 3)})
    return out


def edge_over_colocated(summary: Sequence[Dict[str, object]]) -> List[Dict[str, object]]:
    """Measured goodput of edge over colocated, per (RTT, load, mode) present in both placements."""
    by = {(r["placement"], r["rtt_ms"], r["load"], r["mode"]): r["goodput"] for r in summary}
    out = []
    for (placement, rtt, load, mode), goodput in by.items():
        other = by.get(("colocated", rtt, load, mode))
        if placement == "edge" and other:
            out.append({"rtt_ms": rtt, "load": load, "mode": mode, "measured": round(goodput / other, 3)})
    return out


# ------------------------------------------------------------------------------------------ output


def print_tables(report: Dict[str, object], console: Console) -> None:
    summary, modes = report["summary"], report["config"]["modes"]
    unit = "arrivals/s" if report["config"]["arrival_rates"] else "clients"
    predicted = {(m["placement"], m["rtt_ms"], m["load"], m["mode"]): m["predicted_goodput"] for m in report["model"]}
    for placement, rtt in sorted({(r["placement"], r["rtt_ms"]) for r in summary}):
        table = Table(title=f"goodput tok/s, {placement} placement, RTT {rtt:g} ms (× the verifier alone; "
                            "[model]; p99 TPOT ms)")
        table.add_column(unit, justify="right")
        for mode in modes:
            table.add_column(mode, justify="right")
        table.add_column("verifier rows/pass · busy", justify="right")
        for load in sorted({r["load"] for r in summary if r["placement"] == placement and r["rtt_ms"] == rtt}):
            cells, busy = [], ""
            for mode in modes:
                r = next((x for x in summary if (x["placement"], x["rtt_ms"], x["load"], x["mode"])
                          == (placement, rtt, load, mode)), None)
                if r is None:
                    cells.append("")
                    continue
                versus = r["over_verifier_alone"]
                ratio = "" if mode == "verifier" or versus is None else f" ({versus:.2f}×)"
                guess = predicted.get((placement, rtt, load, mode))
                guess = "" if guess is None else f" [{guess:.0f}]"
                tpot = "-" if r["tpot_ms_p99"] is None else f"{r['tpot_ms_p99']:.0f}"
                cells.append(f"{r['goodput']:.1f}±{r['goodput_spread']:.1f}{ratio}{guess}; {tpot}")
                if mode == "verifier" and r["verifier_rows_per_pass"] is not None:
                    busy = f"{r['verifier_rows_per_pass']:.1f} · {r['verifier_busy']:.2f}"
            table.add_row(f"{load:g}", *cells, busy)
        console.print(table)
    for s in report["slo"]:
        console.print(f"SLO {s['placement']} RTT {s['rtt_ms']:g}: {s['mode']} serves {s['served_within_slo']:g} "
                      f"{unit} within p99 TPOT <= {s['tpot_bound_ms']:.0f} ms")
    for e in report["edge_over_colocated"]:
        guess = next((m["edge_over_colocated_predicted"] for m in report["model"] if m["placement"] == "edge"
                      and (m["rtt_ms"], m["load"], m["mode"]) == (e["rtt_ms"], e["load"], e["mode"])), None)
        console.print(f"edge/colocated RTT {e['rtt_ms']:g}, {e['load']:g} {unit}, {e['mode']}: {e['measured']:.2f} "
                      f"(model {guess})")


def write_png(report: Dict[str, object], path: str) -> None:
    # lazy: matplotlib only to draw the figure
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib only to draw the figure
    import matplotlib.pyplot as plt

    summary, modes = report["summary"], report["config"]["modes"]
    panels = sorted({(r["placement"], r["rtt_ms"]) for r in summary})
    fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 7.5), squeeze=False)
    for col, (placement, rtt) in enumerate(panels):
        top, bottom = axes[0][col], axes[1][col]
        for mode in modes:
            rows = sorted((r for r in summary if (r["placement"], r["rtt_ms"], r["mode"]) == (placement, rtt, mode)),
                          key=lambda r: r["load"])
            if not rows:
                continue
            top.errorbar([r["load"] for r in rows], [r["goodput"] for r in rows],
                         yerr=[r["goodput_spread"] for r in rows], marker="o", capsize=2, label=mode)
            points = [(r["goodput"], r["tpot_ms_p50"]) for r in rows if r["tpot_ms_p50"] is not None]
            bottom.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=mode)
        top.set_xscale("log", base=2)
        top.set_title(f"{placement}, RTT {rtt:g} ms", fontsize=9)
        top.set_xlabel("arrivals/s" if report["config"]["arrival_rates"] else "concurrent clients")
        top.set_ylabel("goodput (tokens/s)")
        bottom.set_xlabel("goodput (tokens/s)")
        bottom.set_ylabel("time per output token p50 (ms)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"steerspec bench capacity: {report['config']['verifier']} + {report['config']['drafter']} "
                 f"on {report['machine'].get('cpu')}", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ the run


def _prompts(args) -> List[List[int]]:
    tokenizer = load_tokenizer(args.verifier)
    texts = [p["prompt"] for p in load_eval_set(args.eval_set)]
    prompts = [list(tokenizer(t, add_special_tokens=False)["input_ids"])[-args.prompt_tokens:] for t in texts]
    return [p for p in prompts if p]


async def measure(args) -> List[Dict[str, object]]:
    prompts = _prompts(args)
    cells: List[Dict[str, object]] = []
    own = sorted(os.sched_getaffinity(0))
    total = len(args.placement_list) * args.repeats * len(args.rtt_list) * len(args.loads) * len(args.mode_list)
    try:
        for placement in args.placement_list:
            with tempfile.TemporaryDirectory(prefix="steerspec-capacity-") as workdir:
                deployment = Deployment(args, placement, Path(workdir))
                os.sched_setaffinity(0, set(deployment.cpus["edge"]))  # the clients are edge too
                try:
                    await deployment.start()
                    for rtt in args.rtt_list:  # warm-up: caches, weight copies, first passes
                        for mode in args.mode_list:
                            await run_cell(deployment, rtt, mode, 1 if not args.rates else args.loads[0], prompts[:1],
                                           argparse.Namespace(**{**vars(args), "cell_s": 0.01}), args.seed)
                    for repeat in range(args.repeats):
                        for rtt in args.rtt_list:
                            for load in args.loads:
                                turn = args.mode_list[repeat % len(args.mode_list):] + \
                                    args.mode_list[:repeat % len(args.mode_list)]
                                for mode in turn:
                                    cell = await run_cell(deployment, rtt, mode, load, prompts, args,
                                                          args.seed + 7919 * repeat)
                                    cell.update(placement=placement, repeat=repeat)
                                    cells.append(cell)
                                    sys.stderr.write(f"[{len(cells)}/{total}] {placement} rtt {rtt:g} load {load:g} "
                                                     f"{mode}: {cell['goodput']:.1f} tok/s\n")
                finally:
                    deployment.stop()
                    placement_note = {k: v for k, v in deployment.cpus.items()}
                    for c in cells:
                        if c["placement"] == placement:
                            c["cpus"] = placement_note
    finally:
        os.sched_setaffinity(0, set(own))
    return cells


def run(args: argparse.Namespace) -> int:
    command = command_line("steerspec bench capacity", args)  # before `validate` adds its parsed lists
    validate(args)
    cells = asyncio.run(measure(args))
    summary = summarize(cells)
    cpus = {p: placement_cpus(p, sorted(os.sched_getaffinity(0))) for p in args.placement_list}
    report = {
        "benchmark": "capacity",
        "command": command,
        "machine": {**host_info(), "cpus": sorted(os.sched_getaffinity(0))},
        "config": {"verifier": args.verifier, "drafter": args.drafter, "eval_set": args.eval_set,
                   "modes": args.mode_list, "rtt_ms": args.rtt_list, "placements": args.placement_list,
                   "loads": args.loads, "arrival_rates": bool(args.rates), "repeats": args.repeats,
                   "cell_s": args.cell_s, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                   "seed": args.seed, "drafters": args.drafters, "slo_factor": args.slo_factor,
                   "placement_cpus": cpus,
                   "verifier_dtype": {p: resolve_dtype(args.dtype, args.verifier, "cpu", len(cpus[p]["verifier"]))
                                      for p in args.placement_list}},
        "cells": cells,
        "summary": summary,
        "slo": slo(summary, args.slo_factor),
        "model": model(summary, cells, closed_loop=not args.rates),
        "edge_over_colocated": edge_over_colocated(summary),
    }
    print_tables(report, Console())
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    if args.png:
        write_png(report, args.png)
        print(f"wrote {args.png}")
    return 0 if not any(c["errors"] for c in cells) else 1

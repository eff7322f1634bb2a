"""The distributed path over an emulated remote link, at several RTTs, in one run.

For each RTT (coordinator ↔ verifier link emulated by steerspec.serving.linkemu; in-process servers on
loopback via coordinator.local.LocalCluster):

- ``autoregressive``: the verifier alone over the same link, one round trip per token;
- ``speculative``: the pretrained drafter proposing k tokens per round trip through the services;
- ``engine``: the in-process engine (no gRPC, no link; measured once, the same for every RTT);

with tokens/s, block efficiency, speedup (speculative ÷ autoregressive over the same link; and per prompt,
the modes interleaved prompt by prompt so the host's drift reaches each alike, its mean ± standard error), mean
bytes per block up/down, median stage times per block and the mean verifier batch size; plus the
aggregate tokens/s of the same N speculative generations run 1 at a time and N at a time. Prints a table, writes JSON
(``--out``) and optionally a PNG (``--plot``), and checks the targets: overhead ≤ 1 ms median per
block, ≤ 4 KB up per block (at T=1, k=8, draft-top-k 64), and N=8 concurrent sessions ≥ 5× the
aggregate tokens/s of one at RTT 50 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from rich.console import Console
from rich.table import Table

from coordinator.cli import load_tokenizer_and_eos
from coordinator.launch import Services, launch
from coordinator.local import LocalCluster
from steerspec.bench.host import host_info
from steerspec.cli.run import add_device_arguments, drafter_dtype_of
from steerspec.decoding.engine import DecodeConfig, speculative_generate
from steerspec.decoding.sampling import SamplingParams
from steerspec.decoding.trees import parse_tree
from steerspec.errors import UsageError, float_list
from steerspec.models import load_model
from steerspec.models.checkpoints import resolve_model_dir
from steerspec.models.dtype_choice import resolve_path
from steerspec.models.kernel_path import apply_invariance
from steerspec.models.loading import resolve_device
from steerspec.observability.run_record import command_line, tokens_digest
from steerspec.observability.trace_summary import percentile
from steerspec.policies.fixed import FixedK
from steerspec.serving.linkemu import LinkModel
from steerspec.steering.io import steering_dir
from steerspec.steering.runtime import maybe_steering

STAGES = ("draft", "network", "queue", "verify", "overhead")
TARGET_OVERHEAD_MS = 1.0
TARGET_BYTES_UP = 4096
TARGET_CONCURRENCY_RATIO = 5.0
TARGET_RTT_MS = 50.0

FALLBACK_PROMPTS = [
    "def fibonacci(n):",
    "class Queue:\n    def __init__(self):",
    "import os\nimport sys\n\ndef main():",
    "def binary_search(items, target):",
    "# Read a CSV file and print the sum of each column\n",
    "def is_prime(n):",
    "class Stack:",
    "for name in sorted(",
]


def _int_list(text: str, flag: str) -> List[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} expects comma-separated integers, got '{text}'") from None
    if not values or any(v < 1 for v in values):
        raise UsageError(f"{flag} expects integers >= 1, got '{text}'")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rtt-ms", default="0,10,50,100", help="emulated round-trip times (comma-separated)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per mode and RTT")
    parser.add_argument("--prompt-set", default="indist", help="bundled eval set (falls back to built-in prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=8, help="draft length per block")
    parser.add_argument("--tree", default=None, metavar="SPEC",
                        help="also run a draft tree (rank paths such as 0,1,2,00,10, or 'default') through the same "
                             "services at every RTT: a third row beside the chain of k")
    parser.add_argument("--block", action="store_true",
                        help="also run the chain of k with block verification (verification 'block') through the "
                             "same services at every RTT: a row beside the token-wise chain (with --tree, the tree "
                             "by traversal verification too)")
    parser.add_argument("--draft-top-k", type=int, default=64, help="support of the sparse draft distribution")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--verifier", default="verifier", help="bundled name or checkpoint directory")
    parser.add_argument("--drafter", default="pretrained", help="bundled name or checkpoint directory")
    add_device_arguments(parser)
    parser.add_argument("--concurrency", default="1,8", help="concurrent session counts for the aggregate run")
    parser.add_argument("--drafters", type=int, default=1,
                        help="drafter replicas behind the coordinator (sessions are placed least-loaded; "
                             "8 = one edge drafter per session when 8 run at once)")
    parser.add_argument("--concurrency-rtt-ms", default=None,
                        help="RTTs at which to run the concurrency comparison (default: all of --rtt-ms)")
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--bandwidth-mbps", type=float, default=0.0)
    parser.add_argument("--batch-window-ms", type=float, default=None, help="verifier batch window (server default)")
    parser.add_argument("--kv-backend", default="auto", choices=["auto", "fast", "hf"],
                        help="the verifier sessions' KV caches (`serve verifier --kv-backend`)")
    parser.add_argument("--draft-ahead", default="off", choices=("off", "on", "both"),
                        help="drafting ahead (drafter_service/ahead.py) for the speculative and tree rows: off "
                             "(default), on, or both (each row also with drafting ahead, `<row>_ahead`, interleaved "
                             "prompt by prompt)")
    parser.add_argument("--ahead-outcomes", type=int, default=0,
                        help="verdicts prepared per block when drafting ahead (0 = the drafter's default)")
    parser.add_argument("--ahead-budget-ms", type=float, default=0.0,
                        help="drafter time preparing per block when drafting ahead (0 = the drafter's default; "
                             "< 0 = no time limit)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    parser.add_argument("--no-engine", action="store_true", help="skip the in-process engine baseline")
    parser.add_argument("--deployment", choices=("local", "ray"), default="local",
                        help="local: every server in this process (LocalCluster); ray: verifier, drafter and "
                             "coordinator as Ray actors in their own processes (loopback), per-block stages "
                             "read from the coordinator's trace file")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    parser.add_argument("--plot", default=None, help="write a PNG (tokens/s vs RTT, stage breakdown) here")
    parser.add_argument("--json", action="store_true", help="print the JSON report instead of the table")


# ------------------------------------------------------------------------------------ measuring


def _median(values: Sequence[float]) -> Optional[float]:
    return float(statistics.median(values)) if values else None


def _mean(values: Sequence[float]) -> Optional[float]:
    return float(statistics.fmean(values)) if values else None


def summarize_runs(results: Sequence[Any], wall_s: Optional[float] = None) -> Dict[str, Any]:
    """Pool DistributedResults: tokens/s over the summed wall time, per-block medians and means."""
    tokens = sum(r.generated for r in results)
    rounds = sum(r.rounds for r in results)
    drafted = sum(r.drafted for r in results)
    accepted = sum(r.accepted for r in results)
    wall = wall_s if wall_s is not None else sum(r.wall_s for r in results)
    blocks = [b for r in results for b in getattr(r, "blocks", [])]
    out: Dict[str, Any] = {
        "sessions": len(results),
        "generated_tokens": tokens,
        "tokens_sha256": tokens_digest([getattr(r, "token_ids", None) for r in results]),
        "wall_s": round(wall, 4),
        "tokens_per_s": round(tokens / wall, 3) if wall > 0 else None,
        "rounds": rounds,
        "block_efficiency": round(tokens / rounds, 4) if rounds else None,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
    }
    if blocks:
        out.update({
            "bytes_up": round(_mean([b.bytes_up for b in blocks]), 1),
            "bytes_down": round(_mean([b.bytes_down for b in blocks]), 1),
            "rtt_ms": round(_median([b.rtt_ms for b in blocks]), 3),
            "stage_ms": {s: round(_median([getattr(b, f"{s}_ms") for b in blocks]), 3) for s in STAGES},
            "stage_ms_p90": {s: round(percentile([getattr(b, f"{s}_ms") for b in blocks], 90), 3) for s in STAGES},
            "batch_size": round(_mean([b.batch_size for b in blocks]), 3),
            "blocks": len(blocks),
            # the drafter's compute left on the critical path per block (its own report), mean and median
            "critical_draft_ms": round(_mean([b.draft_compute_ms for b in blocks]), 3),
            "critical_draft_ms_median": round(_median([b.draft_compute_ms for b in blocks]), 3),
        })
        ahead = [b for b in blocks if getattr(b, "ahead", False)]
        if ahead:
            hits = sum(1 for b in ahead if b.ahead_hit)
            out["ahead"] = {"blocks": len(ahead), "hits": hits, "hit_rate": round(hits / len(ahead), 4),
                            "prepared_per_block": round(_mean([b.ahead_prepared for b in ahead]), 3),
                            "ahead_ms_per_block": round(_mean([b.ahead_ms for b in ahead]), 3)}
    return out


def _prompts(args, tokenizer) -> List[List[int]]:
    texts: List[str] = []
    eval_file = Path(__file__).resolve().parent.parent / "assets" / "eval" / f"{args.prompt_set}.jsonl"
    if eval_file.is_file():
        for line in eval_file.read_text().splitlines():
            if line.strip():
                texts.append(json.loads(line)["prompt"])
    if not texts:
        texts = list(FALLBACK_PROMPTS)
    needed = max(args.prompts, max(args.concurrency_list))
    texts = [texts[i % len(texts)] for i in range(needed)]
    prompts = [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    if any(not p for p in prompts):
        raise UsageError("an eval prompt tokenised to nothing; use another --prompt-set")
    return prompts


def _engine_run(verifier, drafter, prompts, args, eos, steering=None) -> Dict[str, Any]:
    """The in-process engine on the same prompts (an SD² drafter steered, as through the services)."""
    results = []
    for i, prompt in enumerate(prompts):
        config = DecodeConfig(max_new_tokens=args.max_new_tokens, draft_top_k=args.draft_top_k, seed=args.seed + i,
                              sampling=SamplingParams(args.temperature, args.top_k, args.top_p), eos_token_ids=eos)
        results.append(speculative_generate(verifier, drafter, prompt, config, policy=FixedK(args.k), steering=steering))
    return summarize_runs(results)


@dataclass
class BlockRecord:
    """One round trip as read back from a `steerspec.block` span (Ray deployment)."""

    rtt_ms: float
    draft_ms: float
    network_ms: float
    queue_ms: float
    verify_ms: float
    overhead_ms: float
    bytes_up: float
    bytes_down: float
    batch_size: float
    draft_compute_ms: float = 0.0
    ahead: float = 0.0
    ahead_hit: float = 0.0
    ahead_prepared: float = 0.0
    ahead_ms: float = 0.0


@dataclass
class RunRecord:
    """One generation's totals (and its blocks when known)."""

    generated: int
    rounds: int
    drafted: int
    accepted: int
    wall_s: float
    blocks: List[BlockRecord] = field(default_factory=list)
    token_ids: Optional[List[int]] = None


class RayCluster:
    """The ray deployment of `coordinator.launch` (verifier, drafters and a coordinator as Ray actors, models
    loaded once), re-linked per RTT.

    Same `generate` interface as LocalCluster; per-block stages come from the coordinator's JSONL
    trace (its `steerspec.block` spans, matched by the summary's trace id).
    """

    def __init__(self, args, workdir: str) -> None:
        self.args = args
        self.trace_file = os.path.join(workdir, "coordinator.jsonl")
        gpus = 1 if args.device_type == "cuda" else 0  # each actor gets one GPU, its "cuda"
        options = _verifier_options(args)
        services = Services(verifier=str(args.verifier_dir), drafter=str(args.drafter_dir), drafters=args.drafters,
                            dtype=args.dtype, drafter_dtype=args.drafter_dtype, device="cuda" if gpus else "cpu",
                            invariant=args.invariant,
                            tokenizer=str(args.verifier_dir),
                            num_threads=args.threads if args.threads > 0 else None, trace_file=self.trace_file,
                            verifier_options=options)
        self.deployment = launch(services, "ray", verifier_gpus=gpus, drafter_gpus=gpus, timeout=600)
        self.steering = services.steering_dir() is not None  # an SD² drafter: requests ask for steering
        self.client = None

    async def start(self) -> None:
        await self.deployment.start()

    def link(self, link) -> "RayCluster":
        self.deployment.set_link(link)
        return self

    async def __aenter__(self) -> "RayCluster":
        self.client = self.deployment.client(retries=0)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.aclose()

    def _blocks(self, trace_id: str) -> List[BlockRecord]:
        out = []
        with open(self.trace_file, encoding="utf-8") as handle:
            for line in handle:
                span = json.loads(line)
                if span["name"] != "steerspec.block" or span["trace_id"] != trace_id:
                    continue
                a = span["attributes"]
                out.append(BlockRecord(**{f: float(a.get(f"steerspec.{f}", 0.0) or 0.0)
                                          for f in BlockRecord.__annotations__}))
        return out

    async def generate(self, prompt_ids, *, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                       top_p: float = 1.0, seed: int = 0, k: int = 4, draft_top_k: int = 64,
                       mode: str = "speculative", steering: bool = False, timeout: Optional[float] = None,
                       tree: str = "", verification: str = "exact", draft_ahead: str = "",
                       ahead_outcomes: int = 0, ahead_budget_ms: float = 0.0) -> RunRecord:
        s = await self.client.acomplete(prompt_ids=list(prompt_ids), max_new_tokens=max_new_tokens,
                                        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, k=k,
                                        draft_top_k=draft_top_k, mode=mode, steering=steering, timeout=timeout,
                                        tree=tree, verification=verification, draft_ahead=draft_ahead,
                                        ahead_outcomes=ahead_outcomes, ahead_budget_ms=ahead_budget_ms)
        return RunRecord(generated=len(s.token_ids), rounds=s.rounds, drafted=s.drafted, accepted=s.accepted,
                         wall_s=s.wall_s, blocks=self._blocks(s.trace_id) if s.trace_id else [],
                         token_ids=list(s.token_ids))

    async def shutdown(self) -> None:
        await self.deployment.stop()


def _verifier_options(args) -> Dict[str, Any]:
    """VerifierConfig fields the bench sets: the KV backend, the batch window when given."""
    options: Dict[str, Any] = {"kv_backend": args.kv_backend}
    if args.batch_window_ms is not None:
        options["batch_window_ms"] = args.batch_window_ms
    return options


async def _generate(cluster, prompt, i: int, args, mode: str, tree: str = "", verification: str = "exact",
                    ahead: str = "off"):
    """Prompt i's generation in one mode (its seed `--seed` + i, so every mode draws alike)."""
    return await cluster.generate(
        prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed + i, k=args.k, draft_top_k=args.draft_top_k, mode=mode,
        steering=cluster.steering and mode == "speculative", timeout=600, tree=tree, verification=verification,
        **ahead_fields(args, ahead))


def ahead_fields(args, ahead: str) -> Dict[str, Any]:
    """The drafting-ahead fields of a request: on or off, with the bench's budget."""
    return {"draft_ahead": ahead, "ahead_outcomes": int(getattr(args, "ahead_outcomes", 0)),
            "ahead_budget_ms": float(getattr(args, "ahead_budget_ms", 0.0))}


def ahead_modes(modes: Sequence[Tuple[str, str, str, str]], setting: str) -> List[Tuple[str, str, str, str, str]]:
    """The rows with drafting ahead as `--draft-ahead` says: off or on for each, or both (`<key>_ahead` beside
    each speculative row); the verifier alone never drafts."""
    out = []
    for key, mode, tree, verification in modes:
        if mode != "speculative":
            out.append((key, mode, tree, verification, "off"))
            continue
        out.append((key, mode, tree, verification, "on" if setting == "on" else "off"))
        if setting == "both":
            out.append((f"{key}_ahead", mode, tree, verification, "on"))
    return out


async def _interleaved(cluster, prompts, args, modes: Sequence[Tuple[str, ...]]) -> Dict[str, List[Any]]:
    """Every mode (key, mode, tree, verification[, drafting ahead]) on prompt 0, then on prompt 1, ..., the order
    reversed on odd prompts, so the host's drift reaches each mode alike -> the results per key, in prompt order."""
    results: Dict[str, List[Any]] = {key: [] for key, *_ in modes}
    for i, prompt in enumerate(prompts):
        for key, mode, tree, verification, *ahead in (modes if i % 2 == 0 else modes[::-1]):
            results[key].append(await _generate(cluster, prompt, i, args, mode, tree, verification,
                                                ahead[0] if ahead else "off"))
    return results


def per_prompt_rates(results: Sequence[Any]) -> List[Optional[float]]:
    """Each generation's tokens/s, in prompt order."""
    return [round(r.generated / r.wall_s, 3) if r.wall_s > 0 else None for r in results]


def paired_speedup(rates: Sequence[Optional[float]], alone: Sequence[Optional[float]]) -> Optional[Dict[str, float]]:
    """Per prompt tokens/s (`per_prompt_rates`) over the verifier alone's on the same prompt: mean, standard error,
    count (None when no pair has both), the spread to read a speedup against."""
    ratios = [r / a for r, a in zip(rates, alone) if r is not None and a]
    if not ratios:
        return None
    se = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else 0.0
    return {"mean": round(statistics.fmean(ratios), 3), "se": round(se, 3), "n": len(ratios)}


async def _concurrent(cluster, prompts, args, sessions: int, tree: str = "",
                      mode: str = "speculative") -> Dict[str, Any]:
    """The same `max(--concurrency)` generations, `sessions` at a time (waves of `asyncio.gather`), speculative
    or the verifier alone (`mode="autoregressive"`); aggregate tokens/s = all their tokens / the waves' wall time."""
    total = max(args.concurrency_list)
    results: List[Any] = []
    start = time.perf_counter()
    for wave in range(0, total, sessions):
        results += await asyncio.gather(*[
            cluster.generate(prompts[i], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             top_k=args.top_k, top_p=args.top_p, seed=args.seed + i, k=args.k,
                             draft_top_k=args.draft_top_k, mode=mode, steering=cluster.steering, timeout=600,
                             tree=tree)
            for i in range(wave, min(total, wave + sessions))])
    return summarize_runs(results, wall_s=time.perf_counter() - start)


async def _measure(args, verifier, drafter, tokenizer_name, prompts, eos) -> Dict[str, Any]:
    rows = []
    verifier_options = _verifier_options(args)
    engine = None
    steered = steering_dir(args.drafter_dir) is not None  # an SD² drafter is measured steered everywhere
    if not args.no_engine:
        steering = maybe_steering(drafter, args.drafter_dir, device=args.device_type)
        _engine_run(verifier, drafter, prompts[:1], argparse.Namespace(**{**vars(args), "max_new_tokens": 8}), eos,
                    steering)
        engine = _engine_run(verifier, drafter, prompts[:args.prompts], args, eos, steering)
    ray_cluster = None
    if args.deployment == "ray":
        ray_cluster = RayCluster(args, tempfile.mkdtemp(prefix="steerspec-bench-"))
        await ray_cluster.start()
    try:
        for rtt in args.rtt_list:
            link = LinkModel(rtt_ms=rtt, jitter_ms=args.jitter_ms, bandwidth_mbps=args.bandwidth_mbps,
                             seed=args.seed).validate()
            if ray_cluster is not None:
                cluster_cm = ray_cluster.link(link)
            else:
                # An SD² drafter goes by its directory, so the cluster loads it with its W_s hooks and
                # gives the verifier its W_hml.
                cluster_cm = LocalCluster(verifier, str(args.drafter_dir) if steered else drafter,
                                          drafters=args.drafters, link=link, dtype=args.dtype,
                                          drafter_dtype=args.drafter_dtype,
                                          device=args.device_type,
                                          tokenizer=tokenizer_name, eos_ids=eos, verifier_options=verifier_options)
            rows.append(await _measure_rtt(cluster_cm, rtt, args, prompts, engine))
    finally:
        if ray_cluster is not None:
            await ray_cluster.shutdown()
    return {"rows": rows, "engine": engine, "steering": steered}


def _speedup(measured: Dict[str, Any], alone: Dict[str, Any]):
    """tokens/s over the verifier alone's through the same services (None when either is missing)."""
    if not (measured.get("tokens_per_s") and alone.get("tokens_per_s")):
        return None
    return round(measured["tokens_per_s"] / alone["tokens_per_s"], 3)


async def _measure_rtt(cluster_cm, rtt: float, args, prompts, engine) -> Dict[str, Any]:
    async with cluster_cm as cluster:
        await cluster.generate(prompts[0], max_new_tokens=4, k=args.k, draft_top_k=args.draft_top_k,
                               temperature=args.temperature, seed=args.seed, steering=cluster.steering)  # warm-up
        block = getattr(args, "block", False)
        modes = [("autoregressive", "autoregressive", "", "exact"), ("speculative", "speculative", "", "exact")]
        modes += [("block", "speculative", "", "block")] if block else []  # (row key, mode, tree, verification)
        if args.tree:
            modes += [("tree", "speculative", args.tree, "exact")]
            modes += [("tree_block", "speculative", args.tree, "block")] if block else []
        runs = await _interleaved(cluster, prompts[:args.prompts], args,
                                  ahead_modes(modes, getattr(args, "draft_ahead", "off")))
        rates = {key: per_prompt_rates(results) for key, results in runs.items()}  # for any paired comparison later
        row: Dict[str, Any] = {"rtt_ms": rtt}
        row.update({key: {**summarize_runs(runs[key]), "per_prompt_tokens_per_s": rates[key]} for key in runs})
        row.update(engine=engine, paired_speedup={})
        for key in list(runs)[1:]:
            row["speedup" if key == "speculative" else f"{key}_speedup"] = _speedup(row[key], row["autoregressive"])
            row["paired_speedup"][key] = paired_speedup(rates[key], rates["autoregressive"])
            if key.endswith("_ahead"):  # drafting ahead against the same row without it, prompt by prompt
                base = key[: -len("_ahead")]
                row[f"{key}_over_{base}"] = _speedup(row[key], row[base])
                row["paired_speedup"][f"{key}_over_{base}"] = paired_speedup(rates[key], rates[base])
        if rtt in args.concurrency_rtts:
            conc, alone = {}, {}
            for n in args.concurrency_list:  # the verifier alone at the same load, interleaved: like with like
                conc[str(n)] = await _concurrent(cluster, prompts, args, n)
                alone[str(n)] = await _concurrent(cluster, prompts, args, n, mode="autoregressive")
                if alone[str(n)]["tokens_per_s"]:
                    conc[str(n)]["over_verifier_alone"] = round(
                        conc[str(n)]["tokens_per_s"] / alone[str(n)]["tokens_per_s"], 3)
            row["concurrency"], row["verifier_concurrency"] = conc, alone
            low, high = min(args.concurrency_list), max(args.concurrency_list)
            if low != high and conc[str(low)]["tokens_per_s"]:
                row["concurrency_ratio"] = round(conc[str(high)]["tokens_per_s"] / conc[str(low)]["tokens_per_s"], 3)
            if args.tree:  # the same sessions drafting the tree: its blocks share packed verifier passes too
                tconc = {str(n): await _concurrent(cluster, prompts, args, n, args.tree) for n in args.concurrency_list}
                for n, c in tconc.items():
                    if alone[n]["tokens_per_s"]:
                        c["over_verifier_alone"] = round(c["tokens_per_s"] / alone[n]["tokens_per_s"], 3)
                row["tree_concurrency"] = tconc
                if low != high and tconc[str(low)]["tokens_per_s"]:
                    row["tree_concurrency_ratio"] = round(
                        tconc[str(high)]["tokens_per_s"] / tconc[str(low)]["tokens_per_s"], 3)
        _progress(row)
        return row


def _progress(row: Dict[str, Any]) -> None:
    sd, ar = row["speculative"], row["autoregressive"]
    sys.stderr.write(f"rtt {row['rtt_ms']:g} ms: speculative {sd['tokens_per_s']} tok/s, "
                     f"autoregressive {ar['tokens_per_s']} tok/s\n")


def check_targets(report: Dict[str, Any], args) -> Dict[str, Any]:
    """Overhead, bytes-up and concurrency targets, measured values alongside."""
    rows = report["rows"]
    overheads = [r["speculative"]["stage_ms"]["overhead"] for r in rows if "stage_ms" in r["speculative"]]
    worst_overhead = max(overheads) if overheads else None
    bytes_up = max((r["speculative"].get("bytes_up") or 0) for r in rows) if rows else None
    at_target_config = args.temperature == 1.0 and args.k == 8 and args.draft_top_k == 64
    targets: Dict[str, Any] = {
        "overhead_median_ms": {"measured_max_over_rtts": worst_overhead, "target_max": TARGET_OVERHEAD_MS,
                               "met": worst_overhead is not None and worst_overhead <= TARGET_OVERHEAD_MS},
        "bytes_up_per_block": {"measured_max_over_rtts": bytes_up, "target_max": TARGET_BYTES_UP,
                               "at_T1_k8_topk64": at_target_config,
                               "met": bytes_up is not None and bytes_up <= TARGET_BYTES_UP},
    }
    conc = next((r for r in rows if r["rtt_ms"] == TARGET_RTT_MS and "concurrency_ratio" in r), None)
    targets["concurrency_ratio_at_50ms"] = {
        "measured": conc["concurrency_ratio"] if conc else None,
        "sessions": [min(args.concurrency_list), max(args.concurrency_list)],
        "target_min": TARGET_CONCURRENCY_RATIO,
        "met": bool(conc and conc["concurrency_ratio"] >= TARGET_CONCURRENCY_RATIO),
    }
    return targets


# ------------------------------------------------------------------------------------ output


def _f(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_report(report: Dict[str, Any]) -> None:
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # a file or pipe: do not squeeze the table into 80 columns
    cfg = report["config"]
    table = Table(title=(f"steerspec bench remote ({cfg['deployment']}, {cfg['drafters']} drafter replica(s)) — "
                         f"{cfg['verifier']} ← {cfg['drafter']}, T={cfg['temperature']:g}, "
                         f"k={cfg['k']}, draft-top-k={cfg['draft_top_k']}, {cfg['max_new_tokens']} tokens × "
                         f"{cfg['prompts']} prompts"))
    for name, justify in (("RTT ms", "right"), ("mode", "left"), ("tok/s", "right"), ("τ", "right"),
                          ("speedup", "right"), ("B up", "right"), ("B down", "right"), ("draft", "right"),
                          ("network", "right"), ("queue", "right"), ("verify", "right"), ("overhead", "right"),
                          ("batch", "right")):
        table.add_column(name, justify=justify)
    engine = report.get("engine")
    for row in report["rows"]:
        for mode in ("autoregressive", "speculative", "speculative_ahead", "block", "block_ahead", "tree", "tree_ahead",
                     "tree_block", "tree_block_ahead"):
            if mode not in row:
                continue
            m = row[mode]
            st = m.get("stage_ms", {})
            key = {"autoregressive": None, "speculative": "speedup"}.get(mode, f"{mode}_speedup")
            speedup = 1.0 if key is None else row.get(key)
            paired = row.get("paired_speedup", {}).get(mode)
            base = mode[: -len("_ahead")] if mode.endswith("_ahead") else mode
            label = {"tree": f"tree {cfg.get('tree')}", "block": "speculative, block verify",
                     "tree_block": f"tree {cfg.get('tree')}, traversal verify"}.get(base, base)
            if base != mode:
                ahead = m.get("ahead", {})
                label += (f", ahead (hits {ahead.get('hit_rate', 0):.0%}, "
                          f"critical draft {m.get('critical_draft_ms', 0):.1f} ms)")
            table.add_row(f"{row['rtt_ms']:g}", label, _f(m["tokens_per_s"]), _f(m["block_efficiency"], 2),
                          _f(speedup, 2) + (f" (±{paired['se']:.2f})" if paired and paired["n"] > 1 else ""),
                          _f(m.get("bytes_up"), 0), _f(m.get("bytes_down"), 0),
                          *[_f(st.get(s), 2) for s in STAGES], _f(m.get("batch_size"), 2))
        if engine:
            table.add_row(f"{row['rtt_ms']:g}", "engine (in-process)", _f(engine["tokens_per_s"]),
                          _f(engine["block_efficiency"], 2), "", "", "", "", "", "", "", "", "")
        table.add_section()
    console.print(table)
    conc_rows = [r for r in report["rows"] if "concurrency" in r]
    if conc_rows:
        ctable = Table(title="aggregate tokens/s of concurrent sessions (× the verifier alone at the same load)")
        ctable.add_column("RTT ms", justify="right")
        ctable.add_column("draft", justify="left")
        sessions = list(conc_rows[0]["concurrency"].keys())
        for n in sessions:
            ctable.add_column(f"{n} session{'s' if n != '1' else ''} tok/s", justify="right")
            ctable.add_column(f"batch ({n})", justify="right")
        ctable.add_column("ratio", justify="right")
        for r in conc_rows:
            for key, label in (("verifier_concurrency", "verifier alone"), ("concurrency", f"k={cfg['k']}"),
                               ("tree_concurrency", f"tree {cfg.get('tree')}")):
                if key not in r:
                    continue
                cells = []
                for n in sessions:
                    alone = r.get("verifier_concurrency", {}).get(n, {}).get("tokens_per_s")
                    rate = r[key][n]["tokens_per_s"]
                    versus = f" ({rate / alone:.2f}×)" if key != "verifier_concurrency" and alone and rate else ""
                    cells += [_f(rate) + versus, _f(r[key][n].get("batch_size"), 2)]
                ratio = r.get(f"{key}_ratio" if key == "tree_concurrency" else "concurrency_ratio") \
                    if key != "verifier_concurrency" else None
                ctable.add_row(f"{r['rtt_ms']:g}", label, *cells, _f(ratio, 2))
        console.print(ctable)
    for name, t in report["targets"].items():
        console.print(f"target {name}: {json.dumps({k: v for k, v in t.items()})}")


def write_plot(report: Dict[str, Any], path: str) -> None:
    # lazy: matplotlib only to draw the figure
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib only to draw the figure
    import matplotlib.pyplot as plt

    rows = report["rows"]
    rtts = [r["rtt_ms"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.plot(rtts, [r["autoregressive"]["tokens_per_s"] for r in rows], "o-", label="verifier alone (AR)")
    ax1.plot(rtts, [r["speculative"]["tokens_per_s"] for r in rows], "o-", label="speculative (services)")
    if all("tree" in r for r in rows):
        ax1.plot(rtts, [r["tree"]["tokens_per_s"] for r in rows], "o-",
                 label=f"draft tree {report['config'].get('tree')} (services)")
    if report.get("engine"):
        ax1.axhline(report["engine"]["tokens_per_s"], color="gray", ls="--", label="in-process engine")
    for r in rows:
        for n, c in r.get("concurrency", {}).items():
            if n != "1":
                ax1.plot([r["rtt_ms"]], [c["tokens_per_s"]], "k^")
    ax1.set_xlabel("emulated RTT (ms)")
    ax1.set_ylabel("tokens/s (log scale)")
    ax1.set_yscale("log")
    ax1.set_title("throughput vs RTT (▲ = concurrent aggregate)")
    ax1.legend(loc="lower left")  # the upper right holds the concurrent aggregates (▲)
    bottom = [0.0] * len(rows)
    for stage in STAGES:
        values = [r["speculative"].get("stage_ms", {}).get(stage, 0.0) for r in rows]
        ax2.bar([str(x) for x in rtts], values, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax2.set_xlabel("emulated RTT (ms)")
    ax2.set_ylabel("median ms per block")
    ax2.set_title("speculative round-trip breakdown")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------ entry


def _validate(args) -> None:
    args.rtt_list = float_list(args.rtt_ms, "--rtt-ms", nonnegative=True)
    args.concurrency_list = _int_list(args.concurrency, "--concurrency")
    args.concurrency_rtts = (float_list(args.concurrency_rtt_ms, "--concurrency-rtt-ms", nonnegative=True)
                             if args.concurrency_rtt_ms is not None else list(args.rtt_list))
    if args.prompts < 1:
        raise UsageError("--prompts must be >= 1")
    if args.drafters < 1:
        raise UsageError("--drafters must be >= 1")
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be >= 1")
    if not (1 <= args.k <= 64):
        raise UsageError("--k must be in [1, 64]")
    if args.draft_top_k < 0:
        raise UsageError("--draft-top-k must be >= 0 (0 = full vocabulary)")
    if not (args.temperature >= 0):
        raise UsageError("--temperature must be >= 0")
    if args.tree is not None:
        try:
            args.tree = parse_tree(args.tree).spec()
        except ValueError as exc:
            raise UsageError(f"--tree: {exc}") from None
    if args.out and not Path(args.out).resolve().parent.is_dir():
        raise UsageError(f"--out: directory {Path(args.out).resolve().parent} does not exist")
    if args.plot and not Path(args.plot).resolve().parent.is_dir():
        raise UsageError(f"--plot: directory {Path(args.plot).resolve().parent} does not exist")


def run(args: argparse.Namespace) -> int:
    invoked = command_line("steerspec bench remote", args)  # before validation adds its derived keys
    _validate(args)


    device = resolve_device(args.device)  # bad or missing devices: one line, exit 2, before any loading
    args.device_type = device.type

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    verifier_dir, drafter_dir = resolve_model_dir(args.verifier), resolve_model_dir(args.drafter)
    args.verifier_dir, args.drafter_dir = verifier_dir, drafter_dir
    tokenizer, eos = load_tokenizer_and_eos(str(verifier_dir))
    prompts = _prompts(args, tokenizer)

    args.dtype, args.invariant = resolve_path(args.dtype, getattr(args, "invariant", None), verifier_dir, device)
    args.drafter_dtype = drafter_dtype_of(args)  # resolved once: the engine row and the services load the same
    verifier = load_model(verifier_dir, dtype=args.dtype, device=device)
    apply_invariance(verifier, args.invariant or "off")  # the services share this model, and its plan
    drafter = load_model(drafter_dir, dtype=args.drafter_dtype, device=device)
    started = time.time()
    measured = asyncio.run(_measure(args, verifier, drafter, str(verifier_dir), prompts, eos))
    report: Dict[str, Any] = {
        "command": invoked,
        "config": {"verifier": args.verifier, "drafter": args.drafter, "deployment": args.deployment,
                   "drafters": args.drafters, "device": str(device), "dtype": args.dtype,
                   "invariant": args.invariant, "drafter_dtype": args.drafter_dtype,
                   "rtt_ms": args.rtt_list,
                   "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "k": args.k,
                   "draft_top_k": args.draft_top_k, "temperature": args.temperature, "top_k": args.top_k,
                   "top_p": args.top_p, "concurrency": args.concurrency_list,
                   "concurrency_rtt_ms": args.concurrency_rtts, "jitter_ms": args.jitter_ms,
                   "bandwidth_mbps": args.bandwidth_mbps, "seed": args.seed, "steering": measured["steering"],
                   "kv_backend": args.kv_backend, "tree": args.tree, "block": bool(getattr(args, "block", False)),
                   "draft_ahead": args.draft_ahead, "ahead_outcomes": args.ahead_outcomes,
                   "ahead_budget_ms": args.ahead_budget_ms},
        "machine": {**host_info(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                    "grpc_experiments": os.environ.get("GRPC_EXPERIMENTS", "")},  # the TCP transport (grpc_env)
        "elapsed_s": None,
        **measured,
    }
    report["targets"] = check_targets(report, args)
    report["elapsed_s"] = round(time.time() - started, 1)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        write_plot(report, args.plot)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0

"""`steerspec bench policies`: draft-length policies in-process and through the services at emulated RTTs.

Per eval set, temperature, regime (in-process engine; services over the emulated link at each
--rtt-ms) and policy: tokens/s, block efficiency τ, acceptance, drafter and verifier forward
passes per 100 generated tokens, wall ms per token. Policies with an initial k (fixed, heuristic,
gammatune, gammatune+) run at every --initial-k; the others run once. Prints

1. GammaTune's Table 2 layout: speedup in tokens/s over SpecDecode (fixed), each policy's mean over
   initial k ± the standard deviation across initial k, normalised by SpecDecode's mean tokens/s;
2. Pacer's Tables 1/6 layout: tokens/s, speedup over the verifier alone, τ, drafter and verifier
   forward passes per 100 tokens, for fixed at its best k in the same run and every adaptive
   policy (at its best initial k where it has one);
3. the draft-length issue's targets, met or missed, per set, temperature and regime (`check_targets`);

writes the JSON (--out) and a PNG of tokens/s against RTT, one line per policy (--plot).
Drafter forward passes = drafted tokens (one drafter step each); verifier passes = blocks.
An SD² drafter (steering weights beside it) is steered in every regime, as `steerspec run` steers it.
Within a regime the configurations are interleaved prompt by prompt (rotating order), so a drift in
the host's speed over the minutes a regime takes hits every row alike. The report is rewritten after
every regime: --resume continues it, --include joins the reports of a run split across processes or
machines (same settings), --markdown prints the tables ready for a README.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from coordinator.cli import load_tokenizer_and_eos
from coordinator.local import LocalCluster
from steerspec.data.evalsets import SETS, load_eval_set
from steerspec.decoding.engine import DecodeConfig, autoregressive_generate, speculative_generate
from steerspec.decoding.sampling import SamplingParams
from steerspec.decoding.tree_decoding import tree_generate
from steerspec.decoding.trees import parse_tree
from steerspec.errors import UsageError, float_list
from steerspec.models import cached_lm, load_model
from steerspec.models.checkpoints import resolve_model_dir
from steerspec.policies import PolicyContext, PolicyError, make_policy, parse_spec, split_specs
from steerspec.serving.linkemu import LinkModel
from steerspec.steering.io import has_steering
from steerspec.steering.runtime import maybe_steering

HAS_INITIAL_K = {"fixed": "k", "heuristic": "k", "gammatune": "k", "gammatune+": "k"}
TREE_PREFIX = "tree:"  # a configuration that drafts a static tree (--trees) instead of following a policy
DEFAULT_POLICIES = "fixed,heuristic,threshold,adaedl,specdecpp,gammatune,gammatune+,pacer,latency"
PAPER_KS = "1,2,3,4,5,6,7,8,12,16,20,24"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier", default="verifier", help="verifier checkpoint dir or bundled name")
    parser.add_argument("--drafter", default="pretrained", help="drafter checkpoint dir or bundled name")
    parser.add_argument("--policies", default=DEFAULT_POLICIES,
                        help="comma-separated policy specs; ';' separates specs that contain commas")
    parser.add_argument("--initial-k", default=PAPER_KS, help="initial k for policies that have one")
    parser.add_argument("--trees", default="",
                        help="draft trees to run beside the policies, ';'-separated rank paths or 'default' (rows of "
                             "policy 'tree': exact, no draft length to choose)")
    parser.add_argument("--verification", default="exact", choices=("exact", "block"),
                        help="the lossless acceptance rule of every speculative run: exact (token-wise; trees by "
                             "recursive rejection sampling) or block (block verification; trees by traversal)")
    parser.add_argument("--sets", default="indist,tests,docs", help="eval sets")
    parser.add_argument("--rtt-ms", default="0,10,50,100", help="emulated RTTs through the services ('' = none)")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per eval set")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--draft-top-k", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-inprocess", action="store_true", help="skip the in-process regime")
    parser.add_argument("--quick", action="store_true",
                        help="minutes: 4 prompts x 32 tokens, indist, initial k 2,6,12, T=0, RTT 0,50")
    parser.add_argument("--out", default=None, help="JSON report path (rewritten after every regime)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the regimes --out already holds (same settings) and measure only the rest")
    parser.add_argument("--plot", default=None, help="PNG: tokens/s against RTT per policy")
    parser.add_argument("--json", action="store_true", help="print the JSON report instead of tables")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    parser.add_argument("--include", default="",
                        help="comma-separated reports of the same settings (a run split across processes or "
                             "machines): their regimes count as measured and their rows join the report")


def _validate(args) -> None:
    if args.quick:  # flags left at their defaults shrink; flags given explicitly stay
        args.prompts, args.max_new_tokens = min(args.prompts, 4), min(args.max_new_tokens, 32)
        for flag, full, quick in (("sets", "indist,tests,docs", "indist"), ("initial_k", PAPER_KS, "2,6,12"),
                                  ("temperatures", "0,1", "0"), ("rtt_ms", "0,10,50,100", "0,50")):
            if getattr(args, flag) == full:
                setattr(args, flag, quick)
    args.k_list = [int(k) for k in float_list(args.initial_k, "--initial-k")]
    if not args.k_list or any(not 1 <= k <= 64 for k in args.k_list):
        raise UsageError(f"--initial-k values must be in [1, 64], got '{args.initial_k}'")
    args.rtt_list = float_list(args.rtt_ms, "--rtt-ms")
    args.temp_list = float_list(args.temperatures, "--temperatures")
    if any(r < 0 for r in args.rtt_list) or any(t < 0 for t in args.temp_list):
        raise UsageError("--rtt-ms and --temperatures must be >= 0")
    args.set_list = [s.strip() for s in args.sets.split(",") if s.strip()]

    bad = [s for s in args.set_list if s not in SETS]
    if bad or not args.set_list:
        raise UsageError(f"--sets must name eval sets among {', '.join(SETS)}, got '{args.sets}'")
    if args.prompts < 1 or args.max_new_tokens < 2:
        raise UsageError("--prompts must be >= 1 and --max-new-tokens >= 2")

    args.policy_list = split_specs(args.policies)
    try:
        args.tree_list = [parse_tree(t).spec() for t in args.trees.split(";") if t.strip()]
    except ValueError as exc:
        raise UsageError(f"--trees: {exc}") from None

    for spec in args.policy_list:
        try:
            parse_spec(spec)
        except PolicyError as exc:
            raise UsageError(str(exc)) from None


def expand(spec: str, ks: Sequence[int]) -> List[tuple]:
    """(initial k or None, full spec) for each run of a policy spec."""
    name, _, rest = spec.partition(":")
    key = HAS_INITIAL_K.get(name)
    if key is None or f"{key}=" in rest:
        return [(None, spec)]
    return [(k, f"{name}:{key}={k}" + (f",{rest}" if rest else "")) for k in ks]


def summarize(results: Sequence[Any], wall_s: float, walls: Optional[Sequence[float]] = None) -> Dict[str, Any]:
    """tokens/s, τ, acceptance, passes per 100 tokens, ms per token and the draft length of every block
    (histogram, mean, std: a policy that mixes lengths shows here) of a list of results (and each
    prompt's tokens/s when given each result's wall seconds)."""
    tokens = sum(r.generated for r in results)
    lengths = [n for r in results for n in r.block_drafted]
    hist = {str(n): c for n, c in sorted(Counter(lengths).items())}
    rounds = sum(r.rounds for r in results)
    drafted = sum(r.drafted for r in results)
    accepted = sum(r.accepted for r in results)
    return {"tokens": tokens, "wall_s": round(wall_s, 4),
            "tokens_per_s": round(tokens / wall_s, 3) if wall_s > 0 else None,
            "block_efficiency": round(tokens / rounds, 4) if rounds else None,
            "acceptance": round(accepted / drafted, 4) if drafted else None,
            "drafter_calls": drafted, "verifier_calls": rounds,
            "drafter_per_100": round(100 * drafted / tokens, 2) if tokens else None,
            "verifier_per_100": round(100 * rounds / tokens, 2) if tokens else None,
            "ms_per_token": round(1e3 * wall_s / tokens, 3) if tokens else None,
            "draft_length_hist": hist,
            "draft_length_mean": round(statistics.mean(lengths), 3) if lengths else None,
            "draft_length_sd": round(statistics.pstdev(lengths), 3) if lengths else None,
            "per_prompt_tokens_per_s": None if walls is None else
            [round(r.generated / w, 3) if w > 0 else None for r, w in zip(results, walls)]}


def _config(args, temperature: float, i: int, eos):
    return DecodeConfig(max_new_tokens=args.max_new_tokens, draft_top_k=args.draft_top_k, seed=args.seed + i,
                        sampling=SamplingParams(temperature), eos_token_ids=eos,
                        acceptance="block" if args.verification == "block" else "token")


def run_inprocess(v, d, prompt, i: int, args, temperature, policy, eos, steering=None, tree: Optional[str] = None):
    """One prompt under one policy (None = the verifier alone) or draft tree, in-process (an SD² drafter
    steered by `steering`); returns (result, wall seconds)."""
    config = _config(args, temperature, i, eos)
    start = time.perf_counter()
    if tree is not None:
        result = tree_generate(v, d, prompt, config, tree, steering=steering)
    elif policy is None:
        result = autoregressive_generate(v, prompt, config)
    else:
        result = speculative_generate(v, d, prompt, config, policy, steering=steering)
    return result, time.perf_counter() - start


async def run_services(cluster, prompt, i: int, args, temperature, spec: Optional[str]):
    """One prompt under one policy (None = the verifier alone; `tree:SPEC` a draft tree) through the
    services; (result, wall s)."""
    tree = spec[len(TREE_PREFIX):] if spec and spec.startswith(TREE_PREFIX) else ""
    result = await cluster.generate(
        prompt, max_new_tokens=args.max_new_tokens, temperature=temperature, seed=args.seed + i, k=64,
        draft_top_k=args.draft_top_k, mode="speculative" if spec else "autoregressive",
        policy="fixed" if (tree or not spec) else spec, steering=cluster.steering and spec is not None, timeout=600,
        tree=tree, verification=args.verification if spec else "exact")
    return result, result.wall_s


def rotated(items: Sequence[Any], i: int) -> List[Any]:
    """`items` starting at position i (mod len): each prompt runs the configurations in another order."""
    shift = i % len(items) if items else 0
    return list(items[shift:]) + list(items[:shift])


def _runs(args) -> List[tuple]:
    runs = [(spec.partition(":")[0], k, full) for spec in args.policy_list for k, full in expand(spec, args.k_list)]
    return runs + [("tree", None, TREE_PREFIX + tree) for tree in getattr(args, "tree_list", [])]


def _record(rows, **row) -> None:
    rows.append(row)

    m = row["metrics"]
    print(f"[{row['set']} T={row['temperature']:g} {row['regime']}] {row['spec'] or 'verifier alone'}: "
          f"{m['tokens_per_s']} tok/s, τ={m['block_efficiency']}", file=sys.stderr, flush=True)


def cell(row: Dict[str, Any]) -> tuple:
    """The unit a run measures in one interleaved pass, and the unit --resume keeps or redoes."""
    return (row["set"], float(row["temperature"]), row["regime"])


def regime_name(rtt_ms: Optional[float]) -> str:
    """A regime's name in rows and cells: `inprocess` (no RTT), else `rtt<ms>` through the services."""
    return "inprocess" if rtt_ms is None else f"rtt{rtt_ms:g}"


def planned(config: Dict[str, Any]) -> set:
    """Every cell a run with this config measures."""
    rtts = ([None] if config["inprocess"] else []) + list(config["rtt_ms"])
    regimes = [regime_name(rtt) for rtt in rtts]
    return {(s, float(t), g) for s in config["sets"] for t in config["temperatures"] for g in regimes}


async def measure(args, verifier, drafter, tokenizer_dir: str, tokenizer, eos,
                  rows: Optional[List[Dict[str, Any]]] = None, saved=None) -> List[Dict[str, Any]]:
    """Every configuration (the verifier alone, then each policy at each initial k) per regime. The
    configurations are interleaved prompt by prompt, in a rotating order, so the host's drift over the
    minutes a regime takes hits them alike; each sums its own generations' wall time. Regimes already
    in `rows` (a resumed run) are skipped; `saved(rows)` is called after each regime."""
    context = PolicyContext(drafter_dir=getattr(drafter, "name_or_path", None) or None,
                            hidden_size=int(drafter.config.hidden_size))
    v, d = cached_lm(verifier), cached_lm(drafter)
    steering = maybe_steering(d, context.drafter_dir, device=d.device)
    rows = [] if rows is None else rows
    done = {cell(r) for r in rows}
    configs = [("verifier", None, None)] + _runs(args)

    async def regime(prompts, run_one, record) -> None:
        results: List[list] = [[] for _ in configs]
        walls: List[List[float]] = [[] for _ in configs]
        for i, prompt in enumerate(prompts):
            for c in rotated(range(len(configs)), i):
                result, wall = await run_one(prompt, i, configs[c][2])
                results[c].append(result)
                walls[c].append(wall)
        for (name, k, spec), res, wall in zip(configs, results, walls):
            record(policy=name, initial_k=k, spec=spec, metrics=summarize(res, sum(wall), wall))
        if saved is not None:
            saved(rows)

    for set_name in args.set_list:
        texts = [row["prompt"] for row in load_eval_set(set_name)][: args.prompts]
        prompts = [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        for temperature in args.temp_list:
            common = {"set": set_name, "temperature": temperature}
            if not args.no_inprocess and (set_name, float(temperature), regime_name(None)) not in done:
                # one policy object per configuration, kept across prompts (each sequence resets it)
                policies = {spec: make_policy(spec, context) for _, _, spec in configs
                            if spec and not spec.startswith(TREE_PREFIX)}

                async def inprocess(prompt, i, spec):
                    tree = spec[len(TREE_PREFIX):] if spec and spec.startswith(TREE_PREFIX) else None
                    return run_inprocess(v, d, prompt, i, args, temperature, policies.get(spec), eos, steering, tree)

                run_inprocess(v, d, prompts[0], 0, args, temperature, make_policy("fixed:k=4"), eos, steering)  # warm-up
                await regime(prompts, inprocess, lambda **row: _record(rows, **common, regime=regime_name(None), **row))
            for rtt in args.rtt_list:
                if (set_name, float(temperature), regime_name(rtt)) in done:
                    continue
                link = LinkModel(rtt_ms=rtt, seed=args.seed).validate()
                # an SD² drafter goes by its directory: the cluster then loads it with its W_s hooks
                served = context.drafter_dir if steering is not None else drafter
                async with LocalCluster(verifier, served, link=link, tokenizer=tokenizer_dir, eos_ids=eos) as cluster:
                    async def services(prompt, i, spec, cluster=cluster):
                        return await run_services(cluster, prompt, i, args, temperature, spec)

                    warm = argparse.Namespace(**{**vars(args), "max_new_tokens": 4})
                    await run_services(cluster, prompts[0], 0, warm, temperature, "fixed:k=4")  # warm-up
                    await regime(prompts, services, lambda rtt=rtt, **row: _record(rows, **common, regime=regime_name(rtt),
                                                                          rtt_ms=rtt, **row))
    return rows


def _groups(rows):
    """{(set, T, regime): {policy: [rows]}} plus the verifier-alone row."""
    out: Dict[tuple, Dict[str, List[Dict[str, Any]]]] = {}
    for row in rows:
        out.setdefault((row["set"], row["temperature"], row["regime"]), {}).setdefault(row["policy"], []).append(row)
    return out


def table_gammatune(rows) -> List[Dict[str, Any]]:
    """GammaTune Table 2: per (set, T, regime, policy) mean ± std over initial k of tokens/s ÷ mean SpecDecode tokens/s."""
    out = []
    for (set_name, temp, regime), policies in _groups(rows).items():
        fixed = [r["metrics"]["tokens_per_s"] for r in policies.get("fixed", []) if r["metrics"]["tokens_per_s"]]
        if not fixed:
            continue
        base = statistics.mean(fixed)
        for policy, prs in policies.items():
            if policy == "verifier":
                continue
            ratios = [r["metrics"]["tokens_per_s"] / base for r in prs if r["metrics"]["tokens_per_s"]]
            out.append({"set": set_name, "temperature": temp, "regime": regime, "policy": policy,
                        "speedup_mean": round(statistics.mean(ratios), 3),
                        "speedup_std": round(statistics.pstdev(ratios), 3) if len(ratios) > 1 else None,
                        "runs": len(ratios)})
    return out


def check_targets(report: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The draft-length issue's targets, per (set, T, regime) measured: GammaTune and GammaTune+ at ≥ 1.10×
    SpecDecode over initial k with at most half its spread across k; Pacer ≥ +5% over the best fixed k on
    `indist` in process and at RTT 50 (per prompt); `latency` at least the best fixed k within the spread
    (per-prompt mean + one standard error ≥ 1) everywhere, and above GammaTune (Table 2) at RTT 50 and 100."""
    table2 = {(r["set"], r["temperature"], r["regime"], r["policy"]): r for r in report["gammatune_table"]}
    versus = {(r["set"], r["temperature"], r["regime"], r["policy"]): r.get("vs_best_fixed")
              for r in report["pacer_table"]}
    out: List[Dict[str, Any]] = []

    def add(key, target: str, ok: bool, detail: str) -> None:
        out.append({"set": key[0], "temperature": key[1], "regime": key[2], "target": target, "pass": bool(ok),
                    "detail": detail})

    for key in dict.fromkeys(k[:3] for k in table2):
        fixed = table2.get((*key, "fixed"))
        for name in ("gammatune", "gammatune+"):
            r = table2.get((*key, name))
            if fixed is not None and r is not None and r["speedup_std"] is not None:
                spread = fixed["speedup_std"] or 0.0
                add(key, f"{name} ≥ 1.10× SpecDecode, std ≤ half of its",
                    r["speedup_mean"] >= 1.10 and r["speedup_std"] <= 0.5 * spread,
                    f"{r['speedup_mean']:.2f} ± {r['speedup_std']:.2f} against ± {spread:.2f}")
        v = versus.get((*key, "pacer"))
        if v and key[0] == "indist" and key[2] in ("inprocess", "rtt50"):
            add(key, "pacer ≥ +5% over the best fixed k", v["mean"] >= 1.05, f"{v['mean']:.2f} ± {v['se']:.2f}")
        v = versus.get((*key, "latency"))
        if v:
            add(key, "latency ≥ the best fixed k within the spread", v["mean"] + v["se"] >= 1.0,
                f"{v['mean']:.2f} ± {v['se']:.2f} per prompt")
        lat, gt = table2.get((*key, "latency")), table2.get((*key, "gammatune"))
        if lat is not None and gt is not None and key[2] in ("rtt50", "rtt100"):
            add(key, "latency above GammaTune", lat["speedup_mean"] > gt["speedup_mean"],
                f"{lat['speedup_mean']:.2f} against {gt['speedup_mean']:.2f}")
    return out


def paired(rates: Optional[Sequence[Optional[float]]], base: Optional[Sequence[Optional[float]]]
           ) -> Optional[Dict[str, float]]:
    """Per-prompt ratios rates[i] / base[i] (the same prompt, interleaved): mean, std across prompts
    and the standard error of the mean; None without two or more pairs."""
    pairs = [a / b for a, b in zip(rates or [], base or []) if a and b]
    if len(pairs) < 2:
        return None
    sd = statistics.stdev(pairs)
    return {"mean": round(statistics.mean(pairs), 4), "sd": round(sd, 4),
            "se": round(sd / len(pairs) ** 0.5, 4), "prompts": len(pairs)}


def table_pacer(rows) -> List[Dict[str, Any]]:
    """Pacer Tables 1/6: best-k fixed and each policy at its best initial k, vs the verifier alone,
    and per prompt against the best fixed k (`vs_best_fixed`: the spread a claim must clear)."""
    out = []
    for (set_name, temp, regime), policies in _groups(rows).items():
        alone = policies.get("verifier", [{}])[0].get("metrics", {}).get("tokens_per_s")
        fixed = max(policies.get("fixed", []), key=lambda r: r["metrics"]["tokens_per_s"] or 0, default=None)
        for policy, prs in policies.items():
            if policy == "verifier":
                continue
            best = max(prs, key=lambda r: r["metrics"]["tokens_per_s"] or 0)
            m = best["metrics"]
            versus = None if fixed is None or policy == "fixed" else paired(
                m.get("per_prompt_tokens_per_s"), fixed["metrics"].get("per_prompt_tokens_per_s"))
            out.append({"set": set_name, "temperature": temp, "regime": regime, "policy": policy,
                        "spec": best["spec"], "tokens_per_s": m["tokens_per_s"],
                        "speedup_vs_verifier": round(m["tokens_per_s"] / alone, 3) if alone else None,
                        "tau": m["block_efficiency"], "acceptance": m["acceptance"],
                        "drafter_per_100": m["drafter_per_100"], "verifier_per_100": m["verifier_per_100"],
                        "ms_per_token": m["ms_per_token"], "vs_best_fixed": versus,
                        "draft_length_mean": m.get("draft_length_mean"), "draft_length_sd": m.get("draft_length_sd")})
    return out


def _row(cells: Sequence[str], widths: Sequence[int], markdown: bool, left: Sequence[int] = (0,)) -> str:
    """One table line: Markdown (`| a | b |`) or fixed-width text (the `left` columns left-aligned)."""
    if markdown:
        return "| " + " | ".join(c.strip() for c in cells) + " |"
    return "".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))


def _head(cells: Sequence[str], widths: Sequence[int], markdown: bool, left: Sequence[int] = (0,)) -> List[str]:
    lines = [_row(cells, widths, markdown, left)]
    return lines + (["|" + "---|" * len(cells)] if markdown else [])


def print_tables(report, markdown: bool = False) -> None:
    """Both tables, as aligned text or (`markdown`) as Markdown tables ready for a README."""
    regimes = []
    for row in report["gammatune_table"]:
        if row["regime"] not in regimes:
            regimes.append(row["regime"])
    print("GammaTune Table 2 layout: tokens/s ÷ SpecDecode's mean over initial k (mean ± std across initial k; "
          "'once' = no initial k)")
    keyed = {(r["set"], r["temperature"], r["regime"], r["policy"]): r for r in report["gammatune_table"]}
    widths = [12] + [16] * len(regimes)
    for set_name in report["config"]["sets"]:
        for temp in report["config"]["temperatures"]:
            print(f"\n{'**' if markdown else ''}{set_name}, T={temp:g}{'**' if markdown else ''}\n")
            print("\n".join(_head(["policy", *regimes], widths, markdown)))
            for policy in report["config"]["policy_names"]:
                cells = [policy]
                for g in regimes:
                    r = keyed.get((set_name, temp, g, policy))
                    if r is None:
                        cells.append("-")
                    elif r["speedup_std"] is None:
                        cells.append(f"{r['speedup_mean']:.2f} once")
                    else:
                        cells.append(f"{r['speedup_mean']:.2f} ± {r['speedup_std']:.2f}")
                print(_row(cells, widths, markdown))
    print("\nPacer Tables 1/6 layout (best initial k where a policy has one; ×fixed/prompt: tokens/s over the "
          "best fixed k's on the same prompt, mean ± standard error over prompts)\n")
    names = ["set", "T", "regime", "policy", "tok/s", "×AR", "τ", "acc", "D/100", "V/100", "k/block", "ms/tok",
             "×fixed/prompt", "spec"]
    widths, left = [7, 3, 11, 12, 8, 7, 7, 7, 8, 8, 12, 8, 16, 0], (0, 2, 3, 13)
    names[2], names[-1] = " regime", "  spec"
    print("\n".join(_head(names, widths, markdown, left)))
    for r in report["pacer_table"]:
        cells = [r["set"], f"{r['temperature']:g}", r["regime"], r["policy"], f"{r['tokens_per_s']:.1f}",
                 f"{(r['speedup_vs_verifier'] or 0):.2f}", f"{(r['tau'] or 0):.2f}", f"{(r['acceptance'] or 0):.2f}",
                 f"{(r['drafter_per_100'] or 0):.1f}", f"{(r['verifier_per_100'] or 0):.1f}", _length(r),
                 f"{(r['ms_per_token'] or 0):.2f}", _versus(r.get("vs_best_fixed")), f"  {r['spec']}"]
        cells[2] = " " + cells[2]
        print(_row(cells, widths, markdown, left))
    targets = report.get("targets") or check_targets(report)
    if targets:
        print("\nTargets (the draft-length issue's, per set, T and regime measured)\n")
        widths, left = [7, 3, 11, 52, 7, 0], (0, 2, 3, 5)
        print("\n".join(_head(["set", "T", " regime", "target", "", "  measured"], widths, markdown, left)))
        for t in targets:
            print(_row([t["set"], f"{t['temperature']:g}", " " + t["regime"], t["target"],
                        "met" if t["pass"] else "missed", "  " + t["detail"]], widths, markdown, left))


def _length(row: Dict[str, Any]) -> str:
    """Draft length per block, 'mean ± std' ('-' for the verifier alone or a report made before it was kept)."""
    if row.get("draft_length_mean") is None:
        return "-"
    return f"{row['draft_length_mean']:.2f} ± {row['draft_length_sd']:.2f}"


def _versus(v: Optional[Dict[str, float]]) -> str:
    """'1.02 ± 0.01' (mean ± standard error over prompts) or '-'."""
    return "-" if not v else f"{v['mean']:.2f} ± {v['se']:.2f}"


def write_plot(report, path: str) -> None:
    """tokens/s (best initial k) against RTT, one line per policy, one panel per (set, T)."""
    # lazy: matplotlib only to draw the figure
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib only to draw the figure
    import matplotlib.pyplot as plt

    rows = [r for r in report["pacer_table"] if r["regime"].startswith("rtt")]
    panels = sorted({(r["set"], r["temperature"]) for r in rows})
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (set_name, temp) in zip(axes[0], panels):
        for policy in report["config"]["policy_names"] + ["verifier"]:
            pts = sorted((float(r["regime"][3:]), r["tokens_per_s"]) for r in rows
                         if r["set"] == set_name and r["temperature"] == temp and r["policy"] == policy)
            if policy == "verifier":
                pts = sorted((row["rtt_ms"], row["metrics"]["tokens_per_s"]) for row in report["rows"]
                             if row["policy"] == "verifier" and row.get("rtt_ms") is not None
                             and row["set"] == set_name and row["temperature"] == temp)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                        linestyle="--" if policy == "verifier" else "-", label=policy)
        ax.set_xlabel("emulated RTT (ms)")
        ax.set_ylabel("tokens/s (best initial k)")
        ax.set_title(f"{set_name}, T={temp:g}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


RESUME_KEYS = ("verifier", "drafter", "policies", "initial_k", "prompts", "max_new_tokens", "draft_top_k", "seed",
               "steered")


def _earlier(path: Path, config: Dict[str, Any], flag: str) -> Dict[str, Any]:
    """A report measured with this run's settings, its rows cut to this run's sets, temperatures and
    regimes; refuses one written with other settings, whose rows would not compare with the new ones."""
    try:
        prior = json.loads(path.read_text())
        old = prior["config"]
        wanted = planned(config)
        prior["rows"] = [r for r in prior["rows"] if cell(r) in wanted]
    except OSError as exc:
        raise UsageError(f"{flag}: cannot read {path} ({exc.strerror})") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{flag}: {path} is not a `bench policies` report ({exc}); pick another") from None

    def same(key: str) -> bool:  # models by directory name: another checkout or machine has other paths
        if key in ("verifier", "drafter"):
            return Path(str(old.get(key))).name == Path(str(config[key])).name
        return old.get(key) == config[key]

    differ = [k for k in RESUME_KEYS if not same(k)]
    if differ:
        raise UsageError(f"{flag}: {path} was measured with other settings ({', '.join(differ)}); "
                         "use the same flags or another file")
    return prior


def resumed(args: argparse.Namespace, config: Dict[str, Any]) -> Dict[str, Any]:
    """The rows measured already: --out's with --resume (none when it does not exist yet), then those of
    every --include report for the regimes still missing. {} when there are none."""
    prior: Dict[str, Any] = {}
    if args.resume:
        if not args.out:
            raise UsageError("--resume needs --out (the report to continue)")
        if Path(args.out).exists():
            prior = _earlier(Path(args.out), config, "--resume")
    for path in [p.strip() for p in args.include.split(",") if p.strip()]:
        other = _earlier(Path(path), config, "--include")
        have = {cell(r) for r in prior.get("rows", [])}
        prior.setdefault("rows", []).extend(r for r in other["rows"] if cell(r) not in have)
        prior["elapsed_s"] = float(prior.get("elapsed_s", 0.0)) + float(other.get("elapsed_s", 0.0))
    return prior


def run(args: argparse.Namespace) -> int:
    _validate(args)


    torch.set_num_threads(max(1, args.threads))
    vdir, ddir = resolve_model_dir(args.verifier), resolve_model_dir(args.drafter)
    tokenizer, eos = load_tokenizer_and_eos(str(vdir))
    verifier, drafter = load_model(vdir), load_model(ddir)

    for spec in args.policy_list:  # trained policies without a head: one line before any timing
        try:
            make_policy(expand(spec, args.k_list)[0][1], PolicyContext(drafter_dir=str(ddir),
                                                                       hidden_size=int(drafter.config.hidden_size)))
        except PolicyError as exc:
            raise UsageError(str(exc)) from None
    names = list(dict.fromkeys(spec.partition(":")[0] for spec in args.policy_list)) + (["tree"] if args.tree_list else [])
    command = ("steerspec bench policies" + (" --quick" if args.quick else "") +
               f" --verifier {args.verifier} --drafter {args.drafter} --policies '{args.policies}'"
               f" --initial-k {args.initial_k} --sets {args.sets} --rtt-ms '{args.rtt_ms}' --temperatures {args.temperatures}"
               f" --prompts {args.prompts} --max-new-tokens {args.max_new_tokens} --seed {args.seed}" +
               (f" --trees '{args.trees}'" if args.tree_list else "") +
               (f" --verification {args.verification}" if args.verification != "exact" else ""))
    config = {"verifier": str(vdir), "drafter": str(ddir), "sets": args.set_list,
              "temperatures": args.temp_list, "rtt_ms": args.rtt_list, "initial_k": args.k_list,
              "policies": args.policy_list, "policy_names": names, "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, "draft_top_k": args.draft_top_k, "seed": args.seed,
              "inprocess": not args.no_inprocess, "steered": has_steering(ddir),
              **({"trees": args.tree_list} if args.tree_list else {}),  # absent by default: older reports resume
              **({"verification": args.verification} if args.verification != "exact" else {})}
    prior = resumed(args, config)
    rows, earlier_s = prior.get("rows", []), float(prior.get("elapsed_s", 0.0))
    started = time.time()

    def report_of(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
        report = {"command": command + (" --resume" if args.resume else "") +
                  (f" --include {args.include}" if args.include else ""), "config": config,
                  "machine": {"platform": platform.platform(), "torch": torch.__version__,
                              "torch_threads": torch.get_num_threads()},
                  "rows": rows, "gammatune_table": table_gammatune(rows), "pacer_table": table_pacer(rows),
                  "elapsed_s": round(earlier_s + time.time() - started, 1)}
        report["targets"] = check_targets(report)
        return report

    def save(report: Dict[str, Any]) -> None:
        if args.out:  # after every regime: an interrupted run loses at most the regime in progress
            tmp = Path(args.out + ".tmp")
            tmp.write_text(json.dumps(report, indent=2) + "\n")
            tmp.replace(args.out)

    rows = asyncio.run(measure(args, verifier, drafter, str(vdir), tokenizer, eos, rows,
                               lambda rows: save(report_of(rows))))
    report = report_of(rows)
    save(report)
    if args.plot:
        write_plot(report, args.plot)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_tables(report, markdown=args.markdown)
    return 0

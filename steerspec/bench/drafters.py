"""Pretrained vs distilled vs SD² drafters on the bundled eval sets (the SD² paper's Table 1 layout).

For each eval set and drafter: block efficiency τ at T=1 (mean ± sample std over the seeds, τ of a
seed = generated tokens / verify rounds over all its prompts), τ at T=0, and the speedup in
tokens/s over the first drafter (the pretrained one) measured in the same run; generations are
interleaved prompt by prompt so machine load hits every drafter alike. Also reported: accepted
tokens per block (τ − 1) and their gains, drafting time per block, what the steering adds to it
(a controlled measurement on the SD² drafter with and without its steering), and the steering
bytes per verify reply. Then the same drafters through the services (verifier, drafter and
coordinator servers in this process, `coordinator.local.LocalCluster`) over an emulated link
(`--services-rtt-ms`, default 50 ms): tokens/s, τ, speedup over the first drafter and bytes per
verify reply on the first `--services-prompts` prompts of each set at T=1 with the first seed;
`--no-services` skips it. Prints a table, writes JSON and a bar chart (PNG) of accepted tokens per
block.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from tqdm.auto import tqdm

from coordinator.local import LocalCluster
from steerspec.bench.remote import summarize_runs
from steerspec.cli.run import add_device_arguments, drafter_dtype_of
from steerspec.data.evalsets import assets_dir
from steerspec.decoding.engine import DecodeConfig, draft_block, prefill, speculative_generate
from steerspec.decoding.sampling import SamplingParams
from steerspec.errors import UsageError
from steerspec.models.backends import as_cached
from steerspec.models.checkpoints import ALIASES, BUNDLED_NAMES, resolve_model_dir
from steerspec.models.kv import CachedLM
from steerspec.models.dtype_choice import resolve_path
from steerspec.models.kernel_path import apply_invariance
from steerspec.models.loading import context_length, eos_token_ids, load_model, load_tokenizer, resolve_device
from steerspec.observability.run_record import command_line
from steerspec.policies.fixed import FixedK
from steerspec.serving.linkemu import LinkModel
from steerspec.steering import has_steering
from steerspec.steering.runtime import maybe_steering, steering_vector
from steerspec.steering.verifier_head import vector_from_bytes, vector_to_bytes

DEFAULT_DRAFTERS = "pretrained,distilled,sd2"
DEFAULT_SETS = "indist,tests,docs"
DEFAULT_SERVICES_RTT_MS = 50.0
DEFAULT_SERVICES_PROMPTS = 4


@dataclass
class Tally:
    """Sums over the generations of one (set, drafter, run)."""

    generated: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    wall_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    steer_s: float = 0.0
    pos_drafted: List[int] = field(default_factory=list)
    pos_accepted: List[int] = field(default_factory=list)

    def add(self, result, steer_s: float = 0.0) -> None:
        self.generated += result.generated
        self.rounds += result.rounds
        self.drafted += result.drafted
        self.accepted += result.accepted
        self.wall_s += result.wall_s
        self.draft_s += result.draft_s
        self.verify_s += result.verify_s
        self.steer_s += steer_s
        for d, a in zip(result.block_drafted, result.block_accepted):
            while len(self.pos_drafted) < d:
                self.pos_drafted.append(0)
                self.pos_accepted.append(0)
            for i in range(d):
                self.pos_drafted[i] += 1
                self.pos_accepted[i] += int(i < a)

    @property
    def tau(self) -> float:
        return self.generated / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.wall_s if self.wall_s > 0 else 0.0


def split_names(text: str) -> List[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _label(spec: str) -> str:
    name = ALIASES.get(spec, spec)
    return name if name in BUNDLED_NAMES else Path(spec).name


def drafter_dirs(specs: Sequence[str]) -> Dict[str, Path]:
    """Label -> checkpoint directory for `--drafters` entries (bundled names or [label=]DIR)."""
    dirs: Dict[str, Path] = {}
    for spec in specs:
        label, _, path = spec.rpartition("=")
        ddir = resolve_model_dir(path)
        label = label or _label(path)
        if label in dirs:
            raise UsageError(f"drafter {label!r} given twice")
        dirs[label] = ddir
    return dirs


def load_prompts(set_name: str, eval_dir: Optional[Path], limit: int) -> List[str]:
    path = Path(eval_dir or assets_dir()) / f"{set_name}.jsonl"
    if not path.is_file():
        raise UsageError(f"eval set not found: {path}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prompts = [r["prompt"] for r in rows]
    return prompts[:limit] if limit > 0 else prompts


def steering_overhead(verifier, drafter_cached, steer, prompt_ids: Sequence[int], k: int, repeats: int = 200,
                      temperature: float = 1.0, draft_top_k: int = 64) -> Dict:
    """Drafting time of one k-token block with and without the SD² steering, same drafter, same text.

    Steered = what the drafter does per block: decode the fp16 vector it received, compute the
    W_s biases, and run k steered drafting steps; plain = the same k steps unsteered. Both draft
    as the target's regime does (T=1 with the draft top-k: sample, keep the sparse q), each block
    from the same seeded generator.
    W_hml runs on the verifier (part of its verify time there), so it is timed separately as
    `head_ms`. Runs in pairs whose order alternates (so load drifts hit both alike);
    overhead = median over pairs of steered / plain − 1.
    """
    verifier = as_cached(verifier)
    cfg = DecodeConfig(max_new_tokens=k + 1, sampling=SamplingParams(temperature=temperature),
                       draft_top_k=draft_top_k)
    committed = list(prompt_ids)
    hidden = prefill(verifier, committed, steer.verifier_layers)
    drafter_cached.reset()
    drafter_cached.extend(committed[:-1])
    base = drafter_cached.length
    device = drafter_cached.device

    def head_block() -> Tuple[bytes, float]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            wire = vector_to_bytes(steering_vector(steer.head, hidden))  # verifier side, as sent
        return wire, time.perf_counter() - t0

    wire, _ = head_block()

    def steered_block() -> Tuple[float, float]:
        drafter_cached.rollback(base)
        t0 = time.perf_counter()
        with torch.inference_mode():
            g = vector_from_bytes(wire).to(device)
            steer.hooks.set_vector(g.unsqueeze(0), steer_prefix=True)
        t1 = time.perf_counter()
        draft_block(drafter_cached, committed, k, cfg, torch.Generator(device).manual_seed(0))
        t2 = time.perf_counter()
        steer.hooks.clear()
        return t2 - t0, t1 - t0

    def plain_block() -> float:
        drafter_cached.rollback(base)
        t0 = time.perf_counter()
        draft_block(drafter_cached, committed, k, cfg, torch.Generator(device).manual_seed(0))
        return time.perf_counter() - t0

    steered_block(), plain_block()  # warm-up
    steered, plain, begin, ratios = [], [], [], []
    for i in range(repeats):
        if i % 2 == 0:
            (s, b), p = steered_block(), plain_block()
        else:
            p = plain_block()
            s, b = steered_block()
        steered.append(s)
        plain.append(p)
        begin.append(b)
        ratios.append(s / p)
    head_ms = statistics.median(head_block()[1] for _ in range(repeats))
    return {"steered_block_ms": round(statistics.median(steered) * 1e3, 3),
            "head_ms": round(head_ms * 1e3, 4),
            "plain_block_ms": round(statistics.median(plain) * 1e3, 3),
            "begin_block_ms": round(statistics.median(begin) * 1e3, 4),
            "overhead_pct": round(100.0 * (statistics.median(ratios) - 1.0), 2), "repeats": repeats, "k": k,
            "temperature": temperature, "draft_top_k": draft_top_k}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier", default="verifier", help="verifier checkpoint dir or bundled name")
    add_device_arguments(parser)
    parser.add_argument("--drafters", default=DEFAULT_DRAFTERS,
                        help="comma-separated drafter dirs or bundled names, optionally LABEL=DIR; the first is the speedup baseline")
    parser.add_argument("--sets", default=DEFAULT_SETS, help="comma-separated eval sets (indist, tests, docs)")
    parser.add_argument("--eval-dir", type=Path, default=None, help="directory of <set>.jsonl (default: bundled)")
    parser.add_argument("--limit", type=int, default=24, help="prompts per set (0 = all)")
    parser.add_argument("--seeds", default="0,1,2", help="seeds of the T=1 runs")
    parser.add_argument("--k", type=int, default=8, help="draft length")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--draft-top-k", type=int, default=64)
    parser.add_argument("--no-draft-tail", action="store_true",
                        help="ablation: renormalise the draft top-k instead of spreading the drafter's remaining mass "
                             "over the other tokens (in-process rows only; implies --no-services)")
    parser.add_argument("--no-greedy", action="store_true", help="skip the T=0 run")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--steering-repeats", type=int, default=200,
                        help="steered/plain block pairs timed for the steering cost (a ±1%% figure needs ~200)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_sd2.json"), help="JSON output")
    parser.add_argument("--plot", type=Path, default=None, help="PNG bar chart (default: OUT with .png)")
    parser.add_argument("--services-rtt-ms", type=float, default=DEFAULT_SERVICES_RTT_MS,
                        help="emulated coordinator-verifier round trip of the services measurement")
    parser.add_argument("--services-prompts", type=int, default=DEFAULT_SERVICES_PROMPTS,
                        help="prompts per set through the services (the first ones, at most --limit; T=1, first seed)")
    parser.add_argument("--no-services", action="store_true", help="skip the measurement through the services")


def validate_services(args) -> None:
    """Reject bad services flags before any model loads (a UsageError: one line, exit status 2)."""
    rtt = args.services_rtt_ms
    if not (math.isfinite(rtt) and rtt >= 0.0):
        raise UsageError(f"--services-rtt-ms must be a finite number >= 0, got {rtt}")
    if args.services_prompts < 1:
        raise UsageError(f"--services-prompts must be >= 1 (--no-services skips them), got {args.services_prompts}")


def _prompt_seed(seed: int, index: int) -> int:
    """The sampling seed of prompt `index` in seed `seed`'s run, the same in-process and through the services."""
    return seed * 100_003 + index


async def _open_clusters(stack: AsyncExitStack, verifier_model, dirs: Dict[str, Path], rtt_ms: float,
                         eos: Sequence[int], dtype: str, device: str,
                         drafter_dtype: Optional[str] = None) -> Dict[str, object]:
    """One LocalCluster per drafter (sharing the verifier weights), all open at once so prompts can interleave.

    LocalCluster loads the drafter from its directory, so an SD² one gets its W_s hooks and the
    verifier its W_hml head.
    """
    link = LinkModel(rtt_ms=rtt_ms).validate()
    return {label: await stack.enter_async_context(
                LocalCluster(verifier=verifier_model, drafter=str(ddir), link=link, tokenizer=None, eos_ids=list(eos),
                             dtype=dtype, drafter_dtype=drafter_dtype, device=device))
            for label, ddir in dirs.items()}


async def _services_generate(cluster, ids: Sequence[int], args, seed: int, steering: bool,
                             max_new_tokens: Optional[int] = None):
    """One T=1 generation through the cluster's coordinator with the bench's k and draft-top-k."""
    return await cluster.generate(ids, max_new_tokens=max_new_tokens or args.max_new_tokens, temperature=1.0,
                                  seed=seed, k=args.k, draft_top_k=args.draft_top_k, steering=steering, timeout=600)


async def measure_services(verifier_model, dirs: Dict[str, Path], prompts: Dict[str, List[List[int]]],
                           sets: List[str], args, eos: Sequence[int], seed: int) -> Dict[str, Dict[str, Dict]]:
    """{set: {drafter: summarize_runs(...)}} of the first --services-prompts prompts through the services.

    Every cluster is warmed up with one generation first; then prompt by prompt, drafter by
    drafter (interleaved like the in-process runs), T=1, seed `seed`, steering only where the
    drafter carries SD² weights.
    """
    steered = {label: has_steering(ddir) for label, ddir in dirs.items()}
    chosen = {s: prompts[s][:args.services_prompts] for s in sets}
    runs: Dict[str, Dict[str, list]] = {s: {label: [] for label in dirs} for s in sets}
    warm_ids = next(p[0] for p in chosen.values() if p)
    async with AsyncExitStack() as stack:
        clusters = await _open_clusters(stack, verifier_model, dirs, args.services_rtt_ms, eos, args.dtype,
                                        str(verifier_model.device), args.drafter_dtype)
        for label, cluster in clusters.items():  # warm-up: one block, not timed
            await _services_generate(cluster, warm_ids, args, seed, steered[label],
                                     max_new_tokens=min(args.max_new_tokens, args.k + 1))
        bar = tqdm(total=sum(map(len, chosen.values())) * len(clusters), desc="bench sd2 (services)", mininterval=5.0)
        for s in sets:
            for i, ids in enumerate(chosen[s]):
                for label, cluster in clusters.items():
                    result = await _services_generate(cluster, ids, args, _prompt_seed(seed, i), steered[label])
                    runs[s][label].append(result)
                    bar.update(1)
        bar.close()
    return {s: {label: dict(summarize_runs(r), steering=steered[label]) for label, r in by.items()}
            for s, by in runs.items()}


def add_services(results: Dict, measured: Dict[str, Dict[str, Dict]], base: str) -> None:
    """Copy each services measurement into its result row, with the speedup over the baseline drafter's."""
    for set_name, by_label in measured.items():
        ref = by_label[base]["tokens_per_s"]
        for label, m in by_label.items():
            results[set_name][label].update(
                tokens_per_s_services=m["tokens_per_s"], tau_services=m["block_efficiency"],
                speedup_services=m["tokens_per_s"] / ref if ref and m["tokens_per_s"] else None,
                bytes_down_per_block_services=m.get("bytes_down"), bytes_up_per_block_services=m.get("bytes_up"),
                services=m)


def run(args) -> int:
    validate_services(args)
    args.no_services = args.no_services or args.no_draft_tail  # the services always spread the tail
    torch.set_num_threads(max(1, args.threads))
    drafter_specs, sets = split_names(args.drafters), split_names(args.sets)
    try:
        seeds = [int(s) for s in split_names(args.seeds)]
    except ValueError:
        raise UsageError(f"--seeds must be comma-separated integers, got {args.seeds!r}") from None
    if not drafter_specs or not sets or not seeds:
        raise UsageError("need at least one drafter, one eval set and one seed")
    if not 1 <= args.k <= 64:
        raise UsageError(f"--k must be in [1, 64], got {args.k}")
    if args.steering_repeats < 1:
        raise UsageError(f"--steering-repeats must be at least 1, got {args.steering_repeats}")

    device = resolve_device(args.device)  # bad or missing devices: one line, exit 2, before any loading
    vdir = resolve_model_dir(args.verifier)
    args.dtype, args.invariant = resolve_path(args.dtype, getattr(args, "invariant", None), vdir, device)
    verifier_model = load_model(vdir, dtype=args.dtype, device=device)
    apply_invariance(verifier_model, args.invariant or "off")
    verifier = CachedLM(verifier_model)
    tok = load_tokenizer(vdir)
    dirs = drafter_dirs(drafter_specs)
    drafters = {}
    args.drafter_dtype = drafter_dtype_of(args)  # resolved once: in process and through the services alike
    for label, ddir in dirs.items():
        cached = CachedLM(load_model(ddir, dtype=args.drafter_dtype, device=device))
        drafters[label] = (cached, maybe_steering(cached, ddir, device=device))
    labels = list(drafters)
    base = labels[0]
    eos = eos_token_ids(verifier.model, tok)
    max_len = context_length(verifier.model)
    runs = [("T1", s) for s in seeds] + ([] if args.no_greedy else [("T0", None)])
    prompts = {s: [tok(p, add_special_tokens=False)["input_ids"] for p in load_prompts(s, args.eval_dir, args.limit)]
               for s in sets}
    total = sum(len(p) for p in prompts.values()) * len(runs) * len(labels)

    tallies: Dict[str, Dict[str, Dict[str, Tally]]] = {s: {d: {} for d in labels} for s in sets}
    bar = tqdm(total=total, desc="bench sd2", mininterval=5.0)
    started = time.time()
    for set_name in sets:
        for mode, seed in runs:
            run_key = f"{mode}" if seed is None else f"{mode}:seed{seed}"
            temperature = 1.0 if mode == "T1" else 0.0
            for i, ids in enumerate(prompts[set_name]):
                cfg = DecodeConfig(max_new_tokens=args.max_new_tokens, sampling=SamplingParams(temperature=temperature),
                                   draft_top_k=args.draft_top_k, draft_tail=not args.no_draft_tail,
                                   seed=None if seed is None else _prompt_seed(seed, i),
                                   eos_token_ids=eos, max_length=max_len)
                for label in labels:
                    cached, steer = drafters[label]
                    if steer is not None:
                        steer.reset_stats()
                    res = speculative_generate(verifier, cached, ids, cfg, policy=FixedK(args.k), steering=steer)
                    tallies[set_name][label].setdefault(run_key, Tally()).add(res, steer.steer_s if steer else 0.0)
                    bar.update(1)
    bar.close()
    elapsed = time.time() - started

    results: Dict[str, Dict] = {}
    for set_name in sets:
        results[set_name] = {}
        for label in labels:
            t = tallies[set_name][label]
            t1 = [t[f"T1:seed{s}"] for s in seeds]
            taus = [x.tau for x in t1]
            pooled = Tally()
            for x in t1:
                for f in ("generated", "rounds", "drafted", "accepted", "wall_s", "draft_s", "verify_s", "steer_s"):
                    setattr(pooled, f, getattr(pooled, f) + getattr(x, f))
            pos = [sum(x.pos_accepted[i] for x in t1 if i < len(x.pos_accepted)) /
                   max(1, sum(x.pos_drafted[i] for x in t1 if i < len(x.pos_drafted))) for i in range(args.k)]
            row = {
                "tau_t1_mean": statistics.mean(taus),
                "tau_t1_std": statistics.stdev(taus) if len(taus) > 1 else 0.0,
                "tau_t1_seeds": taus,
                "accepted_per_block_t1": statistics.mean(taus) - 1.0,
                "acceptance_rate_t1": pooled.accepted / pooled.drafted if pooled.drafted else None,
                "accepted_per_position_t1": pos,
                "tokens_per_s_t1": pooled.tokens_per_s,
                "draft_ms_per_block_t1": 1e3 * pooled.draft_s / max(1, pooled.rounds),
                "verify_ms_per_block_t1": 1e3 * pooled.verify_s / max(1, pooled.rounds),
                "steer_ms_per_block_t1": 1e3 * pooled.steer_s / max(1, pooled.rounds),
                "generated_t1": pooled.generated, "rounds_t1": pooled.rounds,
            }
            if "T0" in t:
                row.update(tau_t0=t["T0"].tau, accepted_per_block_t0=t["T0"].tau - 1.0, tokens_per_s_t0=t["T0"].tokens_per_s)
            results[set_name][label] = row
        ref = results[set_name][base]
        for label in labels:
            row = results[set_name][label]
            row["speedup_t1"] = row["tokens_per_s_t1"] / ref["tokens_per_s_t1"] if ref["tokens_per_s_t1"] else None
            if "tau_t0" in row:
                row["speedup_t0"] = row["tokens_per_s_t0"] / ref["tokens_per_s_t0"] if ref["tokens_per_s_t0"] else None

    services_started = time.time()
    if not args.no_services:
        measured = asyncio.run(measure_services(verifier.model, dirs, prompts, sets, args, eos, seeds[0]))
        add_services(results, measured, base)
    services_elapsed = time.time() - services_started

    steer_info = {}
    for label in labels:
        cached, steer = drafters[label]
        if steer is not None:
            first = prompts[sets[0]][0]
            steer_info[label] = steering_overhead(verifier, cached, steer, first, args.k, args.steering_repeats,
                                                  draft_top_k=args.draft_top_k)
            steer_info[label]["bytes_per_reply"] = steer.bytes_per_reply
            steer_info[label]["verifier_layers"] = steer.verifier_layers

    targets = check_targets(results, labels, steer_info)
    report = {
        "command": command_line("steerspec bench sd2", args),
        "config": {"verifier": str(vdir), "drafters": labels, "sets": sets, "seeds": seeds, "k": args.k,
                   "max_new_tokens": args.max_new_tokens, "draft_top_k": args.draft_top_k,
                   "draft_tail": not args.no_draft_tail,
                   "prompts_per_set": {s: len(p) for s, p in prompts.items()}, "threads": args.threads,
                   "device": str(device), "dtype": args.dtype, "drafter_dtype": args.drafter_dtype,
                   "transport": "inproc", "std": "sample std over seeds (ddof=1)",
                   "services": None if args.no_services else services_config(args, prompts, seeds[0])},
        "elapsed_s": round(elapsed, 1),
        "services_elapsed_s": None if args.no_services else round(services_elapsed, 1),
        "results": results,
        "steering": steer_info,
        "targets": targets,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot = args.plot or args.out.with_suffix(".png")
    make_chart(results, labels, sets, plot, k=args.k)
    print(format_table(results, labels, sets))
    if not args.no_services:
        print(services_note(args, prompts, seeds[0]))
    for label, info in steer_info.items():
        print(f"steering ({label}): +{info['overhead_pct']:.1f}% drafting time per block "
              f"({info['steered_block_ms']:.2f} vs {info['plain_block_ms']:.2f} ms for k={info['k']} "
              f"at T={info['temperature']:g}, draft top-k {info['draft_top_k']}), "
              f"{info['bytes_per_reply']} bytes per reply; W_hml on the verifier {info['head_ms']:.3f} ms per reply")
    for name, t in targets.items():
        print(f"target {name}: {'PASS' if t['pass'] else 'FAIL'} ({t['detail']})")
    extra = "" if args.no_services else f" + {services_elapsed:.0f} s through the services"
    print(f"wrote {args.out} and {plot} ({elapsed:.0f} s{extra})")
    return 0


def services_config(args, prompts: Dict[str, List[List[int]]], seed: int) -> Dict:
    """The JSON record of how the services columns were measured."""
    return {"transport": "grpc (LocalCluster: verifier, drafter, coordinator servers in this process)",
            "rtt_ms": args.services_rtt_ms, "temperature": 1.0, "seed": seed, "k": args.k,
            "draft_top_k": args.draft_top_k, "max_new_tokens": args.max_new_tokens,
            "prompts_per_set": {s: min(len(p), args.services_prompts) for s, p in prompts.items()},
            "warm_up": "one untimed generation per cluster", "steering": "requested for SD² drafters only"}


def services_note(args, prompts: Dict[str, List[List[int]]], seed: int) -> str:
    """The line under the table saying what the svc columns are."""
    n = min(min(len(p), args.services_prompts) for p in prompts.values())
    return (f"svc: through the services at an emulated RTT of {args.services_rtt_ms:g} ms, k={args.k}, T=1, "
            f"seed {seed}, first {n} prompt(s) per set; B↓/blk = mean bytes per verify reply")


ROLES = ("pretrained", "distilled", "sd2")
GAIN_SETS = ("indist", "fresh")  # where SD² must beat: +30% over pretrained, +15% over distilled (τ − 1, T=1)


def roles(labels: List[str]) -> Dict[str, str]:
    """{role: label} for the drafters named by role, bare or as a suffix (`sd2`, `smollm2-sd2`)."""
    out: Dict[str, str] = {}
    for role in ROLES:
        named = [label for label in labels if label == role or label.endswith("-" + role)]
        if len(named) == 1:
            out[role] = named[0]
    return out


def check_targets(results: Dict, labels: List[str], steer_info: Dict) -> Dict:
    """The issues' targets, when a pretrained and an SD² drafter were measured (the tiny pair's
    `pretrained`/`distilled`/`sd2` or the real pair's `smollm2-*`): SD²'s accepted tokens per block
    at T=1 on indist and fresh against pretrained (≥ +30%) and distilled (≥ +15%); on the other sets
    not below either beyond the sum of the seed stds; the steering's cost and bytes."""
    out: Dict[str, Dict] = {}
    named = roles(labels)
    if not {"pretrained", "sd2"} <= set(named):
        return out
    sd2 = named["sd2"]
    for s in results:
        r = results[s]
        for role, floor in (("pretrained", 0.30), ("distilled", 0.15)):
            if role not in named:
                continue
            a, b = r[sd2], r[named[role]]
            if s in GAIN_SETS:
                gain = a["accepted_per_block_t1"] / b["accepted_per_block_t1"] - 1.0
                out[f"{s}_sd2_vs_{role}_ge_{floor * 100:.0f}pct"] = {
                    "pass": gain >= floor, "value": gain, "detail": f"(τ−1) {gain * 100:+.1f}%"}
            else:
                spread = a["tau_t1_std"] + b["tau_t1_std"]
                diff = a["tau_t1_mean"] - b["tau_t1_mean"]
                out[f"{s}_sd2_not_below_{role}"] = {"pass": diff >= -spread, "value": diff,
                                                    "detail": f"Δτ {diff:+.3f}, allowed −{spread:.3f} (sum of seed stds)"}
    if sd2 in steer_info:
        info = steer_info[sd2]
        out["steering_overhead_le_5pct"] = {"pass": info["overhead_pct"] <= 5.0, "value": info["overhead_pct"],
                                            "detail": f"{info['overhead_pct']:+.1f}% drafting time per block"}
        hidden = info["bytes_per_reply"] // 2
        out["steering_bytes_le_2dv"] = {"pass": info["bytes_per_reply"] <= 2 * hidden, "value": info["bytes_per_reply"],
                                        "detail": f"{info['bytes_per_reply']} bytes (d_V = {hidden})"}
    return out


def _cell(value, digits: int, width: int) -> str:
    """A right-aligned number, or '-' when it was not measured."""
    text = "-" if value is None else f"{value:.{digits}f}"
    return text.rjust(width)


def _services_cells(r: Dict) -> str:
    """The services columns of one row: tokens/s, τ, speedup, bytes per verify reply."""
    return (f" {_cell(r.get('tokens_per_s_services'), 1, 9)} {_cell(r.get('tau_services'), 3, 6)} "
            f"{_cell(r.get('speedup_services'), 2, 7)} {_cell(r.get('bytes_down_per_block_services'), 0, 7)}")


def format_table(results: Dict, labels: List[str], sets: List[str]) -> str:
    """The Table 1 rows, one per (set, drafter); the svc columns appear when the services were measured."""
    services = any("tau_services" in results[s][d] for s in sets for d in labels)
    head = f"{'set':8} {'drafter':11} {'τ (T=1)':>15} {'acc/blk':>8} {'speedup':>8} {'τ (T=0)':>8} {'speedup':>8} {'draft ms/blk':>12}"
    if services:
        head += f" {'svc tok/s':>9} {'svc τ':>6} {'svc spd':>7} {'B↓/blk':>7}"
    lines = [head, "-" * len(head)]
    for s in sets:
        for label in labels:
            r = results[s][label]
            t0 = f"{r['tau_t0']:.3f}" if "tau_t0" in r else "-"
            s0 = f"{r['speedup_t0']:.2f}" if r.get("speedup_t0") is not None else "-"
            lines.append(f"{s:8} {label:11} {r['tau_t1_mean']:8.3f} ± {r['tau_t1_std']:.3f} "
                         f"{r['accepted_per_block_t1']:8.3f} {r['speedup_t1']:8.2f} {t0:>8} {s0:>8} "
                         f"{r['draft_ms_per_block_t1']:12.2f}" + (_services_cells(r) if services else ""))
    return "\n".join(lines)


def make_chart(results: Dict, labels: List[str], sets: List[str], path: Path, k: int) -> None:
    """Grouped bars of accepted tokens per block (τ − 1): solid T=1 with seed std, hatched T=0."""
    # lazy: matplotlib only to draw the figure
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib only to draw the figure
    import matplotlib.pyplot as plt

    colors = ["#9e9e9e", "#4c72b0", "#dd8452", "#55a868", "#c44e52"]
    has_t0 = all("tau_t0" in results[s][d] for s in sets for d in labels)
    per = len(labels) * (2 if has_t0 else 1)
    width = 0.8 / per
    fig, ax = plt.subplots(figsize=(2.2 + 2.0 * len(sets), 3.6))
    for j, label in enumerate(labels):
        xs = [i + (j * (2 if has_t0 else 1)) * width - 0.4 + width / 2 for i in range(len(sets))]
        ys = [results[s][label]["accepted_per_block_t1"] for s in sets]
        err = [results[s][label]["tau_t1_std"] for s in sets]
        ax.bar(xs, ys, width, yerr=err, capsize=2, color=colors[j % len(colors)], label=f"{label} T=1")
        if has_t0:
            ax.bar([x + width for x in xs], [results[s][label]["accepted_per_block_t0"] for s in sets], width,
                   color=colors[j % len(colors)], alpha=0.55, hatch="//", edgecolor="black", linewidth=0.3,
                   label=f"{label} T=0")
    ax.set_xticks(range(len(sets)))
    ax.set_xticklabels(sets)
    ax.set_ylabel("accepted tokens per block (τ − 1)")
    ax.set_title(f"SD² vs baselines, k={k}")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)

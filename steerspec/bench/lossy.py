"""SPRINTER (lossy) against exact speculative decoding: calls saved, speed at modelled RTTs, what it costs.

On the same prompts and seeds (T = --temperature; every sequence runs every configuration, in a
rotating order) it runs exact speculative decoding (fixed k),
exact speculative decoding under each --policies draft-length policy (SPRINTER's Table 2 baselines
SpecDec++ and AdaEDL by default; lossless, so only their speed and calls differ) and SPRINTER at
each --thresholds value, in-process. Per configuration: tokens per verifier
call, time per token (ms, mean ± std over sequences), tokens/s at each RTT in --rtts as
tokens / (wall + calls · RTT) (every verifier call pays one round trip; in-process wall time
plus the modelled network), speedup against exact at the same RTT; η_TP / η_FP measured on
the run's own tokens; Theorem 1's bound η_FP · d_TV(p, q) and Theorems 2–3's expected run length
beside the measured ones. Quality without a judge: (a) the verifier's NLL per token of the
outputs and its ratio to exact's (a perplexity ratio, paired by sequence, with a 95% interval), split
into the excess NLL at the same prefixes (against exact decoding's expectation there: ≈ 1 for lossless
rows, far less noisy) and the drift of that expectation between the prefixes visited, (b) d_TV between the first-token
distribution under SPRINTER and the verifier's own, exact in closed form per prompt and sampled
(--tv-samples draws on the first prompt, with exact decoding's sampled d_TV as the noise floor),
(c) the win-tie rate of SPRINTER's 20-token completions against exact's by the verifier's total
log-likelihood. Prints a table, writes JSON and a speedup/quality PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Sequence

import torch

from steerspec.bench import lossy_services as sprinter_services
from steerspec.bench.host import host_info
from steerspec.bench.lossy_services import SPRINTER
from steerspec.bench.policies import rotated
from steerspec.data.evalsets import load_eval_set
from steerspec.decoding.engine import DecodeConfig, prefill, speculative_generate
from steerspec.decoding.sampling import SamplingParams, draft_distribution, probs_from_logits
from steerspec.errors import UsageError, float_list
from steerspec.models import cached_lm, context_length, eos_token_ids, load_model, load_tokenizer, resolve_model_dir
from steerspec.observability.run_record import command_line
from steerspec.policies import FixedK, PolicyContext, PolicyError, make_policy, split_specs
from steerspec.sprinter import features as F
from steerspec.sprinter import theory
from steerspec.sprinter.classifier import resolve_head
from steerspec.sprinter.decoding import sprinter_generate
from steerspec.sprinter.labels import SprinterTally
from steerspec.sprinter.quality import SequenceQuality, quality_ratios, summarise, token_nll_and_baseline
from steerspec.steering.io import has_steering
from steerspec.steering.runtime import maybe_steering


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier", default="verifier", help="verifier checkpoint dir or bundled name")
    parser.add_argument("--drafter", default="pretrained", help="drafter checkpoint dir or bundled name")
    parser.add_argument("--sprinter-head", default=None, help="head directory (default: DRAFTER/sprinter)")
    parser.add_argument("--thresholds", default="0.3,0.5,0.7", help="comma-separated SPRINTER thresholds")
    parser.add_argument("--max-run", type=int, default=16)
    parser.add_argument("--k", type=int, default=8, help="exact speculative decoding's draft length")
    parser.add_argument("--policies", default="specdecpp,adaedl",
                        help="draft-length policy specs run as exact rows beside fixed k, comma-separated (';' "
                             "when a spec holds commas); trained heads are found beside the drafter; '' for none")
    parser.add_argument("--set", default="indist", help="eval set")
    parser.add_argument("--limit", type=int, default=8, help="prompts")
    parser.add_argument("--seeds", type=int, default=2, help="seeds per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--winrate-tokens", type=int, default=20, help="completion length for the win-tie rate")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rtts", default="0,50,100", help="comma-separated modelled round trips (ms)")
    parser.add_argument("--tv-samples", type=int, default=2000, help="first-token samples for the sampled d_TV")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--services", action="store_true",
                        help="measure exact vs SPRINTER tokens/s through the real services (gRPC on loopback, "
                             "emulated link at each --services-rtts) instead of the in-process table")
    parser.add_argument("--services-rtts", default="0,50", help="emulated RTTs (ms) for --services")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_sprinter.json"), help="JSON output")
    parser.add_argument("--png", type=Path, default=None, help="trade-off plot (default: OUT with .png)")


@torch.inference_mode()
def sequence_quality(verifier, prompt: Sequence[int], tokens: Sequence[int], params) -> SequenceQuality:
    """The verifier's NLL (T = 1) of `tokens` after `prompt` (minus it: their total log-likelihood, which
    the win-tie rate compares) and exact decoding's expected NLL at the same prefixes."""
    if not tokens:
        return SequenceQuality(0, 0.0, 0.0)
    ids = torch.tensor([list(prompt) + list(tokens)], device=verifier.device)
    logits = verifier(input_ids=ids).logits[0, len(prompt) - 1:-1]
    nll, baseline = token_nll_and_baseline(logits, torch.tensor(tokens), params)
    return SequenceQuality(len(tokens), float(nll.sum()), float(baseline.sum()))


@torch.inference_mode()
def first_token_tv(verifier, drafter, head, prompt: Sequence[int], config, threshold: float,
                   lam: float, steering=None) -> Dict[str, float]:
    """Closed-form d_TV(p, p_SPRINTER) of the first token at this prompt, with Theorem 1's bound there.
    `verifier` and `drafter` are the CachedLMs decoding uses; an SD² drafter's `steering` gets the
    prefill's vector first."""
    params = config.sampling
    drafter.reset()
    if steering is not None:  # as the first block decodes: prompt[:-1] unsteered, the last token steered
        steering.begin_block(prefill(verifier, prompt, steering.verifier_layers))
    out = drafter.extend(prompt, [drafter.num_layers - 1])
    probs = probs_from_logits(out.logits[-1:], params.temperature, params.top_k, params.top_p)
    q = draft_distribution(probs, config.draft_top_k, config.draft_tail).to_dense(probs.shape[-1])[0].float()
    p = probs_from_logits(verifier.model(input_ids=torch.tensor([list(prompt)], device=verifier.device)).logits[0, -1:],
                          params.temperature, params.top_k, params.top_p)[0].float()
    vocab = q.shape[-1]
    xs = torch.arange(vocab, device=q.device)
    embed = drafter.model.get_input_embeddings().weight
    hidden = out.hidden[0, -1].float().expand(vocab, -1)
    feats = F.build_features(hidden, embed[xs].float(), q, F.entropy(probs[0].float()).expand(vocab))
    keep = (head.prob(feats) >= threshold).float()
    mixed = theory.first_token_distribution(p, q, keep)
    bad = ~F.acceptable(q, p, lam)
    eta_fp = float((q * keep)[bad].sum() / q[bad].sum().clamp_min(1e-30))
    tv_pq = float(theory.tv_distance(p, q))
    return {"tv": float(theory.tv_distance(p, mixed)), "tv_pq": tv_pq, "eta_fp_q": eta_fp,
            "bound": theory.tv_bound(eta_fp, tv_pq)}


def _sampled_tv(generate, prompt, config, samples: int, p_first) -> float:
    """d_TV between the empirical first-token distribution over `samples` seeds and p (3 tokens, so a
    first token the head keeps is committed unverified; with 2 the budget would verify it)."""
    counts = torch.zeros_like(p_first)
    for seed in range(samples):
        token = generate(prompt, replace(config, max_new_tokens=3, seed=10_000 + seed, eos_token_ids=())).token_ids[0]
        counts[token] += 1
    return float(0.5 * (counts / samples - p_first).abs().sum())


def run(args: argparse.Namespace) -> int:
    thresholds = float_list(args.thresholds, "--thresholds")
    rtts = float_list(args.rtts, "--rtts")
    if any(not 0 < t < 1 for t in thresholds):
        raise UsageError(f"--thresholds must each be in (0, 1), got {args.thresholds}")
    if args.max_run < 1:
        raise UsageError(f"--max-run must be >= 1, got {args.max_run}")
    try:
        params = SamplingParams(temperature=args.temperature).validate()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    torch.set_num_threads(max(1, args.threads))
    ddir = resolve_model_dir(args.drafter)
    loaded = resolve_head(ddir, args.sprinter_head, device=args.device)
    verifier_model = load_model(args.verifier, device=args.device).eval()
    drafter_model = load_model(ddir, device=args.device).eval()
    tok = load_tokenizer(args.verifier)
    verifier, drafter = cached_lm(verifier_model), cached_lm(drafter_model)
    limit = min(context_length(verifier_model), context_length(drafter_model))
    eos = eos_token_ids(verifier_model, tok)
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in load_eval_set(args.set)]
    prompts = [p for p in prompts if p][: args.limit]
    base = DecodeConfig(max_new_tokens=args.max_new_tokens, sampling=params, eos_token_ids=eos, max_length=limit)

    context = PolicyContext(drafter_dir=str(ddir), drafter=drafter_model, device=args.device)
    specs = split_specs(args.policies)
    try:  # a bad spec or a missing head is one line before any run; each policy is built (its head loaded) once
        policies = {spec: make_policy(spec, context) for spec in specs}
    except PolicyError as exc:
        raise UsageError(f"--policies: {exc}") from None
    if args.services:
        served = ddir if has_steering(ddir) else drafter_model  # by directory, an SD² drafter is served steered
        return _run_services(args, verifier_model, served, prompts, eos, thresholds, loaded, specs)

    steer = maybe_steering(drafter, ddir, device=args.device)  # an SD² drafter decodes steered, as `run` does
    configs = {"exact": lambda ids, cfg: speculative_generate(verifier, drafter, ids, cfg, FixedK(args.k),
                                                              steering=steer)}
    for spec, policy in policies.items():  # speculative_generate resets the policy at the start of each sequence
        configs[spec] = (lambda policy: lambda ids, cfg: speculative_generate(
            verifier, drafter, ids, cfg, policy, steering=steer))(policy)
    for t in thresholds:
        configs[f"{SPRINTER}{t:g}"] = (lambda t: lambda ids, cfg: sprinter_generate(
            verifier, drafter, ids, cfg, loaded.head, threshold=t, max_run=args.max_run, lam=loaded.lam,
            steering=steer))(t)
    configs["exact"](prompts[0], base)  # warm-up

    # every sequence runs every configuration, in a rotating order: a drift in the host's speed, and the
    # first time each shape is met, hit the rows alike (run row after row, exact's, the first, had 3-5x the
    # others' spread in ms per token)
    per_config: Dict[str, tuple] = {name: ([], [], []) for name in configs}
    sequences = [(ids, 1000 * i + s) for i, ids in enumerate(prompts) for s in range(args.seeds)]
    for n, (ids, seed) in enumerate(sequences):
        cfg = replace(base, seed=seed)
        for name in rotated(list(configs), n):
            results, quality, lls = per_config[name]
            r = configs[name](ids, cfg)
            results.append(r)
            quality.append(sequence_quality(verifier_model, ids, r.token_ids, params))
            short = configs[name](ids, replace(cfg, max_new_tokens=args.winrate_tokens, eos_token_ids=()))
            lls.append(-sequence_quality(verifier_model, ids, short.token_ids, params).nll)
    rows: Dict[str, Dict] = {}
    for name, (results, quality, lls) in per_config.items():
        tokens = sum(r.generated for r in results)
        calls = sum(r.rounds for r in results)
        wall = sum(r.wall_s for r in results)
        ms_per_token = [1000 * r.wall_s / r.generated for r in results if r.generated]
        pooled = summarise(quality)
        row = {"tokens": tokens, "verifier_calls": calls, "tokens_per_call": tokens / calls,
               "ms_per_token_mean": statistics.mean(ms_per_token), "ms_per_token_std": statistics.pstdev(ms_per_token),
               "tokens_per_s": {f"{r:g}": tokens / (wall + calls * r / 1000) for r in rtts},
               "nll_per_token": pooled.nll / max(1, pooled.tokens), "_lls": lls,
               "_quality": quality,
               "lossy": name.startswith(SPRINTER)}
        if row["lossy"]:
            # the η's, Theorem 1's bound, the measured deviation and the run lengths: the tally's own figures,
            # pooled over the row's sequences (as the services bench and the summaries report them)
            tally = SprinterTally.pooled([r.tally for r in results], args.max_run)
            eta_tp, eta_fp = tally.eta
            t_draft = sum(r.draft_s for r in results) / max(1, sum(r.drafted for r in results))
            row.update(tally.theory())
            row.update({"threshold": float(name.split("@")[1]), "draft_ms_per_token": 1000 * t_draft,
                        "expected_stop_ms": statistics.mean(theory.expected_stop_time(
                            eta_tp, eta_fp, r, 1000 * t_draft, args.max_run) for r in tally.run_r)
                        if tally.run_r else 0.0})
            tvs = [first_token_tv(verifier, drafter, loaded.head, ids, base, row["threshold"], loaded.lam, steer)
                   for ids in prompts]
            row["first_token_tv"] = statistics.mean(t["tv"] for t in tvs)
            row["first_token_tv_bound"] = statistics.mean(t["bound"] for t in tvs)
        rows[name] = row
        print(f"{name}: {tokens} tokens, {calls} calls", flush=True)

    exact = rows["exact"]
    exact_lls, exact_quality = list(exact["_lls"]), list(exact["_quality"])
    for name, row in rows.items():
        row["speedup"] = {r: row["tokens_per_s"][r] / exact["tokens_per_s"][r] for r in row["tokens_per_s"]}
        row.update(quality_ratios(row.pop("_quality"), exact_quality))  # exact against itself: 1, and its excess
        lls = row.pop("_lls")
        row["win_tie_rate"] = sum(a >= b for a, b in zip(lls, exact_lls)) / len(lls)

    # sampled first-token d_TV on the first prompt, exact decoding as the noise floor
    p_first = probs_from_logits(verifier_model(input_ids=torch.tensor([prompts[0]])).logits[0, -1:], params.temperature,
                                params.top_k, params.top_p)[0].float()
    sampled = {}
    if args.tv_samples > 0:
        for name, generate in configs.items():
            if name in specs:  # exact too: exact decoding's sampled d_TV is the noise floor already
                continue
            sampled[name] = _sampled_tv(generate, prompts[0], base, args.tv_samples, p_first)
            rows[name]["first_token_tv_sampled"] = sampled[name]

    header = ["config", "tok/call", "ms/tok", *[f"x@{r:g}ms" for r in rtts], "eta_TP", "eta_FP", "TV bnd",
              "TV meas", "TV 1st", "TV smp", "run", "E[run]", "ppl ratio [95%]", "ppl excess [95%]", "drift", "win-tie"]
    print(" | ".join(header))
    for name, row in rows.items():
        cells = [name, f"{row['tokens_per_call']:.2f}",
                 f"{row['ms_per_token_mean']:.2f}±{row['ms_per_token_std']:.2f}"]
        cells += [f"{row['speedup'][f'{r:g}']:.2f}" for r in rtts]
        if not row["lossy"]:
            cells += ["-", "-", "-", "0", "0", f"{row.get('first_token_tv_sampled', float('nan')):.3f}", "-", "-"]
        else:
            cells += [f"{row['eta_tp']:.3f}", f"{row['eta_fp']:.3f}", f"{row['tv_bound']:.3f}",
                      f"{row['tv_measured']:.3f}", f"{row['first_token_tv']:.3f}", f"{row.get('first_token_tv_sampled', float('nan')):.3f}",
                      f"{row['mean_run_length']:.2f}", f"{row['expected_run_length']:.2f}"]
        cells += [_interval(row, "ppl_ratio"), _interval(row, "ppl_excess"), _interval(row, "ppl_drift"),
                  f"{row['win_tie_rate']:.2f}"]
        print(" | ".join(cells))
    payload = {"bench": "sprinter", **_provenance(args), "verifier": str(args.verifier),
               "drafter": str(args.drafter), "head": str(loaded.path), "lambda": loaded.lam,
               "temperature": args.temperature, "k": args.k,
               "policies": specs, "max_run": args.max_run, "prompts": len(prompts), "seeds": args.seeds,
               "max_new_tokens": args.max_new_tokens, "rtts_ms": rtts, "tv_samples": args.tv_samples,
               "rtt_model": "tokens / (in-process wall + verifier calls * RTT)", "rows": rows,
               "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    png = args.png or args.out.with_suffix(".png")
    _plot(rows, rtts, png)
    print(f"wrote {args.out} and {png}")
    return 0


def _provenance(args: argparse.Namespace) -> Dict[str, object]:
    """The command line and the machine a run's JSON records, as the other benches' do."""
    return {"command": command_line("steerspec bench sprinter", args), "machine": host_info()}


def _interval(row: Dict, key: str) -> str:
    """A ratio with its 95% interval, as the table prints it."""
    return f"{row[key]:.3f} [{row[key + '_low']:.2f}, {row[key + '_high']:.2f}]"


def _run_services(args: argparse.Namespace, verifier, drafter, prompts, eos, thresholds, loaded, specs) -> int:
    """--services: tokens/s of exact and SPRINTER through the services at emulated RTTs (measured ratios)."""
    rtts = float_list(args.services_rtts, "--services-rtts")
    if any(r < 0 for r in rtts):
        raise UsageError(f"--services-rtts must be >= 0, got {args.services_rtts}")
    rows = asyncio.run(sprinter_services.measure(
        verifier, drafter, prompts, seeds=args.seeds, rtts=rtts, thresholds=thresholds, max_run=args.max_run,
        k=args.k, max_new_tokens=args.max_new_tokens, temperature=args.temperature, eos=eos,
        sprinter_head=args.sprinter_head, policies=specs))
    for line in sprinter_services.table(rows):
        print(line)
    payload = {"bench": "sprinter", "mode": "services", **_provenance(args), "verifier": str(args.verifier),
               "drafter": str(args.drafter), "head": str(loaded.path), "temperature": args.temperature,
               "k": args.k, "max_run": args.max_run,
               "prompts": len(prompts), "seeds": args.seeds, "max_new_tokens": args.max_new_tokens,
               "rtts_ms": rtts, "threads": args.threads, "policies": specs, "rows": rows,
               "rtt_model": "measured: services on 127.0.0.1, coordinator-verifier link emulated (linkemu)",
               "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _plot(rows: Dict[str, Dict], rtts: List[float], path: Path) -> None:
    """Speedup against exact (at each RTT) vs the perplexity excess at the same prefixes (with its 95%
    interval), one point per threshold."""
    # lazy: matplotlib only to draw the figure
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib only to draw the figure
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    lossy = [(n, r) for n, r in rows.items() if r["lossy"]]
    for rtt in rtts:
        xs = [r["ppl_excess"] for _, r in lossy]
        ys = [r["speedup"][f"{rtt:g}"] for _, r in lossy]
        err = [[x - r["ppl_excess_low"] for x, (_, r) in zip(xs, lossy)],
               [r["ppl_excess_high"] - x for x, (_, r) in zip(xs, lossy)]]
        ax.errorbar(xs, ys, xerr=err, marker="o", capsize=2, label=f"RTT {rtt:g} ms")
        for (n, r), x, y in zip(lossy, xs, ys):
            ax.annotate(f"t={r['threshold']:g}", (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
    ax.axhline(1.0, c="grey", ls=":")
    ax.axvline(1.0, c="grey", ls=":")
    ax.scatter([1.0], [1.0], c="black", marker="s", label="exact (lossless)")
    ax.axvspan(0.9, 1.1, color="green", alpha=0.08, label="within 10%")
    ax.set_xlabel("verifier perplexity excess at the same prefixes (1 = exact; 95% interval)")
    ax.set_ylabel("tokens/s speedup vs exact")
    ax.set_title("SPRINTER speed/quality trade-off over thresholds", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

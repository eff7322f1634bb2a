"""In-process engine benchmark: verifier alone vs speculative decoding (k = 1, 2, 4, 8) vs
transformers' assisted generation, on the `indist` prompts, in one process and one run.

Greedy decoding (so every method must produce the same tokens, which the benchmark checks),
batch 1, each prompt run by every method in turn (round robin, so drift hits all methods alike)
after one warm-up pass. tokens/s = generated tokens / wall seconds, summed over prompts;
speedup is against the verifier alone measured in the same run. `--trees` adds greedy draft-tree
rows (steerspec/decoding/tree_decoding.py), "speculative tree=SPEC", beside the fixed-k ones.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
from rich.console import Console
from rich.table import Table

from steerspec.bench.host import host_info
from steerspec.cli.run import add_model_arguments, drafter_dtype_of, load_pair
from steerspec.blocks.block_mode import parse_mode
from steerspec.blocks.kinds import kind_of
from steerspec.decoding.engine import DecodeConfig, autoregressive_generate
from steerspec.decoding.generation_result import GenerationResult, aggregate
from steerspec.decoding.sampling import SamplingParams
from steerspec.decoding.trees import parse_tree
from steerspec.errors import UsageError
from steerspec.models import context_length, eos_token_ids, load_model, resolve_model_dir
from steerspec.models.backends import cached_lm
from steerspec.models.checkpoints import ASSETS_DIR
from steerspec.observability.run_record import tokens_digest
from steerspec.models.invariant_pass import invariant_plan, set_invariant
from steerspec.models.kv import FastCachedLM
from steerspec.policies import FixedK
from steerspec.steering.runtime import SD2Steering, maybe_steering_weights

DEFAULT_KS = "1,2,4,8"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=16, help="number of indist prompts (default: 16)")
    parser.add_argument("--eval-set", default="indist", help="bundled eval set name or a .jsonl file (default: indist)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt (default: 64)")
    parser.add_argument("--prompt-tokens", type=int, default=128,
                        help="keep the last N prompt tokens (default: 128; 0 = whole prompt)")
    parser.add_argument("--ks", default=DEFAULT_KS, help=f"draft lengths to run (default: {DEFAULT_KS})")
    parser.add_argument("--trees", default="",
                        help="greedy draft trees to run too, ';'-separated rank-path specs or 'default' "
                             "(steerspec/decoding/trees.py; e.g. 'default;0,1,00,000'); none by default")
    parser.add_argument("--draft-top-k", type=int, default=64)
    parser.add_argument("--backend", default="auto", choices=("auto", "fast", "hf", "graphed"),
                        help="KV-cache backend of our engine (default: auto = graphed on CUDA, else fast when supported)")
    parser.add_argument("--no-assisted", action="store_true", help="skip transformers' assisted generation")
    parser.add_argument("--compare-layouts", action="store_true",
                        help="on a CPU, also run each k whose verify pass reads weight copies (oneDNN-packed "
                             "for k + 1 >= STEERSPEC_ONEDNN_MIN_ROWS, else out-major for k + 1 in "
                             "STEERSPEC_OUT_MAJOR_ROWS) on the model's own weights, interleaved, to show what they give")
    parser.add_argument("--no-hf-out-major", action="store_true",
                        help="on a CPU, skip transformers' rows on the models' original out-major weights (by "
                             "default they run on both layouts, and the faster counts: BLAS reads one-row "
                             "steps faster input-major and 2-3-row passes faster out-major)")
    parser.add_argument("--compare-invariance", action="store_true",
                        help="with an invariant verifier (--invariant on), also run every one of our rows with "
                             "invariance off, interleaved, labelled '(invariance off)'")
    parser.add_argument("--out", default="bench-results/engine.json", help="JSON output path")
    add_model_arguments(parser)


def load_eval_prompts(name: str, limit: int) -> List[str]:
    path = Path(name) if name.endswith(".jsonl") else ASSETS_DIR / "eval" / f"{name}.jsonl"
    if not path.is_file():
        raise UsageError(f"eval set '{name}' not found at {path}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if limit < 1:
        raise UsageError(f"--prompts must be >= 1, got {limit}")
    return [r["prompt"] for r in rows[:limit]]


class CallCounter:
    """Counts forward calls of a module (verifier rounds of transformers' assisted generation)."""

    def __init__(self, module) -> None:
        self.calls = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        self.calls += 1

    def close(self) -> None:
        self.handle.remove()


def run(args: argparse.Namespace) -> int:
    try:
        ks = [int(x) for x in args.ks.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--ks must be a comma-separated list of integers, got {args.ks!r}") from None
    if not ks or any(not 1 <= k <= 64 for k in ks):
        raise UsageError(f"--ks values must be in [1, 64], got {args.ks!r}")
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be >= 1")

    try:
        trees = [parse_tree(spec) for spec in args.trees.split(";") if spec.strip()]
    except ValueError as exc:
        raise UsageError(f"--trees: {exc}") from None
    # lazy: transformers takes seconds to import
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # assisted generation warns about its own internal arguments
    texts = load_eval_prompts(args.eval_set, args.prompts)
    verifier, drafter, tok = load_pair(args)
    eos = eos_token_ids(verifier, tok)
    limit = min(context_length(verifier), context_length(drafter))
    prompts = []
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if args.prompt_tokens:
            ids = ids[-args.prompt_tokens:]
        longest = max(ks + [t.size for t in trees])  # a tree's nodes occupy cache slots while verified
        prompts.append(ids[-(limit - args.max_new_tokens - longest - 1):])
    config = DecodeConfig(max_new_tokens=args.max_new_tokens, sampling=SamplingParams(temperature=0.0),
                          draft_top_k=args.draft_top_k, eos_token_ids=eos, max_length=limit)
    v_lm, d_lm = cached_lm(verifier, args.backend), cached_lm(drafter, args.backend)

    steering = maybe_steering_weights(drafter, resolve_model_dir(args.drafter), device=drafter.device)

    def engine(mode, policy=None, v=v_lm, d=d_lm) -> Callable:
        """Our engine with the mode's block kind (steerspec/blocks/: a chain at fixed k, a draft tree); an SD² drafter
        is steered (hooks attached per generation, so that transformers' assisted generation below runs the same
        drafter unsteered, with no stale g)."""
        kind = kind_of(mode)

        def generate(ids):
            if steering is None:
                return kind.generate(v, d, ids, config, mode, policy=policy)
            with SD2Steering(d, steering) as hooks:
                return kind.generate(v, d, ids, config, mode, policy=policy, steering=hooks)
        return generate

    def speculative(k: int, v=v_lm, d=d_lm) -> Callable:
        return engine(parse_mode(k=k), FixedK(k), v, d)

    def draft_tree(shape) -> Callable:
        """Greedy tree drafting (steerspec/decoding/tree_decoding.py) on the same caches, steered alike."""
        return engine(parse_mode(tree=shape.spec()))

    methods: Dict[str, Callable] = {"verifier alone": lambda ids: autoregressive_generate(v_lm, ids, config)}
    for k in ks:
        methods[f"speculative k={k}"] = speculative(k)
    for shape in trees:
        methods[f"speculative tree={shape.spec()}"] = draft_tree(shape)

    plan = invariant_plan(verifier)
    if args.compare_invariance:
        if plan is None:
            raise UsageError("--compare-invariance needs an invariant verifier: add --invariant on")

        def plain(fn: Callable) -> Callable:
            def generate(ids):
                set_invariant(verifier, None)
                try:
                    return fn(ids)
                finally:
                    set_invariant(verifier, plan)
            return generate
        for name in list(methods):
            methods[f"{name} (invariance off)"] = plain(methods[name])

    if args.compare_layouts:
        plain_v, plain_d = cached_lm(verifier, args.backend), cached_lm(drafter, args.backend)
        for lm in (plain_v, plain_d):
            if hasattr(lm, "set_onednn_min_rows"):
                lm.set_out_major_rows(())
                lm.set_onednn_min_rows(0)
        for k in ks:
            if isinstance(v_lm, FastCachedLM) and v_lm.reads_copies(k + 1):
                methods[f"speculative k={k} (no weight copies)"] = speculative(k, plain_v, plain_d)

    default_gen = copy.deepcopy(drafter.generation_config)
    pad = eos[0] if eos else 0
    # transformers on each weight layout (on a CPU): "" = SteerSpec's loading (input-major), else the original
    hf_models = {"": (verifier, drafter)}
    if verifier.device.type == "cpu" and not args.no_hf_out_major:
        hf_models[" (out-major)"] = (load_model(args.verifier, dtype=args.dtype, device=args.device, cpu_layout=False),
                                     load_model(args.drafter, dtype=drafter_dtype_of(args), device=args.device,
                                                cpu_layout=False))

    def hf_generate(ids, assistant=None, gen_config=None, target=None):
        target = verifier if target is None else target
        counter = CallCounter(target)
        if assistant is not None:
            assistant.generation_config = copy.deepcopy(gen_config)
        input_ids = torch.tensor([ids], device=target.device)
        try:
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                        assistant_model=assistant, max_new_tokens=args.max_new_tokens,
                                        eos_token_id=list(eos) or None, pad_token_id=pad)
            wall = time.perf_counter() - t0
        finally:
            counter.close()

        tokens = out[0, len(ids):].tolist()
        return GenerationResult(token_ids=tokens, mode="transformers", rounds=counter.calls, wall_s=wall)

    for label, (hf_v, hf_d) in hf_models.items():
        methods[f"transformers greedy{label}"] = lambda ids, v=hf_v: hf_generate(ids, target=v)
        if not args.no_assisted:
            methods[f"transformers assisted (default){label}"] = (
                lambda ids, v=hf_v, d=hf_d: hf_generate(ids, d, default_gen, target=v))

    console = Console(stderr=True)
    console.print(f"[bold]bench engine[/]: {len(prompts)} {args.eval_set} prompts, {args.max_new_tokens} new tokens, "
                  f"greedy, threads={torch.get_num_threads()}, backend={type(v_lm).__name__}")
    results: Dict[str, list] = {name: [] for name in methods}

    def run_all():
        for i, ids in enumerate(prompts):
            for name, fn in methods.items():
                results[name].append(fn(ids))
            console.print(f"  prompt {i + 1}/{len(prompts)} done", highlight=False)

    for name, fn in methods.items():  # warm-up: one short pass per method, not timed
        fn(prompts[0][:16])
    run_all()

    # transformers assisted generation with num_assistant_tokens fixed at our best k
    best_spec = max((n for n in methods if n.startswith("speculative k=") and "(" not in n),
                    key=lambda n: aggregate(results[n])["tokens_per_s"])
    best_k = int(best_spec.split("=")[1])
    if not args.no_assisted:
        fixed = copy.deepcopy(default_gen)
        fixed.num_assistant_tokens = best_k
        fixed.num_assistant_tokens_schedule = "constant"
        fixed.assistant_confidence_threshold = 0.0
        label = max(hf_models, key=lambda lb: aggregate(results[f"transformers assisted (default){lb}"])["tokens_per_s"])
        hf_v, hf_d = hf_models[label]  # the layout transformers' assisted generation ran faster on
        name = f"transformers assisted (k={best_k} fixed){label}"
        results[name] = []
        hf_generate(prompts[0][:16], hf_d, fixed, target=hf_v)
        spec_name = best_spec
        again = []
        for ids in prompts:  # interleave with our best setting again, so this comparison is like for like
            results[name].append(hf_generate(ids, hf_d, fixed, target=hf_v))
            again.append(methods[spec_name](ids))
        results[f"{spec_name} (rerun)"] = again
    for _, hf_d in hf_models.values():
        hf_d.generation_config = copy.deepcopy(default_gen)

    reference = [r.token_ids for r in results["verifier alone"]]
    rows = []
    # The baseline is the faster of our autoregressive mode and transformers' greedy generate.
    baseline = max(["verifier alone"] + [f"transformers greedy{label}" for label in hf_models],
                   key=lambda n: aggregate(results[n])["tokens_per_s"])
    base_tps = aggregate(results[baseline])["tokens_per_s"]
    for name, rs in results.items():
        agg = aggregate(rs)
        is_ours = not name.startswith("transformers")
        rows.append({
            "method": name,
            "tokens_per_s": agg["tokens_per_s"],
            "speedup": agg["tokens_per_s"] / base_tps if base_tps else None,
            "block_efficiency": agg["block_efficiency"] if (is_ours or "assisted" in name) else 1.0,
            "acceptance_rate": agg["acceptance_rate"] if is_ours else None,
            "accepted_per_position": agg["accepted_per_position"] if is_ours else None,
            "generated_tokens": agg["generated_tokens"],
            "rounds": agg["rounds"],
            "wall_s": agg["wall_s"],
            "same_tokens_as_verifier": [r.token_ids for r in rs] == reference,
            "tokens_sha256": tokens_digest([r.token_ids for r in rs]),
        })
    assisted = [r for r in rows if r["method"].startswith("transformers assisted")]
    ours = [r for r in rows if r["method"].startswith("speculative")]
    best_ours = max(ours, key=lambda r: r["tokens_per_s"])
    best_assisted = max(assisted, key=lambda r: r["tokens_per_s"]) if assisted else None
    summary = {
        "baseline": baseline,
        "best_speculative": best_ours["method"],
        "best_speculative_tokens_per_s": best_ours["tokens_per_s"],
        "best_assisted": best_assisted["method"] if best_assisted else None,
        "best_assisted_tokens_per_s": best_assisted["tokens_per_s"] if best_assisted else None,
        "ratio_vs_assisted": (best_ours["tokens_per_s"] / best_assisted["tokens_per_s"]) if best_assisted else None,
        "all_outputs_equal": all(r["same_tokens_as_verifier"] for r in rows),
    }
    plain_alone = next((r for r in rows if r["method"] == "verifier alone (invariance off)"), None)
    if plain_alone is not None:  # each of our rows against the verifier alone without invariance, same run
        summary["speedup_vs_verifier_alone_invariance_off"] = {
            r["method"]: r["tokens_per_s"] / plain_alone["tokens_per_s"] for r in rows if not r["method"].startswith("transformers")}

    table = Table(title=f"steerspec bench engine ({len(prompts)} {args.eval_set} prompts, "
                        f"{args.max_new_tokens} tokens, greedy, {torch.get_num_threads()} threads)")
    for col in ("method", "tokens/s", "speedup", "block eff.", "accept rate", "same tokens"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        table.add_row(r["method"], f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}x",
                      f"{r['block_efficiency']:.2f}", "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}",
                      "yes" if r["same_tokens_as_verifier"] else "NO")
    out_console = Console(width=160)
    out_console.print(table)
    out_console.print(f"speedup: tokens/s over the faster baseline, {baseline}"
                      + ("; SD² drafter steered in our rows, unsteered in transformers assisted" if steering else ""))
    if best_assisted:
        out_console.print(f"best speculative ({best_ours['method']}) / best transformers assisted "
                          f"({best_assisted['method']}): {summary['ratio_vs_assisted']:.2f}x tokens/s")

    payload = {
        "benchmark": "engine",
        "command": "steerspec bench engine " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "engine"] else None,
        "machine": host_info(verifier=v_lm, drafter=d_lm),
        "eval_set": args.eval_set,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "prompt_tokens": args.prompt_tokens,
        "decoding": "greedy",
        "verifier": str(args.verifier),
        "drafter": str(args.drafter),
        "steering": steering is not None,  # SD²: our rows steered, transformers assisted unsteered
        "dtype": args.dtype,
        "invariant": invariant_plan(verifier)._asdict() if invariant_plan(verifier) is not None else None,
        "invariant_mode": getattr(args, "invariant", None),
        "drafter_dtype": str(next(drafter.parameters()).dtype).replace("torch.", ""),
        "device": str(verifier.device),
        "backend": type(v_lm).__name__,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "results": rows,
        "summary": summary,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    out_console.print(f"wrote {out}")
    return 0

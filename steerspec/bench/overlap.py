"""Teacher-forced draft acceptance: how likely one draft from each drafter is to be accepted.

τ needs many prompts and seeds to separate two good drafters; this measures the quantity behind
it without sampling the drafts. The verifier answers each eval prompt at T=1 (seeded, the same
answers for every drafter); on every answer position, with p the verifier's distribution and q a
drafter's, it reports Σ min(p, q) (the probability that a draft from q is accepted) for the full
q, for the renormalised top `--draft-top-k`, and for the top K plus the spread tail that decoding
sends (`sampling.draft_distribution`), and KL(p ‖ q). SD² drafters are steered as in training
validation: the vector of the verifier position δ back, δ cycling through 1..k over the answers.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Dict, List

import torch
from torch import Tensor

from steerspec.bench.drafters import drafter_dirs, load_prompts, split_names
from steerspec.decoding.sampling import draft_distribution, truncate_top_k
from steerspec.errors import UsageError
from steerspec.models.checkpoints import resolve_model_dir
from steerspec.models.loading import context_length, eos_token_ids, load_model, load_tokenizer
from steerspec.observability.run_record import command_line
from steerspec.steering.runtime import maybe_steering
from steerspec.train.teacher_forcing import teacher_forced, verifier_answer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier", default="verifier", help="verifier checkpoint dir or bundled name")
    parser.add_argument("--drafters", default="pretrained,distilled,sd2",
                        help="comma-separated drafters: bundled names or [label=]DIR")
    parser.add_argument("--sets", default="indist", help="comma-separated eval sets")
    parser.add_argument("--eval-dir", type=Path, default=None, help="directory of <set>.jsonl (default: bundled)")
    parser.add_argument("--limit", type=int, default=24, help="prompts per set (0 = all)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="length of each verifier answer")
    parser.add_argument("--draft-top-k", type=int, default=64)
    parser.add_argument("--k", type=int, default=8, help="δ cycles through 1..k for steered drafters")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_overlap.json"), help="JSON output")


def overlaps(p: Tensor, q: Tensor, top_k: int) -> Dict[str, Tensor]:
    """Per position [N]: Σ min(p, q) for the full q, the renormalised top K and the top K + spread
    tail (what decoding proposes), and KL(p ‖ q); p, q [N, V] probabilities."""
    vocab = q.shape[-1]
    renorm = truncate_top_k(q, top_k).to_dense(vocab)
    spread = draft_distribution(q, top_k).to_dense(vocab)
    kl = (p * (p.clamp_min(1e-30).log() - q.clamp_min(1e-30).log())).sum(-1)
    return {"full": torch.minimum(p, q).sum(-1), "top_k": torch.minimum(p, renorm).sum(-1),
            "top_k_tail": torch.minimum(p, spread).sum(-1), "kl": kl}


def drafter_overlaps(verifier_model, drafter, steering, sequence: List[int], prompt_len: int, delta: int,
                     top_k: int) -> Dict[str, Tensor]:
    """`overlaps` on the answer positions of one sequence; steered with offset δ when `steering`."""
    p, q_logits = teacher_forced(verifier_model, drafter, steering, sequence, prompt_len, delta)
    return overlaps(p, q_logits.float().softmax(-1), top_k)


def run(args) -> int:
    if args.limit < 0 or args.max_new_tokens < 1 or not 1 <= args.k <= 64:
        raise UsageError("need --limit >= 0, --max-new-tokens >= 1 and --k in [1, 64]")
    if args.draft_top_k < 1:
        raise UsageError(f"--draft-top-k must be at least 1, got {args.draft_top_k}")
    torch.set_num_threads(max(1, args.threads))
    vdir = resolve_model_dir(args.verifier)
    verifier = load_model(vdir)
    tok = load_tokenizer(vdir)
    drafters = {}
    for label, ddir in drafter_dirs(split_names(args.drafters)).items():
        drafter = load_model(ddir)
        drafters[label] = (drafter, maybe_steering(drafter, ddir))
    if not drafters:
        raise UsageError("need at least one drafter")
    eos, max_len = eos_token_ids(verifier, tok), context_length(verifier)
    started = time.time()
    results: Dict[str, Dict[str, Dict[str, float]]] = {}
    for set_name in split_names(args.sets):
        prompts = [tok(p, add_special_tokens=False)["input_ids"]
                   for p in load_prompts(set_name, args.eval_dir, args.limit)]
        answers = [verifier_answer(verifier, ids, args.max_new_tokens, args.seed + i, eos, max_len)
                   for i, ids in enumerate(prompts)]
        results[set_name] = {}
        for label, (drafter, steering) in drafters.items():
            parts = [drafter_overlaps(verifier, drafter, steering, seq, len(ids), i % args.k + 1, args.draft_top_k)
                     for i, (ids, seq) in enumerate(zip(prompts, answers)) if len(seq) > len(ids)]
            results[set_name][label] = {key: round(float(torch.cat([p[key] for p in parts]).mean()), 4)
                                        for key in ("full", "top_k", "top_k_tail", "kl")}
            results[set_name][label]["positions"] = sum(len(p["kl"]) for p in parts)
    report = {"command": command_line("steerspec bench overlap", args),
              "config": {"verifier": str(vdir), "draft_top_k": args.draft_top_k, "k": args.k, "seed": args.seed,
                         "max_new_tokens": args.max_new_tokens, "limit": args.limit},
              "elapsed_s": round(time.time() - started, 1), "results": results}
    print(f"{'set':8} {'drafter':12} {'Σmin full':>10} {'top-K':>8} {'top-K+tail':>11} {'KL(p‖q)':>8} "
          f"{'positions':>10}")
    for set_name, rows in results.items():
        for label, r in rows.items():
            print(f"{set_name:8} {label:12} {r['full']:10.4f} {r['top_k']:8.4f} {r['top_k_tail']:11.4f} "
                  f"{r['kl']:8.4f} {r['positions']:10d}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out} ({report['elapsed_s']:.0f} s)")
    return 0

"""Measure smollm2 drafters: speculative acceptance / block efficiency / tokens per second, held-out fit.

    python scripts/eval_smollm2.py --drafter runs/smollm2/init --drafter runs/smollm2/trained \
        --set fresh --prompts 8 --max-new-tokens 48 --k 4 --threads 2 --out runs/smollm2/eval.json

Greedy (T=0) decoding through SteerSpec's engine, in-process; the verifier alone (autoregressive)
on the same prompts is the baseline. Held-out figures are teacher-forced on WORK/corpus/heldout.npy:
bits per byte on the tokens inside the drafter's support (with its coverage), greedy agreement with
the verifier and Σ min(p, q) at T=1 (the expected acceptance of one drafted token).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch


def speculative_figures(verifier, drafter, prompts, config, k, steering=None):
    from steerspec.decoding.engine import autoregressive_generate, speculative_generate
    from steerspec.policies import FixedK

    tokens = rounds = drafted = accepted = 0
    exact = True
    wall = 0.0
    for ids in prompts:
        t0 = time.perf_counter()
        result = speculative_generate(verifier, drafter, ids, config, FixedK(k), steering=steering)
        wall += time.perf_counter() - t0
        exact &= result.token_ids == autoregressive_generate(verifier, ids, config).token_ids
        tokens += len(result.token_ids)
        rounds += result.rounds
        drafted += result.drafted
        accepted += result.accepted
    return {"tokens": tokens, "rounds": rounds, "acceptance_rate": accepted / max(1, drafted),
            "block_efficiency": tokens / max(1, rounds), "tokens_per_s": tokens / wall, "greedy_exact": exact}


def autoregressive_figures(verifier, prompts, config):
    from steerspec.decoding.engine import autoregressive_generate

    tokens, wall = 0, 0.0
    for ids in prompts:
        t0 = time.perf_counter()
        tokens += len(autoregressive_generate(verifier, ids, config).token_ids)
        wall += time.perf_counter() - t0
    return {"tokens": tokens, "tokens_per_s": tokens / wall}


def step_ms(lm, prompt, steps: int = 32) -> float:
    """Median wall time (ms) of one-token cached steps after `prompt` (greedy feed-back)."""
    lm.reset()
    out = lm.extend(prompt)
    times = []
    token = int(out.logits[-1].argmax())
    for _ in range(steps):
        t0 = time.perf_counter()
        out = lm.extend([token])
        token = int(out.logits[-1].argmax())
        times.append(time.perf_counter() - t0)
    lm.reset()
    return 1000 * float(np.median(times))


@torch.no_grad()
def heldout_figures(verifier_model, drafter_model, tokenizer, windows):
    """Teacher-forced figures on [n, T+1] windows of held-out tokens."""
    support = drafter_model.lm_head.support
    inside = torch.zeros(verifier_model.config.vocab_size, dtype=torch.bool)
    inside[support] = True
    nats_v = nats_d = bytes_in = 0.0
    agree = summin = count = covered = 0.0
    for row in windows:
        x = torch.from_numpy(row.astype(np.int64))[None]
        target = x[0, 1:]
        logp = verifier_model(x[:, :-1]).logits[0].float().log_softmax(-1)
        logq = drafter_model(x[:, :-1]).logits[0].float().log_softmax(-1)
        mask = inside[target]
        byte_len = torch.tensor([len(tokenizer.decode([int(t)]).encode("utf-8")) for t in target])
        nats_v += float(-logp.gather(1, target[:, None])[:, 0][mask].sum())
        nats_d += float(-logq.gather(1, target[:, None])[:, 0][mask].sum())
        bytes_in += float(byte_len[mask].sum())
        agree += float((logp.argmax(-1) == logq.argmax(-1)).sum())
        summin += float(torch.minimum(logp.exp(), logq.exp()).sum(-1).sum())
        count += target.numel()
        covered += float(mask.sum())
    ln2 = math.log(2)
    return {"tokens": int(count), "support_coverage": covered / count,
            "verifier_bpb_in_support": nats_v / ln2 / bytes_in, "drafter_bpb_in_support": nats_d / ln2 / bytes_in,
            "greedy_agreement": agree / count, "sum_min_p_q_T1": summin / count}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", action="append", required=True, help="drafter directory (repeatable)")
    parser.add_argument("--set", default="fresh")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("runs/smollm2"))
    parser.add_argument("--heldout-windows", type=int, default=2)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from steerspec.data.evalsets import load_eval_set
    from steerspec.decoding.engine import DecodeConfig
    from steerspec.models import cached_lm, eos_token_ids, load_model, load_tokenizer

    verifier_model, tokenizer = load_model("smollm2"), load_tokenizer("smollm2")
    verifier = cached_lm(verifier_model)
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
               for r in load_eval_set(args.set)[: args.prompts]]
    config = DecodeConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=eos_token_ids(verifier_model, tokenizer),
                          max_length=8192)
    corpus = args.work / "corpus"
    if not (corpus / "heldout.npy").is_file():  # the split `steerspec train smollm2` makes (its seed and cap)
        from steerspec.data.code_corpus import build_token_arrays
        from steerspec.models.smollm2 import eos_ids

        build_token_arrays(tokenizer, corpus, seed=1234, max_train_chars=12_000_000, eos_id=eos_ids(tokenizer)[0])
    heldout = np.load(corpus / "heldout.npy")
    rng = np.random.default_rng(0)
    starts = rng.integers(0, heldout.size - args.window - 1, size=args.heldout_windows)
    windows = [heldout[s: s + args.window + 1] for s in starts]
    report = {"set": args.set, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "k": args.k,
              "threads": args.threads, "verifier_alone": autoregressive_figures(verifier, prompts, config), "drafters": {}}
    report["verifier_alone"]["step_ms"] = step_ms(verifier, prompts[0])
    for path in args.drafter:
        from steerspec.models import resolve_model_dir
        from steerspec.steering.runtime import maybe_steering

        drafter_model = load_model(path)
        drafter = cached_lm(drafter_model)
        steering = maybe_steering(drafter, resolve_model_dir(path))  # SD² drafters steer as in `steerspec run`
        row = speculative_figures(verifier, drafter, prompts, config, args.k, steering)
        row["speedup_vs_verifier"] = row["tokens_per_s"] / report["verifier_alone"]["tokens_per_s"]
        row["step_ms"] = step_ms(cached_lm(drafter_model), prompts[0])
        row["step_ratio_vs_verifier"] = row["step_ms"] / report["verifier_alone"]["step_ms"]
        row["heldout"] = heldout_figures(verifier_model, drafter_model, tokenizer, windows)
        report["drafters"][path] = row
        print(json.dumps({path: row}), flush=True)
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

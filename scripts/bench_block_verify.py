"""Block verification against token-wise acceptance on the same blocks, in process (T > 0).

    python scripts/bench_block_verify.py --drafter smollm2-sd2 --sets fresh,indist --prompts 16 --seeds 0,1 \
        --ks 2,4,6,8 --threads 2 --out docs/results/data/verification/bench-block-verify-smollm2.json
    python scripts/bench_block_verify.py --drafter smollm2-sd2 --sets fresh,indist --prompts 16 --seeds 0,1 \
        --ks "" --trees "default;0,1,2,00,01,10,000,100" --threads 2 \
        --out docs/results/data/verification/bench-traversal-smollm2.json

Generates with token-wise acceptance (`speculative_generate`, fixed k, an SD² drafter steered) and, at every
block the verifier checks, computes the expected accepted drafts given those drafts under both rules
(`block_verify.expected_accepted`): a paired comparison without sampling noise, valid because both rules give
the verifier's distribution, so the contexts are drawn alike. Reports tau = 1 + E[accepted] per rule and k.
With --trees, the same for draft trees (`tree_generate`, siblings without replacement): recursive rejection
sampling against traversal verification (`traversal.expected_path_lengths`), one row per tree.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier", default="smollm2")
    parser.add_argument("--drafter", default="smollm2-sd2")
    parser.add_argument("--sets", default="fresh", help="bundled eval sets (comma-separated)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--ks", default="2,4,6,8", help="chains of these k ('' for none)")
    parser.add_argument("--trees", default="", help="draft trees, ';'-separated (e.g. 'default;0,1,00')")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--draft-top-k", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.temperature <= 0:
        print("bench_block_verify: --temperature must be > 0 (greedy, both rules accept the leading matches)",
              file=sys.stderr)
        return 2

    from rich.console import Console
    from rich.table import Table
    from tqdm import tqdm

    import steerspec.decoding.tree_decoding as tree_decoding
    import steerspec.decoding.verifying as verifying
    from real_pair import load_pair, parse_lists
    from steerspec.decoding.block_verify import expected_accepted
    from steerspec.data.evalsets import load_eval_set
    from steerspec.decoding.engine import DecodeConfig, speculative_generate
    from steerspec.policies import FixedK
    from steerspec.decoding.sampling import SamplingParams
    from steerspec.decoding.speculative import rejection_sample
    from steerspec.decoding.traversal import expected_path_lengths
    from steerspec.decoding.tree_decoding import tree_generate
    from steerspec.decoding.trees import sampled_walk

    lists = parse_lists(args, "bench_block_verify")
    if lists is None:
        return 2
    seeds, ks, trees = lists
    pair = load_pair(args.verifier, args.drafter, args.threads)
    verifier, drafter, tokenizer = pair.verifier, pair.drafter, pair.tokenizer
    sums = {}  # (set, k) -> [blocks, token-wise E, block E, realised accepted]

    def tally(key, blocks: int, token_wise: float, block_rule: float, realised: int) -> None:
        row = sums.setdefault(key, [0, 0.0, 0.0, 0])
        for i, value in enumerate((blocks, token_wise, block_rule, realised)):
            row[i] += value

    def measuring(key):
        def rule(target, block, generator):
            token_wise, block_rule = expected_accepted(target.double(), block)
            outcome = rejection_sample(target, block, generator)
            tally(key, int(block.tokens.shape[0]), float(token_wise.sum()), float(block_rule.sum()),
                  int(outcome.accepted.sum()))
            return outcome
        return rule

    def measuring_tree(key):
        def walk(shape, tokens, p_rows, q_at, generator, distinct):
            rrs, traversal = expected_path_lengths(shape, tokens, p_rows.double(),
                                                   {n: q.double() for n, q in q_at.items()}, distinct)
            outcome = sampled_walk(shape, tokens, p_rows, q_at, generator, distinct)
            tally(key, 1, rrs, traversal, len(outcome[0]))
            return outcome
        return walk

    def generate(k, config, ids, hooks):
        if isinstance(k, str):
            tree_generate(verifier, drafter, ids, config, k, steering=hooks)
        else:
            speculative_generate(verifier, drafter, ids, config, FixedK(k), steering=hooks)

    start = time.perf_counter()
    jobs = [(name, p, s, k) for name in args.sets.split(",")
            for p in load_eval_set(name)[:args.prompts] for s in seeds for k in ks + trees]
    for name, prompt, seed, k in tqdm(jobs, desc="generations", file=sys.stderr):
        ids = tokenizer(prompt["prompt"], add_special_tokens=False)["input_ids"]
        config = DecodeConfig(max_new_tokens=args.max_new_tokens, seed=seed, draft_top_k=args.draft_top_k,
                              sampling=SamplingParams(temperature=args.temperature), eos_token_ids=pair.eos,
                              max_length=2048)
        verifying.rejection_sample = measuring((name, k))
        tree_decoding.sampled_walk = measuring_tree((name, k))
        try:
            with pair.steering() as hooks:
                generate(k, config, ids, hooks)
        finally:
            verifying.rejection_sample = rejection_sample
            tree_decoding.sampled_walk = sampled_walk
    rows = []
    for (name, k), (blocks, token_wise, block_rule, realised) in sorted(sums.items(), key=lambda kv: str(kv[0])):
        rows.append({"set": name, "k": k, "blocks": blocks, "tau_token": round(1 + token_wise / blocks, 4),
                     "tau_block": round(1 + block_rule / blocks, 4), "tau_realised": round(1 + realised / blocks, 4),
                     "gain": round((1 + block_rule / blocks) / (1 + token_wise / blocks) - 1, 4)})
    table = Table(title=f"block verification vs token-wise, {args.drafter} -> {args.verifier}, T={args.temperature:g}")
    for col in ("set", "k or tree", "blocks", "τ token-wise (trees: RRS)", "τ block (trees: traversal)", "gain",
                "τ realised (token-wise)"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["set"], str(r["k"]), str(r["blocks"]), f"{r['tau_token']:.3f}", f"{r['tau_block']:.3f}",
                      f"{100 * r['gain']:+.1f}%", f"{r['tau_realised']:.3f}")
    Console(width=140).print(table)
    if args.out:
        report = {"command": "python scripts/bench_block_verify.py " + shlex.join(argv or sys.argv[1:]),
                  "config": vars(args), "elapsed_s": round(time.perf_counter() - start, 1), "rows": rows}
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

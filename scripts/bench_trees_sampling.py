"""Draft trees against fixed k at T > 0, in process: tokens per second and tau over seeds.

    python scripts/bench_trees_sampling.py --drafter smollm2-sd2 --set fresh --prompts 16 --seeds 0,1 \
        --ks 2,3,4 --trees "0,1,2,00,10;0,1,00,10;0,1,00,000;0,1,2,3,00" --threads 2 --out trees-t1.json

Trees draw a node's siblings without replacement (recursive rejection sampling); `--iid` adds each
tree with i.i.d. siblings (SpecInfer) for comparison. `steerspec bench engine --trees` measures trees greedily (every row must give the verifier's tokens);
sampled outputs differ between methods by design, so this script reports speed and tau only: the
exactness of sampling on trees is tests/decoding/test_trees.py's chi-square test. Each prompt and seed runs
every method in turn (round robin), an SD² drafter steered in every row; tok/s = tokens / wall seconds
summed over prompts and seeds; speedup against the verifier alone sampling in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier", default="smollm2")
    parser.add_argument("--drafter", default="smollm2-sd2")
    parser.add_argument("--set", default="fresh", help="bundled eval set")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--ks", default="2,3,4")
    parser.add_argument("--trees", default="default")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--draft-top-k", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iid", action="store_true",
                        help="also run every tree with siblings drawn i.i.d. (SpecInfer) beside without replacement")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from real_pair import load_pair, parse_lists
    from steerspec.data.evalsets import load_eval_set
    from steerspec.decoding.engine import DecodeConfig, autoregressive_generate, speculative_generate
    from steerspec.policies import FixedK
    from steerspec.decoding.sampling import SamplingParams
    from steerspec.decoding.tree_decoding import tree_generate

    if args.temperature <= 0:
        print("bench_trees_sampling.py: --temperature must be > 0 (greedy trees: steerspec bench engine --trees)",
              file=sys.stderr)
        return 2
    lists = parse_lists(args, "bench_trees_sampling.py")
    if lists is None:
        return 2
    seeds, ks, trees = lists
    pair = load_pair(args.verifier, args.drafter, args.threads)
    v, d = pair.verifier, pair.drafter
    prompts = [pair.tokenizer(p["prompt"], add_special_tokens=False)["input_ids"]
               for p in load_eval_set(args.set)[:args.prompts]]
    methods = {"verifier alone": lambda ids, c, h: autoregressive_generate(v, ids, c)}
    for k in ks:
        methods[f"k={k}"] = lambda ids, c, h, k=k: speculative_generate(v, d, ids, c, FixedK(k), steering=h)
    for spec in trees:
        methods[f"tree={spec}"] = lambda ids, c, h, s=spec: tree_generate(v, d, ids, c, s, steering=h)
        if args.iid:
            methods[f"tree={spec} iid"] = lambda ids, c, h, s=spec: tree_generate(v, d, ids, c, s, steering=h,
                                                                                distinct=False)
    totals = {m: {"wall_s": 0.0, "tokens": 0, "rounds": 0} for m in methods}
    params = SamplingParams(temperature=args.temperature)
    for seed in seeds:
        for i, ids in enumerate(prompts):
            config = DecodeConfig(max_new_tokens=args.max_new_tokens, sampling=params, seed=seed,
                                  draft_top_k=args.draft_top_k, eos_token_ids=pair.eos, max_length=2048)
            for name, fn in methods.items():
                with pair.steering() as steering:
                    t0 = time.perf_counter()
                    result = fn(ids, config, steering)
                    totals[name]["wall_s"] += time.perf_counter() - t0
                totals[name]["tokens"] += len(result.token_ids)
                totals[name]["rounds"] += result.rounds
            print(f"  seed {seed} prompt {i + 1}/{len(prompts)} done", file=sys.stderr)
    base = totals["verifier alone"]["tokens"] / totals["verifier alone"]["wall_s"]
    rows = []
    print(f"{'method':36s} {'tok/s':>7s} {'speedup':>8s} {'tau':>6s}")
    for name, t in totals.items():
        tps = t["tokens"] / t["wall_s"]
        rows.append({"method": name, "tokens_per_s": tps, "speedup": tps / base, "tau": t["tokens"] / t["rounds"], **t})
        print(f"{name:36s} {tps:7.1f} {tps / base:7.2f}x {t['tokens'] / t['rounds']:6.2f}")
    if args.out:
        from steerspec.bench.host import host_info

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "machine": host_info(verifier=v, drafter=d),
                                             "args": vars(args), "results": rows}, indent=2))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Check that bfloat16 greedy output with batch-invariant verification equals the verifier alone's, token for token:
every `fresh` prompt and the first 16 `indist` ones, 64 new tokens, chain k = 4 and the default tree, in process and
(with --services) through LocalCluster; with --off, how many depart without invariance. Writes JSON (--out).

    python scripts/check_invariant_greedy.py --out docs/results/data/invariance/greedy-check.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import torch

from coordinator.local import LocalCluster
from steerspec.bench.host import host_info
from steerspec.data.evalsets import load_eval_set
from steerspec.decoding.engine import DecodeConfig, autoregressive_generate, speculative_generate
from steerspec.decoding.tree_decoding import tree_generate
from steerspec.models import cached_lm, load_model, load_tokenizer
from steerspec.models.invariant_pass import InvariantPlan, set_invariant
from steerspec.policies import FixedK


def first_departure(got, want) -> int:
    """The index of the first differing token (-1: equal)."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return -1 if len(got) == len(want) else min(len(got), len(want))


async def through_services(prompts, tokens: int):
    """(chain, tree) outputs of every prompt through a LocalCluster with an invariant bfloat16 verifier."""
    chain, tree = [], []
    async with LocalCluster(verifier="smollm2", drafter="smollm2-sd2", dtype="bfloat16", invariant="on",
                            eos_ids=()) as cluster:
        for ids in prompts:
            chain.append(list((await cluster.generate(ids, max_new_tokens=tokens, k=4, steering=cluster.steering)).token_ids))
            tree.append(list((await cluster.generate(ids, max_new_tokens=tokens, tree="default",
                                                     steering=cluster.steering)).token_ids))
    return chain, tree


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--indist", type=int, default=16)
    parser.add_argument("--fresh", type=int, default=0, help="fresh prompts (0: all)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--services", action="store_true", help="also through LocalCluster")
    parser.add_argument("--off", action="store_true", help="also count departures without invariance")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tok = load_tokenizer("smollm2")
    rows = load_eval_set("fresh")[: args.fresh or None] + load_eval_set("indist")[: args.indist]
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"][-128:] for r in rows]
    verifier, drafter = load_model("smollm2", dtype="bfloat16"), load_model("smollm2-sd2", dtype="bfloat16")
    config = DecodeConfig(max_new_tokens=args.tokens)
    report = {"machine": host_info(), "prompts": len(prompts), "tokens": args.tokens, "threads": args.threads}
    modes = [("on", InvariantPlan())] + ([("off", None)] if args.off else [])
    for name, plan in modes:
        set_invariant(verifier, plan)
        v, d = cached_lm(verifier), cached_lm(drafter)
        t0 = time.perf_counter()
        alone = [autoregressive_generate(v, ids, config).token_ids for ids in prompts]
        chain = [speculative_generate(v, d, ids, config, FixedK(4)).token_ids for ids in prompts]
        tree = [tree_generate(v, d, ids, config, "default").token_ids for ids in prompts]
        result = {"chain_k4_departures": [first_departure(c, a) for c, a in zip(chain, alone)],
                  "tree_departures": [first_departure(t, a) for t, a in zip(tree, alone)], "seconds": time.perf_counter() - t0}
        result["chain_equal"] = sum(x == -1 for x in result["chain_k4_departures"])
        result["tree_equal"] = sum(x == -1 for x in result["tree_departures"])
        if name == "on" and args.services:
            s_chain, s_tree = asyncio.run(through_services(prompts, args.tokens))
            result["services_chain_equal"] = sum(c == a for c, a in zip(s_chain, alone))
            result["services_tree_equal"] = sum(t == a for t, a in zip(s_tree, alone))
        report[f"invariant_{name}"] = result
        print(name, {k: v for k, v in result.items() if not k.endswith("departures")}, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

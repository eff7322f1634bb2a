"""The drafter in float32 against bfloat16 (the verifier float32 in both), in process, interleaved per prompt.

    python scripts/ab_drafter_dtype.py --set fresh --prompts 16 --temperature 0 --draft 3 --out ab-greedy.json
    python scripts/ab_drafter_dtype.py --set fresh --prompts 16 --temperature 1 --draft default --out ab-tree.json
    python scripts/ab_drafter_dtype.py --set fresh --prompts 8 --temperature 1 --draft default --services --rtt-ms 50

With --services the same runs go through the gRPC services (`coordinator.local.LocalCluster`, one per drafter dtype
sharing the verifier's weights, the coordinator↔verifier link emulated at --rtt-ms), the verifier alone through
the first one's services, one token per round trip, as `steerspec bench remote` measures it.

For each prompt the verifier alone and the speculative decoder with each drafter dtype run back to back, the order
alternating between prompts, so a change in the host's speed hits every row alike; an SD² drafter is steered (its
W_s in the drafter's dtype). Reports tokens/s, the speedup over the verifier alone, tau and the drafting and
verifying milliseconds per round, and at T = 0 whether each dtype gave the verifier's own tokens. `--draft` is a
fixed k or a draft tree (`default` or rank paths). A bfloat16 drafter reads oneDNN-packed copies only on a CPU
with native bf16 (`steerspec.models.layouts.native_bf16`); elsewhere it is measured on its plain weights.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

DTYPES = ("float32", "bfloat16")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier", default="smollm2")
    parser.add_argument("--drafter", default="smollm2-sd2")
    parser.add_argument("--set", default="fresh", help="bundled eval set")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--draft", default="3", help="a fixed k, or a draft tree ('default' or rank paths)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--services", action="store_true", help="through the gRPC services (LocalCluster)")
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="emulated coordinator-verifier round trip (--services)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from coordinator.cli import load_tokenizer_and_eos
    from steerspec.decoding.engine import DecodeConfig, autoregressive_generate, speculative_generate
    from steerspec.models import load_model
    from steerspec.models.backends import as_cached
    from steerspec.models.layouts import native_bf16
    from steerspec.models.checkpoints import resolve_model_dir
    from steerspec.policies.fixed import FixedK
    from steerspec.decoding.sampling import SamplingParams
    from steerspec.steering.runtime import maybe_steering
    from steerspec.decoding.tree_decoding import tree_generate

    vdir, ddir = resolve_model_dir(args.verifier), resolve_model_dir(args.drafter)
    tokenizer, eos = load_tokenizer_and_eos(str(vdir))
    verifier = as_cached(load_model(vdir))
    drafters = {dt: as_cached(load_model(ddir, dtype=dt)) for dt in DTYPES}
    steering = {dt: maybe_steering(drafters[dt].model, ddir) for dt in DTYPES}
    eval_file = Path(__file__).resolve().parent.parent / "steerspec" / "assets" / "eval" / f"{args.set}.jsonl"
    texts = [json.loads(line)["prompt"] for line in eval_file.read_text().splitlines() if line.strip()]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts[: args.prompts]]

    def generate(name: str, ids, seed: int, max_new_tokens: int):
        config = DecodeConfig(max_new_tokens=max_new_tokens, draft_top_k=64, seed=seed, eos_token_ids=eos,
                              sampling=SamplingParams(args.temperature, 0, 1.0))
        if name == "verifier alone":
            return autoregressive_generate(verifier, ids, config)
        if args.draft.isdigit():
            return speculative_generate(verifier, drafters[name], ids, config, policy=FixedK(int(args.draft)),
                                        steering=steering[name])
        return tree_generate(verifier, drafters[name], ids, config, args.draft, steering=steering[name])

    names = ("verifier alone", *DTYPES)
    totals = {name: {"tokens": 0, "wall_s": 0.0, "rounds": 0, "draft_s": 0.0, "verify_s": 0.0} for name in names}
    same = {dt: 0 for dt in DTYPES}

    def record(name: str, result, wall_s: float, outputs: dict) -> None:
        row = totals[name]
        row["wall_s"] += wall_s
        row["tokens"] += len(result.token_ids)
        row["rounds"] += result.rounds
        blocks = getattr(result, "blocks", None)
        if blocks is not None:  # through the services: the coordinator's per-block stages
            row["draft_s"] += sum(b.draft_ms for b in blocks) / 1e3
            row["verify_s"] += sum(b.verify_ms for b in blocks) / 1e3
        else:
            row["draft_s"] += result.draft_s
            row["verify_s"] += result.verify_s
        outputs[name] = result.token_ids

    if args.services:
        import asyncio

        asyncio.run(_through_services(args, verifier.model, ddir, str(vdir), eos, prompts, names, record, same))
    else:
        for name in names:  # warm-up, not timed
            generate(name, prompts[0][:16], 99, 8)
        for i, ids in enumerate(prompts):
            outputs = {}
            for name in (names if i % 2 == 0 else names[::-1]):
                start = time.perf_counter()
                result = generate(name, ids, i, args.max_new_tokens)
                record(name, result, time.perf_counter() - start, outputs)
            for dt in DTYPES:
                same[dt] += outputs[dt] == outputs["verifier alone"]
    alone = totals["verifier alone"]["tokens"] / totals["verifier alone"]["wall_s"]
    rows = []
    where = f"services, RTT {args.rtt_ms:g} ms" if args.services else "in process"
    print(f"{args.set}, {len(prompts)} prompts x {args.max_new_tokens} tokens, T={args.temperature:g}, draft {args.draft}, "
          f"{where}, native bf16: {native_bf16()}")
    for name, t in totals.items():
        row = {"drafter_dtype": None if name == "verifier alone" else name,
               "tokens_per_s": round(t["tokens"] / t["wall_s"], 2),
               "speedup": round(t["tokens"] / t["wall_s"] / alone, 3), "tau": round(t["tokens"] / t["rounds"], 3),
               "draft_ms_per_round": round(t["draft_s"] / t["rounds"] * 1e3, 2),
               "verify_ms_per_round": round(t["verify_s"] / t["rounds"] * 1e3, 2)}
        if name in same and args.temperature == 0:
            row["greedy_equal_prompts"] = same[name]
        rows.append(row)
        print(f"  {name:15s} {row['tokens_per_s']:7.2f} tok/s  {row['speedup']:.3f}x  tau {row['tau']:.3f}  draft "
              f"{row['draft_ms_per_round']:6.2f} ms  verify {row['verify_ms_per_round']:6.2f} ms per round"
              + (f"  verifier's tokens on {row['greedy_equal_prompts']}/{len(prompts)}" if "greedy_equal_prompts" in row else ""))
    if args.out:
        report = {"command": "python scripts/ab_drafter_dtype.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
                  "native_bf16": native_bf16(), "threads": args.threads, "set": args.set, "prompts": len(prompts),
                  "temperature": args.temperature, "draft": args.draft, "services": args.services,
                  "rtt_ms": args.rtt_ms if args.services else None, "rows": rows}
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


async def _through_services(args, verifier_model, drafter_dir, tokenizer_dir, eos, prompts, names, record, same):
    """The same interleaved runs through one LocalCluster per drafter dtype (the verifier's weights shared)."""
    from contextlib import AsyncExitStack

    from coordinator.local import LocalCluster
    from steerspec.serving.linkemu import LinkModel

    link = LinkModel(rtt_ms=args.rtt_ms).validate()
    tree = "" if args.draft.isdigit() else args.draft
    k = int(args.draft) if args.draft.isdigit() else 4
    async with AsyncExitStack() as stack:
        clusters = {dt: await stack.enter_async_context(LocalCluster(
            verifier_model, str(drafter_dir), link=link, tokenizer=tokenizer_dir, eos_ids=list(eos), drafter_dtype=dt))
            for dt in names[1:]}

        async def generate(name: str, ids, seed: int, max_new_tokens: int):
            cluster = clusters[names[1] if name == names[0] else name]
            return await cluster.generate(ids, max_new_tokens=max_new_tokens, temperature=args.temperature, seed=seed,
                                          k=k, draft_top_k=64, steering=cluster.steering and name != names[0],
                                          tree="" if name == names[0] else tree,
                                          mode="autoregressive" if name == names[0] else "speculative")

        for name in names:  # warm-up, not timed
            await generate(name, prompts[0], 99, 4)
        for i, ids in enumerate(prompts):
            outputs = {}
            for name in (names if i % 2 == 0 else names[::-1]):
                result = await generate(name, ids, i, args.max_new_tokens)
                record(name, result, result.wall_s, outputs)
            for dt in names[1:]:
                same[dt] += outputs[dt] == outputs[names[0]]


if __name__ == "__main__":
    sys.exit(main())

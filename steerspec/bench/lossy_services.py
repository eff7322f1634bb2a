"""`steerspec bench sprinter --services`: exact vs SPRINTER tokens/s measured through the real services.

One LocalCluster (verifier, drafter and a coordinator started with allow_lossy, gRPC on 127.0.0.1)
per run; the coordinator↔verifier link is emulated by steerspec/serving/linkemu.py at each --services-rtts
value. For every (prompt, seed) the configurations run back to back (exact with fixed k, exact under
each draft-length policy of --policies, then SPRINTER at each threshold), so load drifts on a shared machine hit them alike; tokens/s is
generated tokens over the summed wall time of each configuration's generations, and the speedup
is its ratio to exact's at the same RTT, measured in the same run (not modelled).
"""

from __future__ import annotations

import time
from typing import Dict, List, Sequence

from coordinator.local import LocalCluster
from steerspec.serving.linkemu import LinkModel
from steerspec.sprinter.labels import SprinterTally

SPRINTER = "sprinter@"  # row names of SPRINTER's configurations: sprinter@<threshold>


async def measure(verifier, drafter, prompts: Sequence[Sequence[int]], *, seeds: int, rtts: Sequence[float],
                  thresholds: Sequence[float], max_run: int, k: int, max_new_tokens: int, temperature: float,
                  eos: Sequence[int], sprinter_head=None, policies: Sequence[str] = ()
                  ) -> Dict[str, Dict[str, Dict[str, float]]]:
    """{f"{rtt:g}": {config: {tokens, verifier_calls, wall_s, tokens_per_s, tokens_per_call, speedup}}}; SPRINTER
    configurations also carry the verifier's labels pooled over their runs (`SprinterTally.theory`: eta_tp,
    eta_fp, tv_pq, tv_bound, tv_measured, mean_run_length, expected_run_length)."""
    # name -> (verification, draft-length policy); the policy rows are exact too
    configs = {"exact": ("exact", "fixed"), **{spec: ("exact", spec) for spec in policies},
               **{f"{SPRINTER}{t:g}": (f"sprinter:threshold={t:g},max_run={max_run}", "fixed") for t in thresholds}}
    options = {"sprinter_head": str(sprinter_head)} if sprinter_head else {}
    out: Dict[str, Dict[str, Dict[str, float]]] = {}
    async with LocalCluster(verifier, drafter, tokenizer=None, eos_ids=tuple(eos), allow_lossy=True,
                            drafter_options=options) as cluster:
        for spec, policy in configs.values():  # warm-up: the heads load, the caches allocate
            await cluster.generate(prompts[0], max_new_tokens=4, k=k, temperature=temperature, verification=spec,
                                   policy=policy, steering=cluster.steering)
        for rtt in rtts:
            cluster.set_link(LinkModel(rtt_ms=rtt).validate())
            sums = {name: {"tokens": 0, "verifier_calls": 0, "wall_s": 0.0} for name in configs}
            tallies: Dict[str, List[SprinterTally]] = {name: [] for name in configs}
            for i, ids in enumerate(prompts):
                for s in range(seeds):
                    for name, (spec, policy) in configs.items():
                        start = time.perf_counter()
                        result = await cluster.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                                        seed=1000 * i + s, k=k, verification=spec, policy=policy,
                                                        steering=cluster.steering, timeout=600)
                        row = sums[name]
                        row["wall_s"] += time.perf_counter() - start
                        row["tokens"] += result.generated
                        row["verifier_calls"] += result.rounds
                        if result.sprinter is not None:
                            tallies[name].append(result.sprinter)
            for row in sums.values():
                row["tokens_per_s"] = row["tokens"] / row["wall_s"] if row["wall_s"] > 0 else 0.0
                row["tokens_per_call"] = row["tokens"] / max(1, row["verifier_calls"])
            for name, row in sums.items():
                row["speedup"] = row["tokens_per_s"] / sums["exact"]["tokens_per_s"]
                if tallies[name]:
                    row.update(SprinterTally.pooled(tallies[name], max_run).theory())
            out[f"{rtt:g}"] = sums
    return out


def table(rows: Dict[str, Dict[str, Dict[str, float]]]) -> List[str]:
    """Printable lines: one per (RTT, configuration)."""
    lines = ["rtt_ms | config | tokens | verifier calls | tok/call | tok/s | speedup vs exact | eta_tp | eta_fp | "
             "thm1 bound | tv measured | run length (measured / thm2)"]
    for rtt, configs in rows.items():
        for name, r in configs.items():
            theory = (f"{r['eta_tp']:.3f} | {r['eta_fp']:.3f} | {r['tv_bound']:.3f} | {r['tv_measured']:.3f} | "
                      f"{r['mean_run_length']:.2f} / {r['expected_run_length']:.2f}") if "eta_tp" in r else "- | - | - | - | -"
            lines.append(f"{rtt} | {name} | {r['tokens']} | {r['verifier_calls']} | {r['tokens_per_call']:.2f} | "
                         f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f} | {theory}")
    return lines

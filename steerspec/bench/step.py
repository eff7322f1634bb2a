"""`steerspec bench step`: per-step latencies of drafting and verifying, per dtype, next to the
floor of the same models under HF StaticCache (+ `torch.compile(mode="reduce-overhead")` on CUDA).

Rows (median ms over --iters after --warmup, each timed to completion on the device):
- drafter one-token step: `fast` (FastCachedLM), `graphed` (GraphedLM: CUDA graph on a GPU),
  floor (HF StaticCache, compiled on CUDA);
- verifier k+1 extend: the same three, and the floor's one-token step;
- `draft_block` k at --temperature and `verify_block` k: the host-sampling path
  (STEERSPEC_DEVICE_SAMPLING=0, fast cache) and the device path (fastpath, graphed cache).
Each call starts from the same cached prefix (rolled back between calls), so every row times
the same work. Ratios are against the floor measured in the same run.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from rich.console import Console
from rich.table import Table
from torch.profiler import ProfilerActivity, profile

from steerspec.bench.host import host_info
from steerspec.cli.run import add_model_arguments
from steerspec.decoding import fastpath
from steerspec.decoding.engine import DecodeConfig, draft_block, make_generators, verify_block
from steerspec.decoding.sampling import SamplingParams
from steerspec.errors import UsageError
from steerspec.models import load_model
from steerspec.models.checkpoints import resolve_model_dir
from steerspec.models.dtype_choice import resolve as resolve_dtype
from steerspec.models.graphed import GraphedLM, StaticKVPool
from steerspec.models.kv import FastCachedLM
from steerspec.models.loading import cache_kwarg, resolve_device

DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtypes", default=None,
                        help="comma-separated dtypes to measure (default: --dtype); e.g. float32,bfloat16,float16")
    parser.add_argument("--k", type=int, default=8, help="draft length of the blocks (default: 8)")
    parser.add_argument("--temperature", type=float, default=1.0, help="of draft_block/verify_block (default: 1)")
    parser.add_argument("--draft-top-k", type=int, default=64, help="draft support (default: 64)")
    parser.add_argument("--prefix", type=int, default=128, help="cached prefix length in tokens (default: 128)")
    parser.add_argument("--iters", type=int, default=50, help="timed calls per row (default: 50)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls first (default: 5)")
    parser.add_argument("--floor", default="auto", choices=("auto", "compile", "eager", "none"),
                        help="HF StaticCache floor: compiled (reduce-overhead), eager, none; auto = compile on "
                             "CUDA, eager on a CPU")
    parser.add_argument("--profile", type=int, default=0,
                        help="also profile N draft+verify blocks per path: kernel launches, syncs, copies (default: 0)")
    parser.add_argument("--out", default="bench-results/step.json", help="JSON output path")
    add_model_arguments(parser)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int) -> Dict[str, float]:
    """Median and p90 ms of fn(), each call timed to completion on the device."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"median_ms": round(statistics.median(times), 4), "p90_ms": round(times[int(0.9 * (len(times) - 1))], 4)}


PROFILE_GROUPS = {
    "kernel_launches": ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch"),
    "graph_launches": ("cudaGraphLaunch",),
    "syncs": ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"),
    "copies": ("cudaMemcpyAsync", "cudaMemcpy"),
    "item_calls": ("aten::item", "aten::_local_scalar_dense"),
    "multinomial": ("aten::multinomial",),
}


def profile_calls(calls: List[Callable[[], Any]], device: torch.device, blocks: int) -> Dict[str, Any]:
    """Run each call `blocks` times under torch.profiler; count launches, syncs, copies, `.item()`s,
    and total CPU and device time (ms) — where a block's time goes."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(blocks):
            for call in calls:
                call()
        _sync(device)
    wall = (time.perf_counter() - t0) * 1e3
    events = prof.key_averages()
    counts = {name: sum(e.count for e in events if e.key in keys) for name, keys in PROFILE_GROUPS.items()}
    device_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events)
    return {"blocks": blocks, **counts, "wall_ms": round(wall, 2), "device_ms": round(device_us / 1e3, 2)}


@contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


class HFFloor:
    """HF StaticCache over one model, fed n tokens per call. transformers 5.x advances the cache's
    own position (every call costs the same: StaticCache attends over its whole length, so
    `calls` sizes it); 4.x takes `cache_position`, fixed here, so each call rewrites the same slots."""

    def __init__(self, model, prefix: int, n: int, calls: int, compile_mode: Optional[str]) -> None:
        # lazy: transformers takes seconds to import
        from transformers import StaticCache


        self.device = model.device
        capacity = prefix + n * (calls + 2)
        try:
            self.cache = StaticCache(config=model.config, max_cache_len=capacity)
        except TypeError:  # transformers 4.x
            self.cache = StaticCache(config=model.config, max_batch_size=1, max_cache_len=capacity,
                                     device=self.device, dtype=model.dtype)
        params = inspect.signature(model.forward).parameters
        key = cache_kwarg(model)
        fixed = "cache_position" in params
        ids = torch.arange(3, 3 + prefix, device=self.device).view(1, -1) % model.config.vocab_size
        extra = {"cache_position": torch.arange(prefix, device=self.device)} if fixed else {}
        with torch.inference_mode():
            model(input_ids=ids, use_cache=True, **{key: self.cache}, **extra)
        self.ids = torch.full((1, n), 7, dtype=torch.long, device=self.device)
        self.positions = torch.arange(prefix, prefix + n, device=self.device) if fixed else None
        cache = self.cache

        def forward(ids, positions):
            extra = {} if positions is None else {"cache_position": positions}
            return model(input_ids=ids, use_cache=True, **{key: cache}, **extra).logits

        self.forward = torch.compile(forward, mode=compile_mode, fullgraph=True) if compile_mode else forward

    @torch.inference_mode()
    def step(self) -> torch.Tensor:
        return self.forward(self.ids, self.positions)


def _measure_dtype(args, dtype: str) -> Dict[str, Any]:
    verifier = load_model(args.verifier, dtype=dtype, device=args.device)
    drafter = load_model(args.drafter, dtype=dtype, device=args.device)
    device = verifier.device
    k, prefix = args.k, args.prefix
    capacity = prefix + 2 * k + 16
    prompt = [(3 + i) % drafter.config.vocab_size for i in range(prefix + 1)]
    timer = lambda fn: time_calls(fn, device, args.iters, args.warmup)  # noqa: E731
    rows: Dict[str, Dict[str, Any]] = {}

    def lms(model):
        fast = FastCachedLM(model, capacity=capacity)
        graphed = GraphedLM(model, StaticKVPool(model, slots=1, capacity=capacity))
        for lm in (fast, graphed):
            lm.extend(prompt[:-1])
        return fast, graphed

    d_fast, d_graphed = lms(drafter)
    v_fast, v_graphed = lms(verifier)
    token = torch.tensor([7], device=device)
    block_feed = torch.full((k + 1,), 7, dtype=torch.long, device=device)

    def step(lm, feed):
        def call():
            lm.extend(feed, logits_to_keep=1 if feed.numel() == 1 else 0)
            lm.rollback(prefix)
        return call

    rows["drafter_step"] = {"fast": timer(step(d_fast, token)), "graphed": timer(step(d_graphed, token))}
    rows["verifier_extend"] = {"fast": timer(step(v_fast, block_feed)), "graphed": timer(step(v_graphed, block_feed))}
    rows["verifier_step"] = {"fast": timer(step(v_fast, token)), "graphed": timer(step(v_graphed, token))}

    config = DecodeConfig(sampling=SamplingParams(temperature=args.temperature), draft_top_k=args.draft_top_k)
    g_draft, g_verify = make_generators(0, device, device)

    def drafting(lm, device_path: bool):
        def call():
            if device_path:
                fastpath.draft_block(lm, prompt, k, config, g_draft)
            else:
                with _env("STEERSPEC_DEVICE_SAMPLING", "0"):
                    draft_block(lm, prompt, k, config, g_draft)
            lm.rollback(prefix)
        return call

    rows["draft_block"] = {"host": timer(drafting(d_fast, False)), "device": timer(drafting(d_graphed, True))}
    d_fast.rollback(prefix)
    with _env("STEERSPEC_DEVICE_SAMPLING", "0"):
        block = draft_block(d_fast, prompt, k, config, g_draft)
    d_fast.rollback(prefix)

    def verifying(lm, device_path: bool):
        def call():
            if device_path:
                fastpath.verify_block(lm, prompt[-1], block, config, g_verify)
            else:
                with _env("STEERSPEC_DEVICE_SAMPLING", "0"):
                    verify_block(lm, prompt[-1], block, config, g_verify)
            lm.rollback(prefix)
        return call

    rows["verify_block"] = {"host": timer(verifying(v_fast, False)), "device": timer(verifying(v_graphed, True))}
    profile = None
    if args.profile > 0:
        profile = {
            "host": profile_calls([drafting(d_fast, False), verifying(v_fast, False)], device, args.profile),
            "device": profile_calls([drafting(d_graphed, True), verifying(v_graphed, True)], device, args.profile),
        }

    floor_mode = args.floor if args.floor != "auto" else ("compile" if device.type == "cuda" else "eager")
    if floor_mode != "none":
        compile_mode = "reduce-overhead" if floor_mode == "compile" else None
        for name, model, n in (("drafter_step", drafter, 1), ("verifier_extend", verifier, k + 1),
                               ("verifier_step", verifier, 1)):
            try:
                floor = HFFloor(model, prefix, n, args.iters + args.warmup, compile_mode)
                rows[name]["floor"] = timer(floor.step)
            except Exception as exc:  # a floor that cannot compile here is reported, not fatal
                rows[name]["floor"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            if compile_mode:
                torch._dynamo.reset()
    for name, row in rows.items():
        best = row.get("graphed", row.get("device"))
        floor = row.get("floor", {}).get("median_ms")
        if floor and best:
            row["vs_floor"] = round(best["median_ms"] / floor, 2)
    return {"dtype": dtype, "floor": floor_mode, "rows": rows, "profile": profile}


def _table(report: Dict[str, Any]):
    table = Table(title=f"steerspec bench step — {report['config']['device']} ({report['machine']['gpu'] or 'CPU'}), "
                        f"k={report['config']['k']}, T={report['config']['temperature']}, median ms")
    for col in ("dtype", "what", "SteerSpec before", "SteerSpec now", "floor", "now / floor"):
        table.add_column(col, justify="right" if col not in ("dtype", "what") else "left", no_wrap=True)
    for entry in report["dtypes"]:
        for name, row in entry["rows"].items():
            before = row.get("fast", row.get("host", {})).get("median_ms")
            now = row.get("graphed", row.get("device", {})).get("median_ms")
            floor = row.get("floor", {})
            floor_s = floor.get("median_ms", "error" if "error" in floor else "—")
            table.add_row(entry["dtype"], name, f"{before:.3f}", f"{now:.3f}",
                          floor_s if isinstance(floor_s, str) else f"{floor_s:.3f}", str(row.get("vs_floor", "—")))
    return table


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)  # a bad or absent device: one line, exit 2, before loading
    if args.threads > 0:  # before `auto` is timed: at the threads the steps run at
        torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, args.verifier, device, None) if not args.dtypes else ""
    dtypes = [d.strip() for d in (args.dtypes or dtype).split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise UsageError(f"--dtypes takes {', '.join(DTYPES)}; got {args.dtypes!r}")
    if args.k < 1 or args.k > 64 or args.iters < 1 or args.warmup < 0 or args.prefix < 1:
        raise UsageError("--k must be 1..64, --iters >= 1, --warmup >= 0, --prefix >= 1")
    args.verifier, args.drafter = str(resolve_model_dir(args.verifier)), str(resolve_model_dir(args.drafter))
    args.device = str(device)
    started = time.time()
    report: Dict[str, Any] = {
        "command": f"steerspec bench step --dtypes {','.join(dtypes)} --k {args.k} --temperature {args.temperature} "
                   f"--draft-top-k {args.draft_top_k} --prefix {args.prefix} --iters {args.iters} "
                   f"--floor {args.floor} --profile {args.profile} --device {args.device}",
        "config": {"verifier": args.verifier, "drafter": args.drafter, "device": args.device, "k": args.k,
                   "temperature": args.temperature, "draft_top_k": args.draft_top_k, "prefix": args.prefix,
                   "iters": args.iters, "warmup": args.warmup},
        "machine": {**host_info(), "platform": platform.platform(), "torch": torch.__version__, "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(),
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "dtypes": [],
    }
    for dtype in dtypes:
        report["dtypes"].append(_measure_dtype(args, dtype))
    report["elapsed_s"] = round(time.time() - started, 1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    console = Console(width=max(Console().width, 120))  # logs (no terminal) keep the columns whole
    console.print(_table(report))
    for entry in report["dtypes"]:
        for path, counts in (entry.get("profile") or {}).items():
            console.print(f"profile {entry['dtype']} {path}: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    return 0

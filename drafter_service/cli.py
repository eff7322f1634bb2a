"""Serve an edge drafter: proposes draft blocks over gRPC (DrafterService), with optional SD² steering."""

from __future__ import annotations

import argparse
import asyncio
import os

import torch

from drafter_service import ahead_args
from drafter_service.server import DrafterConfig, serve
from steerspec.errors import UsageError
from steerspec.models.checkpoints import resolve_model_dir
from steerspec.models.layouts import drafter_dtype
from steerspec.models.loading import load_model
from steerspec.observability import service_metrics
from steerspec.observability.tracing import instrument_grpc, setup_tracing
from steerspec.policies import PolicyError, parse_spec
from steerspec.serving import logs, registration, security
from steerspec.serving.grpc_common import check_port, serve_until_signal
from steerspec.steering import attach_steering, has_steering, load_steering


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    parser.add_argument("--port", type=int, default=50062, help="port to bind (0 = any free port)")
    parser.add_argument("--model", default="pretrained", help="bundled name or local checkpoint directory")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "auto"],
                        help="auto: bfloat16 on a CPU with native bf16, else float32 (acceptance only; output exact)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto")
    parser.add_argument("--steering", default="auto",
                        help="SD² steering weights: 'auto' (from the model directory when present), 'off', "
                             "or a checkpoint directory")
    parser.add_argument("--max-sessions", type=int, default=64, help="sessions served at once")
    parser.add_argument("--idle-timeout-s", type=float, default=300.0, help="expire sessions idle this long (0 = never)")
    parser.add_argument("--draft-batch-window-ms", type=float, default=1.0,
                        help="how long a draft request waits for other sessions' to draft them together in one "
                             "batched pass per step (ends early once every active session has asked; 0 = no wait)")
    parser.add_argument("--policy", default="", metavar="SPEC",
                        help="draft-length policy for sessions that name none, NAME[:key=value,...] "
                             "(default: fixed with the session's k)")
    parser.add_argument("--sprinter-head", default=None, metavar="DIR",
                        help="SPRINTER classifier head for lossy sessions (default: MODEL/sprinter)")
    parser.add_argument("--max-message-mb", type=float, default=16.0, help="largest gRPC message accepted")
    parser.add_argument("--grace-s", type=float, default=5.0, help="graceful-shutdown grace period")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    parser.add_argument("--trace-file", default=None, help="write OpenTelemetry spans as JSONL here")
    ahead_args.add_arguments(parser, serving=True)
    registration.add_arguments(parser)
    security.add_arguments(parser)
    logs.add_arguments(parser)
    service_metrics.add_arguments(parser)


def load_drafter(model: str, dtype: str, device: str, steering: str = "auto"):
    """(model, steering hooks or None); dtype "auto": `layouts.drafter_dtype("auto", "float32", device)`."""
    loaded = load_model(model, dtype=drafter_dtype(dtype, "float32", device) if dtype == "auto" else dtype, device=device)
    source = None
    if steering == "auto":
        path = resolve_model_dir(model)
        source = path if has_steering(path) else None
    elif steering not in ("off", "none", ""):
        source = steering
    if source is None:
        return loaded, None
    try:
        weights = load_steering(source, dtype=next(loaded.parameters()).dtype, device=loaded.device)  # the drafter's own
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise UsageError(f"cannot load SD² steering weights from {source}: {exc}") from exc
    return loaded, attach_steering(loaded, weights.drafter)


async def _main(args) -> int:
    if args.trace_file or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        setup_tracing("steerspec-drafter", trace_file=args.trace_file)
        instrument_grpc()
    if args.policy:
        try:
            parse_spec(args.policy)
        except PolicyError as exc:
            raise UsageError(f"--policy: {exc}") from None
    await registration.check_reachable(args.redis_url)  # before the model loads
    model, hooks = load_drafter(args.model, args.dtype, args.device, args.steering)
    config = DrafterConfig(max_sessions=args.max_sessions, idle_timeout_s=args.idle_timeout_s,
                           model_name=str(args.model), batch_window_ms=args.draft_batch_window_ms,
                           policy=args.policy, sprinter_head=args.sprinter_head, **ahead_args.drafter_options(args))
    metrics = service_metrics.start("drafter", args.metrics_port, args.metrics_host or args.host)
    running, servicer = await serve(model, config, host=args.host, port=args.port, hooks=hooks,
                                    max_message_bytes=int(args.max_message_mb * 2**20))
    if metrics is not None:
        metrics.watch_table(servicer.table, servicer.table.cache_bytes)
        metrics.watch_batcher(servicer.batcher)
    await registration.announce(running, "drafter", load=lambda: len(servicer.table), redis_url=args.redis_url,
                                advertise=args.advertise, ttl_s=args.heartbeat_ttl_s, identity=servicer.identity)
    steer = "with SD² steering" if hooks is not None else "without steering"
    print(f"steerspec drafter serving {args.model} ({steer}) on {running.target}", flush=True)
    await serve_until_signal(running, grace=args.grace_s)
    return 0


def run(args) -> int:
    check_port(args.port)
    if args.metrics_port is not None:
        check_port(args.metrics_port, "--metrics-port")
    security.configure_from_args(args, host=args.host)
    logs.setup(args.log_level, args.log_format)
    if args.max_sessions < 1:
        raise UsageError("--max-sessions must be at least 1")
    if not args.draft_batch_window_ms >= 0:
        raise UsageError(f"--draft-batch-window-ms must be >= 0, got {args.draft_batch_window_ms}")
    registration.check_args(args)
    ahead_args.check(args)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    return asyncio.run(_main(args))

"""Serve the remote verifier: batched verification of draft blocks over gRPC (VerifierService)."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket

import torch

from steerspec.errors import UsageError
from steerspec.models.checkpoints import resolve_model_dir
from steerspec.models.dtype_choice import CHOICES as DTYPE_CHOICES, resolve_path
from steerspec.models.kernel_path import MODES, apply_invariance
from steerspec.models.loading import check_swiglu, load_model, resolve_dtype
from steerspec.observability import service_metrics
from steerspec.observability.tracing import instrument_grpc, setup_tracing
from steerspec.serving import logs, registration, security
from steerspec.serving.grpc_common import check_port, serve_until_signal
from steerspec.steering import load_steering_head
from verifier_service.cache_budget import default_cache_mb
from verifier_service.server import VerifierConfig, serve


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    parser.add_argument("--port", type=int, default=50061, help="port to bind (0 = any free port)")
    parser.add_argument("--model", default="verifier", help="bundled name or local checkpoint directory")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="default: auto = bfloat16 on a CPU with native bf16 where this machine's timing (cached) "
                             "of the model's passes, batch-invariant, beats float32's; else float32")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto")
    parser.add_argument("--device-map", default=None,
                        help="passed to from_pretrained (e.g. 'auto' shards the verifier over all GPUs)")
    parser.add_argument("--max-sessions", type=int, default=64, help="sessions served at once")
    parser.add_argument("--max-cache-mb", type=float, default=None,
                        help="KV-cache memory limit; beyond it new sessions get RESOURCE_EXHAUSTED and go to another "
                             "replica (default: 80%% of the GPU's free memory, 25%% of the host's on CPU; 0 = none)")
    parser.add_argument("--batch-window-ms", type=float, default=2.0,
                        help="longest wait to batch blocks of concurrent sessions (ends early when all submitted)")
    parser.add_argument("--max-batch", type=int, default=64, help="most blocks in one forward pass")
    parser.add_argument("--prefill-chunk", type=int, default=512,
                        help="on a CPU, feed longer prompts in passes of this many tokens with the event loop "
                             "running between them (0 = one pass)")
    parser.add_argument("--kv-backend", default="auto", choices=["auto", "fast", "hf"],
                        help="sessions' KV caches: auto (the device path's graphed cache on CUDA, else the lean "
                             "fast forward), fast, or hf (transformers' forward and cache)")
    parser.add_argument("--idle-timeout-s", type=float, default=300.0, help="expire sessions idle this long (0 = never)")
    parser.add_argument("--steering-head", default=None,
                        help="SD² checkpoint directory whose steering head W_hml this verifier runs")
    parser.add_argument("--max-message-mb", type=float, default=16.0, help="largest gRPC message accepted")
    parser.add_argument("--grace-s", type=float, default=5.0, help="graceful-shutdown grace period")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    parser.add_argument("--invariant", default="auto", choices=MODES,
                        help="batch-invariant verify passes (CPU): each row bit-identical to one-token decoding. auto "
                             "(default): on for a bfloat16/float16 verifier where this machine's timing allows")
    parser.add_argument("--trace-file", default=None, help="write OpenTelemetry spans as JSONL here")
    registration.add_arguments(parser)
    security.add_arguments(parser)
    logs.add_arguments(parser)
    service_metrics.add_arguments(parser)


def load_verifier(model: str, dtype: str, device: str, device_map=None):
    """Load the verifier; with a device map, from_pretrained places (shards) the layers itself."""
    if not device_map:
        return load_model(model, dtype=dtype, device=device)
    # lazy: transformers takes seconds to import
    from transformers import AutoModelForCausalLM

    path = resolve_model_dir(model)
    check_swiglu(path)
    try:
        loaded = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=resolve_dtype(dtype),
                                                      device_map=device_map)
    except (OSError, ValueError, ImportError) as exc:
        raise UsageError(f"cannot load {path} with --device-map {device_map}: {str(exc).splitlines()[0]}") from exc
    loaded.eval()
    loaded.requires_grad_(False)
    return loaded


def load_head(directory: str, device):
    try:
        return load_steering_head(directory, device=device)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise UsageError(f"cannot load the steering head from {directory}: {exc}") from exc


async def _main(args) -> int:
    if args.trace_file or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        setup_tracing("steerspec-verifier", trace_file=args.trace_file)
        instrument_grpc()
    await registration.check_reachable(args.redis_url)  # before the model loads
    args.dtype, args.invariant = resolve_path(args.dtype, args.invariant, args.model,
                                              "cuda" if args.device_map else args.device)
    model = load_verifier(args.model, args.dtype, args.device, args.device_map)
    apply_invariance(model, args.invariant)
    head = load_head(args.steering_head, model.device) if args.steering_head else None
    if args.max_cache_mb is None:
        args.max_cache_mb = default_cache_mb(next(model.parameters()).device)
    config = VerifierConfig(max_sessions=args.max_sessions, max_cache_mb=args.max_cache_mb,
                            batch_window_ms=args.batch_window_ms, idle_timeout_s=args.idle_timeout_s,
                            max_batch=args.max_batch, kv_backend=args.kv_backend,
                            prefill_chunk=args.prefill_chunk, model_name=str(args.model))
    metrics = service_metrics.start("verifier", args.metrics_port, args.metrics_host or args.host)
    running, servicer = await serve(model, config, host=args.host, port=args.port, steering_head=head,
                                    max_message_bytes=int(args.max_message_mb * 2**20))
    if metrics is not None:
        metrics.watch_table(servicer.table, servicer.table.reserved_bytes)
        metrics.watch_batcher(servicer.batcher)
        servicer.on_verified = metrics.count_spec_decode().observe
    servicer.config.replica = args.advertise or f"{socket.gethostname()}:{running.port}"  # --advertise needs Redis
    await registration.announce(running, "verifier", load=lambda: len(servicer.table), redis_url=args.redis_url,
                                advertise=args.advertise, ttl_s=args.heartbeat_ttl_s, identity=servicer.identity)
    print(f"steerspec verifier serving {args.model} on {running.target}", flush=True)
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
    if args.batch_window_ms < 0:
        raise UsageError("--batch-window-ms must be >= 0")
    if args.prefill_chunk < 0:
        raise UsageError("--prefill-chunk must be >= 0 (0 = the whole prompt in one pass)")
    registration.check_args(args)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    return asyncio.run(_main(args))

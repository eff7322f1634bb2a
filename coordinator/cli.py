"""Serve the coordinator: the public Generate API, placing sessions on drafter and verifier replicas."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from typing import Optional, Tuple

from steerspec.errors import UsageError
from steerspec.serving import logs, security
from steerspec.serving.linkemu import add_link_arguments, link_from_args
from steerspec.serving.targets import parse_targets


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    parser.add_argument("--port", type=int, default=50051, help="port to bind (0 = any free port)")
    parser.add_argument("--verifier", default="", help="verifier replicas HOST:PORT[,HOST:PORT...]")
    parser.add_argument("--drafter", default="",
                        help="this coordinator's edge-local drafter replicas HOST:PORT[,HOST:PORT...]: sessions "
                             "draft on these while one is live, else on any drafter in the registry")
    parser.add_argument("--redis-url", default=None,
                        help="Redis for the registry and session checkpoints (default: in-process store); "
                             "replicas started with the same --redis-url are found there")
    parser.add_argument("--tokenizer", default="auto",
                        help="'auto' (default): the verifier's model, resolved on this host (a bundled name "
                             "resolves anywhere; a directory must exist here too); or a bundled name or checkpoint "
                             "directory, checked against the verifier's tokenizer")
    parser.add_argument("--max-length", type=int, default=None,
                        help="context limit (prompt + generated); default: the verifier's context (at most that)")
    add_link_arguments(parser)
    parser.add_argument("--policy", default=None, metavar="SPEC",
                        help="draft-length policy for requests that name none, NAME[:key=value,...] (default: fixed)")
    parser.add_argument("--heartbeat-ttl-s", type=float, default=5.0, help="registry TTL of a replica")
    parser.add_argument("--max-sessions-per-identity", type=int, default=0, metavar="N",
                        help="generations one identity (token, client certificate, or all unauthenticated callers "
                             "together) may run at once here; more get RESOURCE_EXHAUSTED (default 0: no limit)")
    parser.add_argument("--http-port", type=int, default=None,
                        help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                             "/v1/models, /health) on this port (0 = any free port), with the same TLS and tokens")
    parser.add_argument("--http-host", default=None, help="address for the HTTP API (default: --host)")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    parser.add_argument("--metrics-host", default=None,
                        help="address for /metrics (default: --host; 0.0.0.0 lets a Prometheus container scrape it)")
    parser.add_argument("--trace-file", default=None, help="write OpenTelemetry spans as JSONL here")
    parser.add_argument("--allow-lossy", action="store_true",
                        help="accept lossy verification requests (sprinter); without it they get FAILED_PRECONDITION")
    parser.add_argument("--grace-s", type=float, default=5.0, help="graceful-shutdown grace period")
    security.add_arguments(parser)
    logs.add_arguments(parser)


def load_tokenizer_and_eos(name: Optional[str]) -> Tuple[object, Tuple[int, ...]]:
    """The tokenizer of a model directory and its EOS ids (generation config, config, tokenizer)."""
    if not name:
        return None, ()
    # lazy: the coordinator's parser loads without torch
    from coordinator.model_check import local_model

    model = local_model(name)
    return model.tokenizer, model.eos_ids


def eos_ids_of(path: Path, tokenizer=None) -> Tuple[int, ...]:
    """EOS ids of a checkpoint directory (generation config, config), else the tokenizer's."""
    # lazy: the coordinator's parser loads without torch
    from steerspec.serving.identity import config_eos

    return config_eos(path, tokenizer)


async def coordinator_model(verifiers, drafters, tokenizer: Optional[str], max_length: Optional[int]):
    """The checked model of a coordinator of these replicas (coordinator/model_check.py); None: follow the
    verifier from the first session (none answers now)."""
    # lazy: the coordinator's parser loads without torch
    from coordinator.model_check import check_deployment
    from coordinator.streams import Channels

    channels = Channels()
    try:
        return await check_deployment(channels, verifiers, drafters, tokenizer, max_length)
    finally:
        await channels.close()


def coordinator_kwargs(model, max_length: Optional[int]) -> dict:
    """Coordinator(...) arguments for a checked model, or for following the verifier later (model None)."""
    if model is None:
        return {"follow_verifier": True, "max_length": max_length}
    return {"tokenizer": model.tokenizer, "eos_ids": model.eos_ids, "max_length": model.max_length,
            "model": model.identity}


def policy_defaults(spec: Optional[str]) -> dict:
    """Coordinator defaults for a --policy SPEC (checked now: UsageError lists the known policies)."""
    if not spec:
        return {}
    # lazy: the coordinator's parser loads without torch
    from steerspec.errors import UsageError
    from steerspec.policies import PolicyError, parse_spec

    try:
        parse_spec(spec)
    except PolicyError as exc:
        raise UsageError(f"--policy: {exc}") from None
    return {"policy": spec}


async def _main(args) -> int:
    # lazy: the coordinator's parser loads without torch
    from coordinator.server import Coordinator, serve
    from steerspec.serving.grpc_common import serve_until_signal
    from steerspec.serving.store import open_store

    tracer = None
    if args.trace_file or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        # lazy: the coordinator's parser loads without torch
        from steerspec.observability.tracing import (
            get_tracer,
            instrument_grpc,
            setup_tracing,
        )

        setup_tracing("steerspec-coordinator", trace_file=args.trace_file)
        instrument_grpc()
        tracer = get_tracer(__name__)
    metrics = None
    if args.metrics_port is not None:
        # lazy: the coordinator's parser loads without torch
        from steerspec.observability import service_metrics
        from steerspec.observability.prometheus import (
            SteerSpecMetrics,
            start_metrics_server,
        )

        metrics = SteerSpecMetrics()
        service_metrics.install(service_metrics.CallMetrics("coordinator", metrics.registry))
        metrics_host = args.metrics_host or args.host
        _, metrics_port = start_metrics_server(args.metrics_port, metrics.registry, addr=metrics_host)
        print(f"steerspec coordinator metrics on http://{metrics_host}:{metrics_port}/metrics", flush=True)
    verifiers, drafters = parse_targets(args.verifier, "--verifier"), parse_targets(args.drafter, "--drafter")
    model = await coordinator_model(verifiers, drafters, args.tokenizer, args.max_length)
    if model is None:
        print("steerspec coordinator: no verifier answered yet; it follows the verifier's model at the first "
              "session", flush=True)
    link = link_from_args(args)
    store = await open_store(args.redis_url)
    coordinator = Coordinator(store=store, verifiers=verifiers, drafters=drafters, link=link, metrics=metrics,
                              tracer=tracer, heartbeat_ttl_s=args.heartbeat_ttl_s, allow_lossy=args.allow_lossy,
                              max_sessions_per_identity=args.max_sessions_per_identity,
                              defaults=policy_defaults(args.policy), **coordinator_kwargs(model, args.max_length))
    running = await serve(coordinator, host=args.host, port=args.port, http_port=args.http_port,
                          http_host=args.http_host)
    following = f" for {model.identity.label()}" if model is not None and model.identity is not None else ""
    if coordinator.http is not None:
        print(f"steerspec coordinator OpenAI-compatible API at {coordinator.http.url}/v1", flush=True)
    print(f"steerspec coordinator serving on {running.target}{following}", flush=True)
    await serve_until_signal(running, grace=args.grace_s)
    return 0


def run(args) -> int:
    # lazy: the coordinator's parser loads without torch
    from steerspec.serving.grpc_common import check_port
    parse_targets(args.verifier, "--verifier")
    parse_targets(args.drafter, "--drafter")
    link_from_args(args)
    if args.max_length is not None and args.max_length < 2:
        raise UsageError(f"--max-length must be at least 2, got {args.max_length}")
    if args.heartbeat_ttl_s <= 0:
        raise UsageError("--heartbeat-ttl-s must be > 0")
    if args.max_sessions_per_identity < 0:
        raise UsageError(f"--max-sessions-per-identity must be >= 0 (0 = no limit), got {args.max_sessions_per_identity}")
    check_port(args.port)
    security.configure_from_args(args, host=args.host)
    logs.setup(args.log_level, args.log_format)
    if args.metrics_port is not None:
        check_port(args.metrics_port, "--metrics-port")
    if args.http_port is not None:
        check_port(args.http_port, "--http-port")
        security.current_server().check_bind(args.http_host or args.host)
    if not parse_targets(args.verifier, "--verifier") and not args.redis_url:
        raise UsageError("no verifier to place sessions on: pass --verifier HOST:PORT, or --redis-url where "
                         "replicas register themselves (steerspec serve verifier --redis-url URL)")
    return asyncio.run(_main(args))

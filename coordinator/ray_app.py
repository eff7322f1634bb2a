"""SteerSpec on Ray: verifier, drafter and coordinator actors, each serving gRPC from inside the actor.

Placement (custom resources; DESIGN.md "Ray actors with resource requests"):

- ``VerifierActor``    requests ``{"verifier": 1}``  → a verifier node;
- ``DrafterActor``     requests ``{"edge": 0.5}``    → an edge node;
- ``CoordinatorActor`` requests ``{"edge": 0.5}`` *and* hard node affinity to its drafter's node,
  so the only remote hop of a session is coordinator → verifier. One ``edge`` unit = one
  drafter + coordinator pair.

The actor classes carry no custom resources by themselves; ``deploy`` applies the placement with
``.options(...)``. They are made from plain classes (``VerifierServer`` ...) when first asked for
(``ray_app.VerifierActor``), so importing this module neither imports Ray nor touches the
environment; Ray is started by ``coordinator.launch``. Every actor is an asyncio actor: ``start()`` starts its
``grpc.aio`` server in the actor's event loop (``host`` 127.0.0.1 by default, port 0) and returns
``"host:port"``; ``stop()`` shuts it down gracefully; ``node_id()`` says where it runs.

    python -m coordinator.ray_app --address auto --detached --host node --drafters 2 [--allow-lossy]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from coordinator import server as coordinator_server
from coordinator.cli import coordinator_kwargs, coordinator_model, policy_defaults
from coordinator.model_check import FOLLOW
from coordinator.ray_setup import EDGE, VERIFIER, import_ray, init_ray
from drafter_service import ahead_args
from drafter_service import server as drafter_server
from drafter_service.cli import load_drafter
from steerspec.errors import UsageError
from steerspec.models.dtype_choice import CHOICES as DTYPE_CHOICES, resolve_path
from steerspec.models.kernel_path import apply_invariance
from steerspec.observability.prometheus import SteerSpecMetrics, start_metrics_server
from steerspec.observability.tracing import flush_tracing, get_tracer, instrument_grpc, setup_tracing
from steerspec.serving import security
from steerspec.serving.linkemu import LinkModel, add_link_arguments, link_from_args
from steerspec.serving.registration import announce
from steerspec.serving.store import open_store
from steerspec.sprinter.classifier import load_head as load_sprinter_head
from verifier_service import server as verifier_server
from verifier_service.cli import load_head, load_verifier

EDGE_SHARE = 0.5  # drafter and coordinator each take half an `edge` unit
NAMESPACE = "steerspec"


def _bind_host(host: str) -> str:
    """'node' -> this node's IP (for real clusters); anything else is used as given."""
    if host == "node":
        return import_ray().util.get_node_ip_address()
    return host


def _setup_observability(service: str, trace_file: Optional[str]) -> bool:
    """Tracing in this actor process when asked for (file or OTLP env); True when enabled."""
    if not (trace_file or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        return False

    setup_tracing(service, trace_file=trace_file)
    instrument_grpc()
    return True


def _threads(num_threads: int) -> None:
    if num_threads > 0:
        torch.set_num_threads(num_threads)


class _ServerActor:
    """Shared parts: the running server, its address, graceful stop, where it runs."""

    running = None

    def node_id(self) -> str:
        return import_ray().get_runtime_context().get_node_id()

    def pid(self) -> int:
        return os.getpid()

    def target(self) -> str:
        return self.running.target if self.running is not None else ""

    async def stop(self, grace: float = 1.0) -> bool:
        running, self.running = self.running, None
        if running is not None:
            await running.stop(grace=grace)
        try:
            flush_tracing()
        except Exception:  # tracing is optional here
            pass
        return running is not None


class _ModelServerActor(_ServerActor):
    """A service holding a model: the settings both model services take, and `start` around `_serve`."""

    service = ""  # "verifier" | "drafter": names the tracer's service

    def __init__(self, model: str, dtype: str, device: str, host: str, port: int, trace_file: Optional[str],
                 num_threads: int, options: Optional[Dict[str, object]], redis_url: Optional[str],
                 heartbeat_ttl_s: float) -> None:
        self.model_name, self.dtype, self.device = model, dtype, device
        self.host, self.port, self.trace_file = host, port, trace_file
        self.num_threads = num_threads
        self.options = dict(options or {})
        self.redis_url, self.heartbeat_ttl_s = redis_url, heartbeat_ttl_s
        self.servicer = None

    async def start(self) -> str:
        """Load, serve, and (with a Redis URL) register in the endpoint registry like `steerspec serve`."""
        if self.running is None:
            _threads(self.num_threads)
            _setup_observability(f"steerspec-{self.service}", self.trace_file)
            running, servicer = await self._serve(_bind_host(self.host))
            try:
                await announce(running, self.service, load=lambda: len(servicer.table), redis_url=self.redis_url,
                               ttl_s=self.heartbeat_ttl_s, identity=servicer.identity)
            except BaseException:
                await running.stop(grace=0)
                raise
            self.running, self.servicer = running, servicer
        return self.running.target

    async def _serve(self, host: str):
        """Load the model and start the server on `host`: (RunningServer, servicer)."""
        raise NotImplementedError


class VerifierServer(_ModelServerActor):
    """The verifier service (model + session table + batcher) served from this actor."""

    service = "verifier"

    def __init__(self, model: str = "verifier", dtype: str = "float32", device: str = "cpu",
                 host: str = "127.0.0.1", port: int = 0, trace_file: Optional[str] = None,
                 num_threads: int = 0, options: Optional[Dict[str, object]] = None,
                 redis_url: Optional[str] = None, heartbeat_ttl_s: float = 5.0,
                 device_map: Optional[str] = None, steering_head: Optional[str] = None,
                 invariant: Optional[str] = None) -> None:
        super().__init__(model, dtype, device, host, port, trace_file, num_threads, options, redis_url,
                         heartbeat_ttl_s)
        self.device_map, self.steering_head, self.invariant = device_map, steering_head, invariant

    async def _serve(self, host: str):
        self.dtype, self.invariant = resolve_path(self.dtype, self.invariant, self.model_name,
                                                  "cuda" if self.device_map else self.device)
        model = load_verifier(self.model_name, self.dtype, self.device, self.device_map)
        if self.invariant is not None:
            apply_invariance(model, self.invariant)
        head = load_head(self.steering_head, model.device) if self.steering_head else None
        config = verifier_server.VerifierConfig(replica=f"ray-verifier-{os.getpid()}", model_name=str(self.model_name), **self.options)
        return await verifier_server.serve(model, config, host=host, port=self.port, steering_head=head)


class DrafterServer(_ModelServerActor):
    """The drafter service served from this actor (an edge node)."""

    service = "drafter"

    def __init__(self, model: str = "pretrained", dtype: str = "float32", device: str = "cpu",
                 host: str = "127.0.0.1", port: int = 0, trace_file: Optional[str] = None,
                 num_threads: int = 0, options: Optional[Dict[str, object]] = None,
                 redis_url: Optional[str] = None, heartbeat_ttl_s: float = 5.0,
                 steering: str = "auto") -> None:
        super().__init__(model, dtype, device, host, port, trace_file, num_threads, options, redis_url,
                         heartbeat_ttl_s)
        self.steering = steering

    async def _serve(self, host: str):
        model, hooks = load_drafter(self.model_name, self.dtype, self.device, self.steering)
        config = drafter_server.DrafterConfig(model_name=str(self.model_name), **self.options)
        return await drafter_server.serve(model, config, host=host, port=self.port, hooks=hooks)


class CoordinatorServer(_ServerActor):
    """The coordinator (public Generate API) served from this actor, next to its drafter."""

    def __init__(self, verifiers: Sequence[str] = (), drafters: Sequence[str] = (), tokenizer: Optional[str] = "auto",
                 rtt_ms: float = 0.0, jitter_ms: float = 0.0, bandwidth_mbps: float = 0.0, link_seed: int = 0,
                 host: str = "127.0.0.1", port: int = 0, redis_url: Optional[str] = None,
                 trace_file: Optional[str] = None, metrics_port: Optional[int] = None,
                 heartbeat_ttl_s: float = 5.0, policy: str = "", allow_lossy: bool = False,
                 max_sessions_per_identity: int = 0, http_port: Optional[int] = None) -> None:
        self.verifiers, self.drafters = list(verifiers), list(drafters)
        self.http_port = http_port  # the OpenAI-compatible HTTP API beside gRPC (None: not served)
        self.max_sessions_per_identity = max_sessions_per_identity  # 0: no per-identity limit
        self.policy = policy
        self.allow_lossy = allow_lossy  # serve lossy verification (sprinter) requests
        self.tokenizer_name = tokenizer
        self.link_args = dict(rtt_ms=rtt_ms, jitter_ms=jitter_ms, bandwidth_mbps=bandwidth_mbps, seed=link_seed)
        self.host, self.port, self.redis_url = host, port, redis_url
        self.trace_file, self.metrics_port = trace_file, metrics_port
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.metrics_server = None
        self.metrics_address = ""
        self.coordinator = None

    async def start(self) -> str:
        if self.running is not None:
            return self.running.target
        host = _bind_host(self.host)
        tracer = None
        if _setup_observability("steerspec-coordinator", self.trace_file):
            tracer = get_tracer("coordinator")
        metrics = None
        if self.metrics_port is not None:
            metrics = SteerSpecMetrics()
            self.metrics_server, port = start_metrics_server(self.metrics_port, metrics.registry, addr=host)
            self.metrics_address = f"{host}:{port}"
        model = await coordinator_model(self.verifiers, self.drafters, self.tokenizer_name or FOLLOW, None)
        coordinator = coordinator_server.Coordinator(store=await open_store(self.redis_url), verifiers=self.verifiers,
                                  drafters=self.drafters, **coordinator_kwargs(model, None),
                                  link=LinkModel(**self.link_args).validate(),
                                  metrics=metrics, tracer=tracer, heartbeat_ttl_s=self.heartbeat_ttl_s,
                                  defaults={"policy": self.policy} if self.policy else None,
                                  allow_lossy=self.allow_lossy,
                                  max_sessions_per_identity=self.max_sessions_per_identity)
        self.running = await coordinator_server.serve(coordinator, host=host, port=self.port, http_port=self.http_port)
        self.coordinator = coordinator
        return self.running.target

    def set_link(self, rtt_ms: float = 0.0, jitter_ms: float = 0.0, bandwidth_mbps: float = 0.0,
                 link_seed: int = 0) -> None:
        """Change the emulated link for the sessions started from now on."""
        self.link_args = dict(rtt_ms=rtt_ms, jitter_ms=jitter_ms, bandwidth_mbps=bandwidth_mbps, seed=link_seed)
        if self.coordinator is not None:
            self.coordinator.config.link = LinkModel(**self.link_args).validate()

    def metrics_target(self) -> str:
        return self.metrics_address

    def http_url(self) -> str:
        """The OpenAI-compatible API's base URL (http(s)://host:port), "" when not served."""
        http = self.coordinator.http if self.coordinator is not None else None
        return http.url if http is not None else ""

    async def stop(self, grace: float = 1.0) -> bool:
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server = None
        return await super().stop(grace)


# ------------------------------------------------------------------------------------ actor classes

_SERVERS = {"VerifierActor": VerifierServer, "DrafterActor": DrafterServer, "CoordinatorActor": CoordinatorServer}
_ACTORS: Dict[str, object] = {}


def actor_class(name: str):
    """The Ray actor class `name` ("VerifierActor" | "DrafterActor" | "CoordinatorActor"), made once."""
    if name not in _ACTORS:
        _ACTORS[name] = import_ray().remote(num_cpus=0, max_concurrency=1000)(_SERVERS[name])
    return _ACTORS[name]


def __getattr__(name: str):
    if name in _SERVERS:
        return actor_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------ placement


def placement_options(kind: str, node_id: Optional[str] = None, num_gpus: float = 0,
                      name: Optional[str] = None, detached: bool = False) -> Dict[str, object]:
    """`.options(...)` for an actor of `kind` ("verifier" | "drafter" | "coordinator")."""
    if kind == "verifier":
        options: Dict[str, object] = {"resources": {VERIFIER: 1}}
    elif kind in ("drafter", "coordinator"):
        options = {"resources": {EDGE: EDGE_SHARE}}
    else:
        raise ValueError(f"unknown actor kind {kind!r}")
    if num_gpus:
        options["num_gpus"] = num_gpus
    if node_id is not None:
        # lazy: Ray only for the Ray deployment
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,  # lazy: Ray only for the Ray deployment
        )

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    if name:
        options["name"] = name
        options["namespace"] = NAMESPACE
    if detached:
        options["lifetime"] = "detached"

    env = security.actor_env()
    if env:  # TLS and tokens reach the actor's servers and channels (merged with the job's env_vars)
        options["runtime_env"] = {"env_vars": env}
    return options


@dataclass
class Deployment:
    """Handles and addresses of one deployment (a verifier and drafter+coordinator pairs)."""

    verifier: object
    verifier_target: str
    drafters: List[object] = field(default_factory=list)
    drafter_targets: List[str] = field(default_factory=list)
    coordinators: List[object] = field(default_factory=list)
    coordinator_targets: List[str] = field(default_factory=list)
    coordinator_http: List[str] = field(default_factory=list)  # their HTTP APIs' base URLs ("" where not served)

    @property
    def coordinator_target(self) -> str:
        return self.coordinator_targets[0]

    def actors(self) -> List[object]:
        return [*self.coordinators, *self.drafters, self.verifier]

    def nodes(self, timeout: float = 60) -> Dict[str, List[str]]:
        """Node id of every actor: {"verifier": [...], "drafter": [...], "coordinator": [...]}."""
        ray = import_ray()
        return {
            "verifier": [ray.get(self.verifier.node_id.remote(), timeout=timeout)],
            "drafter": ray.get([a.node_id.remote() for a in self.drafters], timeout=timeout),
            "coordinator": ray.get([a.node_id.remote() for a in self.coordinators], timeout=timeout),
        }

    def set_link(self, link, timeout: float = 60) -> None:
        """Change every coordinator's emulated link (a LinkModel) for the sessions started from now on."""
        ray = import_ray()
        ray.get([c.set_link.remote(rtt_ms=link.rtt_ms, jitter_ms=link.jitter_ms, bandwidth_mbps=link.bandwidth_mbps,
                                   link_seed=link.seed) for c in self.coordinators], timeout=timeout)

    def shutdown(self, timeout: float = 30) -> None:
        """Stop every server gracefully, then kill the actors."""
        ray = import_ray()
        for actor in self.actors():
            try:
                ray.get(actor.stop.remote(), timeout=timeout)
            except Exception:  # keep stopping the others
                pass
            try:
                ray.kill(actor)
            except Exception:
                pass


def actor_drafter_dtype(requested: Optional[str], dtype: str, device: str) -> str:
    """The dtype drafter actors are given: "auto" stays "auto" only under a float32 verifier on a CPU, where each
    drafter's node decides by its own CPU (`layouts.drafter_dtype`); elsewhere "auto" and None are the verifier's."""
    if requested is None or (requested == "auto" and (dtype != "float32" or not str(device).startswith("cpu"))):
        return dtype
    return requested


def deploy(
    verifier: str = "verifier",
    drafter: str = "pretrained",
    drafters: int = 1,
    *,
    dtype: str = "float32",
    drafter_dtype: Optional[str] = None,
    device: str = "cpu",
    host: str = "127.0.0.1",
    tokenizer: Optional[str] = None,
    rtt_ms: float = 0.0,
    jitter_ms: float = 0.0,
    bandwidth_mbps: float = 0.0,
    link_seed: int = 0,
    redis_url: Optional[str] = None,
    trace_file: Optional[str] = None,
    metrics_port: Optional[int] = None,
    http_port: Optional[int] = None,
    coordinator_port: int = 0,
    verifier_port: int = 0,
    verifier_gpus: float = 0,
    drafter_gpus: float = 0,
    num_threads: int = 0,
    device_map: Optional[str] = None,
    steering_head: Optional[str] = None,
    verifier_options: Optional[Dict[str, object]] = None,
    drafter_options: Optional[Dict[str, object]] = None,
    one_coordinator: bool = False,
    detached: bool = False,
    policy: str = "",
    allow_lossy: bool = False,
    max_sessions_per_identity: int = 0,
    timeout: float = 300,
    invariant: Optional[str] = None,
) -> Deployment:
    """Place a verifier on a `verifier` node and `drafters` drafter+coordinator pairs on `edge` nodes.

    Each coordinator is pinned (hard node affinity) to the node its drafter landed on; `drafters=0`
    places one coordinator with no drafter (autoregressive sessions only); `one_coordinator` places
    one coordinator, next to the first drafter, that places sessions on all of them (as `LocalCluster`);
    `allow_lossy`: the coordinators serve lossy (sprinter) requests, whose drafter head is
    `drafter_options["sprinter_head"]` or the drafter's own `sprinter/`. Ray must be initialised
    (`coordinator.ray_setup.init_ray`). Returns once every server answers with its address.
    """
    ray = import_ray()
    name = (lambda base: base) if detached else (lambda base: None)
    drafter_dtype = actor_drafter_dtype(drafter_dtype, dtype, device)
    common = dict(dtype=dtype, device=device, host=host, trace_file=trace_file, num_threads=num_threads,
                  redis_url=redis_url)  # with Redis every replica registers itself (TTL heartbeats)
    v_actor = actor_class("VerifierActor").options(
        **placement_options("verifier", num_gpus=verifier_gpus, name=name("steerspec-verifier-0"), detached=detached)
    ).remote(model=verifier, port=verifier_port, device_map=device_map, steering_head=steering_head,
             options=verifier_options, invariant=invariant, **common)
    d_actors = [actor_class("DrafterActor").options(
        **placement_options("drafter", num_gpus=drafter_gpus, name=name(f"steerspec-drafter-{i}"), detached=detached)
    ).remote(model=drafter, options=drafter_options, **{**common, "dtype": drafter_dtype}) for i in range(drafters)]
    deployment = Deployment(verifier=v_actor, verifier_target="", drafters=d_actors)
    try:
        deployment.verifier_target = ray.get(v_actor.start.remote(), timeout=timeout)
        deployment.drafter_targets = ray.get([a.start.remote() for a in d_actors], timeout=timeout)
        drafter_nodes = ray.get([a.node_id.remote() for a in d_actors], timeout=timeout)
        if one_coordinator:
            pairs = [(list(deployment.drafter_targets), drafter_nodes[0] if drafter_nodes else None)]
        else:
            pairs = [([t], node) for t, node in zip(deployment.drafter_targets, drafter_nodes)] or [([], None)]
        for i, (d_targets, node) in enumerate(pairs):
            port = coordinator_port + i if coordinator_port else 0
            m_port = metrics_port + i if metrics_port else metrics_port
            h_port = http_port + i if http_port else http_port
            c_actor = actor_class("CoordinatorActor").options(
                **placement_options("coordinator", node_id=node, name=name(f"steerspec-coordinator-{i}"),
                                    detached=detached)
            ).remote(verifiers=[deployment.verifier_target], drafters=d_targets,
                     tokenizer=tokenizer or verifier, rtt_ms=rtt_ms, jitter_ms=jitter_ms,
                     bandwidth_mbps=bandwidth_mbps, link_seed=link_seed, host=host, port=port,
                     redis_url=redis_url, trace_file=trace_file, metrics_port=m_port, policy=policy,
                     allow_lossy=allow_lossy, max_sessions_per_identity=max_sessions_per_identity,
                     http_port=h_port)
            deployment.coordinators.append(c_actor)
        deployment.coordinator_targets = ray.get([c.start.remote() for c in deployment.coordinators],
                                                 timeout=timeout)
        deployment.coordinator_http = ray.get([c.http_url.remote() for c in deployment.coordinators],
                                              timeout=timeout)
    except BaseException:
        deployment.shutdown()
        raise
    return deployment


def deploy_local(address: Optional[str] = None, **kwargs) -> Deployment:
    """`deploy` on the Ray at `address`, or on a one-node loopback Ray with both custom resources
    (`coordinator.ray_setup.init_ray`) when Ray is not initialised yet."""
    init_ray(address, edge=1 + max(1, int(kwargs.get("drafters", 1))))
    return deploy(**kwargs)


# ------------------------------------------------------------------------------------ CLI


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coordinator.ray_app", description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default=None, help="Ray cluster address ('auto' on a cluster node)")
    parser.add_argument("--verifier", default="verifier", help="bundled name or checkpoint directory")
    parser.add_argument("--drafter", default="pretrained", help="bundled name or checkpoint directory")
    parser.add_argument("--drafters", type=int, default=1, help="drafter+coordinator pairs")
    parser.add_argument("--host", default="127.0.0.1", help="bind address; 'node' = the node's IP")
    parser.add_argument("--coordinator-port", type=int, default=0)
    parser.add_argument("--verifier-port", type=int, default=0)
    parser.add_argument("--metrics-port", type=int, default=None)
    parser.add_argument("--http-port", type=int, default=None,
                        help="each coordinator also serves the OpenAI-compatible HTTP API on HTTP_PORT + i")
    parser.add_argument("--trace-file", default=None)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="the verifier's dtype (default: auto = bfloat16 on a CPU with native bf16 where the "
                             "verifier node's timing of its passes, batch-invariant, beats float32's; else float32)")
    parser.add_argument("--verifier-gpus", type=float, default=0)
    parser.add_argument("--drafter-gpus", type=float, default=0)
    parser.add_argument("--device-map", default=None, help="shard the verifier (e.g. auto) over the node's GPUs")
    parser.add_argument("--steering-head", default=None, help="SD² checkpoint directory for the verifier")
    parser.add_argument("--policy", default="", metavar="SPEC",
                        help="draft-length policy for requests that name none, NAME[:key=value,...] (default: fixed)")
    parser.add_argument("--allow-lossy", action="store_true",
                        help="accept lossy verification requests (sprinter); without it they get FAILED_PRECONDITION")
    parser.add_argument("--sprinter-head", default=None, metavar="DIR",
                        help="SPRINTER classifier head for the drafters' lossy sessions (default: DRAFTER/sprinter)")
    add_link_arguments(parser)
    parser.add_argument("--max-sessions-per-identity", type=int, default=0, metavar="N",
                        help="concurrent generations per caller identity (RESOURCE_EXHAUSTED beyond; 0 = no limit)")
    parser.add_argument("--detached", action="store_true", help="named detached actors; exit once serving")

    ahead_args.add_arguments(parser, serving=True)  # the drafter actors' defaults
    security.add_arguments(parser)  # handed to every actor as STEERSPEC_* variables
    args = parser.parse_args(argv)

    head = None
    try:
        policy_defaults(args.policy)
        if args.sprinter_head:  # checked here, and absolute: the drafter actors' working directory is not ours
            head = str(Path(args.sprinter_head).resolve())
            load_sprinter_head(head)
        ahead_args.check(args)
        if args.max_sessions_per_identity < 0:
            raise UsageError(f"--max-sessions-per-identity must be >= 0 (0 = no limit), got "
                             f"{args.max_sessions_per_identity}")
        security.configure_from_args(args, host=None if args.host == "node" else args.host)
        security.export_to_env(args)
    except UsageError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    link = link_from_args(args)
    deployment = deploy_local(
        address=args.address, verifier=args.verifier, drafter=args.drafter, drafters=args.drafters,
        host=args.host, coordinator_port=args.coordinator_port, verifier_port=args.verifier_port,
        metrics_port=args.metrics_port, http_port=args.http_port, trace_file=args.trace_file, redis_url=args.redis_url, device=args.device,
        dtype=args.dtype, verifier_gpus=args.verifier_gpus, drafter_gpus=args.drafter_gpus, rtt_ms=link.rtt_ms,
        jitter_ms=link.jitter_ms, bandwidth_mbps=link.bandwidth_mbps, link_seed=link.seed,
        device_map=args.device_map, steering_head=args.steering_head, detached=args.detached, policy=args.policy,
        allow_lossy=args.allow_lossy,
        drafter_options={**({"sprinter_head": head} if head else {}), **ahead_args.drafter_options(args)} or None,
        max_sessions_per_identity=args.max_sessions_per_identity)
    print(f"verifier    {deployment.verifier_target}", flush=True)
    for d, c, h in zip(deployment.drafter_targets, deployment.coordinator_targets, deployment.coordinator_http):
        print(f"drafter     {d}\ncoordinator {c}" + (f"\nopenai      {h}/v1" if h else ""), flush=True)
    if args.detached:
        return 0
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        deployment.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

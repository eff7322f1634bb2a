"""Deploy the three services (verifier, drafter, coordinator) in this process or as Ray actors.

    async with launch(Services("verifier", "pretrained", link=LinkModel(rtt_ms=50)), "local") as running:
        async with running.client() as client:
            summary = await client.acomplete(prompt_ids=ids, max_new_tokens=64)

- ``local``: grpc.aio servers on 127.0.0.1:0 in this process's event loop (`coordinator.local.LocalCluster`):
  real gRPC between the services, no process start-up;
- ``ray``: verifier, drafter and coordinator actors (`coordinator.ray_app`), each serving gRPC from its own
  worker process, on the Ray at ``address`` or on a one-node loopback Ray started (and stopped) here.

Ray itself is started in one place, `coordinator/ray_setup.py`.
`run_distributed(args, prompt_ids)` is `steerspec run --transport grpc`: one deployment, one generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from coordinator import ray_app
from drafter_service import ahead_args
from coordinator.client import Client
from coordinator.local import LocalCluster
from coordinator.ray_setup import import_ray, init_ray
from coordinator.summary import result_from_summary
from steerspec.errors import UsageError
from steerspec.models.loading import resolve_device
from steerspec.serving.linkemu import NO_LINK, LinkModel, link_from_args
from steerspec.steering.io import steering_dir
from steerspec.sprinter.spec import parse_verification

DEPLOYMENTS = ("local", "ray")
@dataclass
class Services:
    """What to deploy, the same for both deployments.

    `verifier` / `drafter`: bundled names or checkpoint directories (``local`` also takes loaded
    models); `drafters=0` deploys no drafter (autoregressive only). `link` is the emulated
    coordinator↔verifier link; `tokenizer` whose tokenizer and EOS the coordinator uses ("auto": the
    verifier's). `num_threads`: torch's intra-op threads per service process (None: leave as is; 0: auto, one
    for models under 100M parameters, in the local deployment).
    """

    verifier: object = "verifier"
    drafter: object = "pretrained"
    drafters: int = 1
    dtype: str = "float32"
    drafter_dtype: Optional[str] = None  # None: `dtype`; "auto": bfloat16 on a CPU with native bf16
    device: str = "cpu"
    link: LinkModel = NO_LINK
    tokenizer: object = "auto"
    num_threads: Optional[int] = None
    trace_file: Optional[str] = None
    redis_url: Optional[str] = None
    allow_lossy: bool = False  # the coordinator serves lossy verification (sprinter) requests
    invariant: Optional[str] = None  # the verifier's batch-invariant passes: off | on | auto (None: as loaded / off)
    verifier_options: Dict[str, object] = field(default_factory=dict)  # VerifierConfig fields
    drafter_options: Dict[str, object] = field(default_factory=dict)  # DrafterConfig fields

    def steering_dir(self) -> Optional[str]:
        """The drafter's directory when it is an SD² drafter (the verifier then runs its W_hml), else None."""
        if not self.drafters or not isinstance(self.drafter, (str, os.PathLike)):
            return None
        return steering_dir(self.drafter)


class RayDeployment:
    """`Services` as Ray actors (`coordinator.ray_app.deploy`), started and stopped from an event loop.

    Same shape as the local deployment: one coordinator (next to the first drafter) placing sessions on
    every drafter replica.
    """

    def __init__(self, services: Services, address: Optional[str] = None, **placement) -> None:
        for name in ("verifier", "drafter"):
            if not isinstance(getattr(services, name), (str, os.PathLike)):
                raise UsageError(f"the ray deployment loads the {name} in its own process: pass a name or directory")
        self.services, self.address, self.placement = services, address, placement
        self.deployment = None
        self.started_ray = False
        self.steering = services.steering_dir() is not None

    @property
    def target(self) -> str:
        return self.deployment.coordinator_target

    @property
    def verifier_targets(self) -> List[str]:
        return [self.deployment.verifier_target]

    @property
    def drafter_targets(self) -> List[str]:
        return list(self.deployment.drafter_targets)

    def _deploy(self):
        s = self.services
        self.started_ray = init_ray(self.address, edge=1 + max(1, s.drafters))
        link = s.link.validate()
        tokenizer = s.verifier if s.tokenizer == "auto" else s.tokenizer
        return ray_app.deploy(
            verifier=str(s.verifier), drafter=str(s.drafter), drafters=s.drafters, dtype=s.dtype,
            drafter_dtype=s.drafter_dtype, device=s.device,
            tokenizer=str(tokenizer) if tokenizer else None, rtt_ms=link.rtt_ms, jitter_ms=link.jitter_ms,
            bandwidth_mbps=link.bandwidth_mbps, link_seed=link.seed, redis_url=s.redis_url,
            trace_file=s.trace_file, num_threads=s.num_threads or 0, steering_head=s.steering_dir(),
            verifier_options=s.verifier_options, drafter_options=s.drafter_options, one_coordinator=True,
            allow_lossy=s.allow_lossy, invariant=s.invariant, **self.placement)

    async def start(self) -> None:
        ray = import_ray()
        try:
            self.deployment = await asyncio.to_thread(self._deploy)
        except ray.exceptions.RayTaskError as exc:  # an actor's UsageError (bad model, flag): that one line
            if isinstance(exc.cause, UsageError):
                raise UsageError(str(exc.cause)) from None
            raise

    async def stop(self) -> None:
        deployment, self.deployment = self.deployment, None
        if deployment is not None:
            await asyncio.to_thread(deployment.shutdown)
        if self.started_ray:
            import_ray().shutdown()
            self.started_ray = False

    async def __aenter__(self) -> "RayDeployment":
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def set_link(self, link: LinkModel) -> None:
        """Change the emulated link of every coordinator for the sessions started from now on."""
        self.deployment.set_link(link.validate())

    def client(self, **kwargs):
        """A `steerspec.Client` for the (first) coordinator."""
        return Client(self.target, **kwargs)


def launch(services: Services, deployment: str = "local", *, address: Optional[str] = None, **placement):
    """An unstarted deployment of `services`: `async with launch(...) as running` starts it and stops it.

    `address` (ray only): an existing Ray cluster; `placement` (ray only): `coordinator.ray_app.deploy`'s
    host, ports, GPUs, device_map, detached.
    """
    if deployment == "ray":
        return RayDeployment(services, address, **placement)
    if deployment != "local":
        raise UsageError(f"--deployment must be one of {', '.join(DEPLOYMENTS)}, got '{deployment}'")
    if address or placement:
        raise UsageError(f"the local deployment takes no Ray address or placement ({', '.join(placement)})")

    return LocalCluster(services.verifier, services.drafter, drafters=services.drafters,
                        link=services.link.validate(), tokenizer=services.tokenizer, dtype=services.dtype,
                        drafter_dtype=services.drafter_dtype, device=services.device, verifier_options=dict(services.verifier_options),
                        drafter_options=dict(services.drafter_options), num_threads=services.num_threads,
                        trace_file=services.trace_file, redis_url=services.redis_url,
                        allow_lossy=services.allow_lossy, invariant=services.invariant)


# ------------------------------------------------------------------------------- steerspec run


def _arg(args, name: str, default):
    value = getattr(args, name, None)
    return default if value is None else value


def run_distributed(args, prompt_ids: Sequence[int]):
    """`steerspec run --transport grpc`: deploy (--deployment local|ray), generate once through the public
    Generate API, stop everything; returns a `coordinator.summary.SummaryResult`."""
    resolve_device(_arg(args, "device", "cpu"))  # a bad or absent device: one line here, not a server's traceback

    mode = _arg(args, "mode", "speculative")
    lossy = parse_verification(_arg(args, "verification", "exact")).lossy  # asked for on the command line
    head = _arg(args, "sprinter_head", None)
    services = Services(verifier=str(_arg(args, "verifier", "verifier")),
                        drafter=str(_arg(args, "drafter", "pretrained")),
                        drafters=1 if mode == "speculative" else 0, dtype=_arg(args, "dtype", "float32"),
                        drafter_dtype=_arg(args, "drafter_dtype", None),
                        device=_arg(args, "device", "cpu"), link=link_from_args(args),
                        num_threads=int(_arg(args, "threads", 0)), trace_file=_arg(args, "trace_file", None),
                        allow_lossy=lossy, invariant=_arg(args, "invariant", None),
                        # an absolute head path: Ray's drafter actors run elsewhere
                        drafter_options={"sprinter_head": str(Path(head).resolve())} if head else {})
    return asyncio.run(_generate_once(services, _arg(args, "deployment", "local"), args, list(prompt_ids)))


async def _generate_once(services: Services, deployment: str, args, prompt_ids: List[int]):
    remote = _arg(args, "coordinator", None)
    async with (contextlib.nullcontext(None) if remote else launch(services, deployment)) as running:
        start = time.perf_counter()
        async with (Client(remote) if remote else running.client(retries=2)) as client:
            summary = await client.acomplete(
                prompt_ids=prompt_ids, max_new_tokens=int(_arg(args, "max_new_tokens", 64)),
                temperature=float(_arg(args, "temperature", 0.0)), top_k=int(_arg(args, "top_k", 0)),
                top_p=float(_arg(args, "top_p", 1.0)), seed=int(_arg(args, "seed", 0)), k=int(_arg(args, "k", 4)),
                draft_top_k=int(_arg(args, "draft_top_k", 64)), mode=_arg(args, "mode", "speculative"),
                policy=str(_arg(args, "policy", "fixed")), verification=str(_arg(args, "verification", "exact")),
                tree=str(_arg(args, "tree", None) or ""), **ahead_args.request_fields(args),
                steering=bool(running.steering) if running else False,
                timeout=float(_arg(args, "timeout", 600.0)))
        wall = time.perf_counter() - start
    return result_from_summary(summary, prompt_tokens=len(prompt_ids), mode=_arg(args, "mode", "speculative"),
                               wall_s=wall)

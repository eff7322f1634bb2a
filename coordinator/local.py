"""Local deployments: `LocalCluster` (every server in this process) and `run_distributed` (local Ray).

    async with LocalCluster("verifier", "pretrained", link=LinkModel(rtt_ms=50)) as cluster:
        result = await cluster.generate(prompt_ids, max_new_tokens=64, k=4)   # DistributedResult
        with cluster.client() as client: ...                                  # through the public API

`LocalCluster` starts verifier and drafter replicas (grpc.aio servers on 127.0.0.1:0, models loaded
once and shared by replicas) and a coordinator server in the running event loop; tests and
`steerspec bench remote` use it because it costs no process start-up. `run_distributed(args,
prompt_ids)` is `steerspec run --transport grpc`: a local Ray (loopback only) with one drafter,
one verifier and a coordinator as Ray actors, one generation, shutdown.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from coordinator.loop import SessionLoop, SessionRequest
from coordinator.results import DistributedResult
from coordinator.server import Coordinator, serve as serve_coordinator
from steerspec.store import Store
from steerspec.errors import UsageError
from steerspec.linkemu import NO_LINK, LinkModel
from steerspec.sampling import SamplingParams


def _load(model, dtype: str, device: str):
    from steerspec.models import load_model

    return load_model(model, dtype=dtype, device=device) if isinstance(model, (str, os.PathLike)) else model


@dataclass
class LocalCluster:
    """Verifier and drafter replicas plus a coordinator, all in this process (async context manager).

    `verifier` / `drafter`: bundled names, checkpoint directories or loaded models. `drafters=0`
    gives a verifier-only deployment. `tokenizer`: a name or directory for text prompts and EOS
    (default: the verifier's directory when it is one; None disables text and EOS).
    """

    verifier: object = "verifier"
    drafter: object = "pretrained"
    verifiers: int = 1
    drafters: int = 1
    link: LinkModel = NO_LINK
    store: Optional[Store] = None
    tokenizer: object = "auto"
    eos_ids: Optional[Sequence[int]] = None
    dtype: str = "float32"
    device: str = "cpu"
    verifier_options: dict = field(default_factory=dict)  # VerifierConfig fields
    drafter_options: dict = field(default_factory=dict)  # DrafterConfig fields
    metrics: object = None
    tracer: object = None
    heartbeat_ttl_s: float = 5.0

    def __post_init__(self) -> None:
        self._servers: List[object] = []
        self.verifier_targets: List[str] = []
        self.drafter_targets: List[str] = []
        self.verifier_servers: List[object] = []
        self.drafter_servers: List[object] = []
        self.coordinator: Optional[Coordinator] = None
        self.target = ""

    async def __aenter__(self) -> "LocalCluster":
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def start(self) -> None:
        from coordinator.cli import load_tokenizer_and_eos
        from verifier_service.server import VerifierConfig, serve as serve_verifier

        verifier_model = _load(self.verifier, self.dtype, self.device)
        steering_dir = (_steering_dir(self.drafter)
                        if self.drafters and isinstance(self.drafter, (str, os.PathLike)) else None)
        head = None
        if steering_dir is not None:  # an SD² drafter: the verifier runs its W_hml
            from verifier_service.cli import load_head

            head = load_head(steering_dir, verifier_model.device)
        for i in range(self.verifiers):
            config = VerifierConfig(replica=f"local-verifier-{i}", model_name=str(self.verifier),
                                    **self.verifier_options)
            running, _ = await serve_verifier(verifier_model, config, host="127.0.0.1", port=0, steering_head=head)
            self._servers.append(running)
            self.verifier_servers.append(running)
            self.verifier_targets.append(running.target)
        if self.drafters:
            from drafter_service.server import DrafterConfig, serve as serve_drafter

            if steering_dir is not None:  # the drafter's own loader attaches its W_s hooks
                from drafter_service.cli import load_drafter

                drafter_model, hooks = load_drafter(steering_dir, self.dtype, self.device, steering=steering_dir)
            else:
                drafter_model, hooks = _load(self.drafter, self.dtype, self.device), None
            for i in range(self.drafters):
                config = DrafterConfig(model_name=str(self.drafter), **self.drafter_options)
                running, _ = await serve_drafter(drafter_model, config, host="127.0.0.1", port=0, hooks=hooks)
                self._servers.append(running)
                self.drafter_servers.append(running)
                self.drafter_targets.append(running.target)
        tokenizer, eos = None, ()
        source = self.verifier if self.tokenizer == "auto" else self.tokenizer
        if isinstance(source, (str, os.PathLike)) and source:
            tokenizer, eos = load_tokenizer_and_eos(str(source))
        if self.eos_ids is not None:
            eos = tuple(self.eos_ids)
        from steerspec.models import context_length

        contexts = [context_length(verifier_model)] + ([context_length(drafter_model)] if self.drafters else [])
        self.coordinator = Coordinator(store=self.store, verifiers=self.verifier_targets,
                                       drafters=self.drafter_targets, link=self.link, tokenizer=tokenizer,
                                       eos_ids=eos, metrics=self.metrics, tracer=self.tracer,
                                       heartbeat_ttl_s=self.heartbeat_ttl_s, max_length=min(contexts))
        running = await serve_coordinator(self.coordinator, host="127.0.0.1", port=0)
        self._servers.append(running)
        self.target = running.target

    async def stop(self) -> None:
        servers, self._servers = self._servers[::-1], []
        for running in servers:
            try:
                await running.stop(grace=1.0)
            except Exception:  # keep stopping the others
                pass

    def set_link(self, link: LinkModel) -> None:
        """Change the emulated coordinator↔verifier link for the sessions started from now on."""
        self.link = link.validate()
        if self.coordinator is not None:
            self.coordinator.config.link = self.link

    def client(self, **kwargs):
        """A `steerspec.Client` for this cluster's coordinator."""
        from coordinator.client import Client

        return Client(self.target, **kwargs)

    async def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int = 64, temperature: float = 0.0,
                       top_k: int = 0, top_p: float = 1.0, seed: int = 0, k: int = 4, draft_top_k: int = 64,
                       mode: str = "speculative", policy: str = "fixed", steering: bool = False,
                       session_id: str = "", timeout: Optional[float] = None) -> DistributedResult:
        """One generation driven by this process's coordinator (no client hop); returns its result."""
        request = SessionRequest(prompt_ids=list(prompt_ids), max_new_tokens=max_new_tokens,
                                 sampling=SamplingParams(temperature, top_k, top_p), seed=seed, k=k,
                                 draft_top_k=draft_top_k, mode=mode, policy=policy, steering=steering,
                                 session_id=session_id).validate()
        await self.coordinator.store.create_session(request.session_id, request.params(), {})
        deadline = None if timeout is None else time.monotonic() + timeout
        loop = SessionLoop(request, self.coordinator.config, deadline=deadline)
        async for _ in loop.run():
            pass
        await self.coordinator.store.finish_session(request.session_id, "done", loop.result.stop_reason)
        tokenizer = self.coordinator.tokenizer
        if tokenizer is not None:
            loop.result.text = tokenizer.decode(loop.result.token_ids, skip_special_tokens=True)
        return loop.result

    async def stats(self) -> Tuple[list, list]:
        """(verifier stats, drafter stats) of every replica, via GetVerifierStats / GetDrafterStats."""
        from steerspec.v1 import drafter_pb2, verifier_pb2

        channels = self.coordinator.channels
        v = [(await channels.verifier(t).GetVerifierStats(verifier_pb2.GetVerifierStatsRequest(), timeout=5)).stats
             for t in self.verifier_targets]
        d = [(await channels.drafter(t).GetDrafterStats(drafter_pb2.GetDrafterStatsRequest(), timeout=5)).stats
             for t in self.drafter_targets]
        return v, d


# ------------------------------------------------------------------------------------------ Ray


def _arg(args, name: str, default):
    value = getattr(args, name, None)
    return default if value is None else value


def run_distributed(args, prompt_ids: Sequence[int]) -> DistributedResult:
    """`steerspec run --transport grpc`: local Ray with a drafter, a verifier and a coordinator actor.

    Ray runs on loopback only (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, no dashboard, 2 CPUs); the
    actors start gRPC servers on 127.0.0.1:0; the generation goes through the coordinator's
    public Generate API; everything is shut down before returning.
    """
    from steerspec.models.loading import resolve_device

    resolve_device(_arg(args, "device", "cpu"))  # a bad or absent device: one line here, not an actor's traceback
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from coordinator import ray_app
    from coordinator.client import Client

    started_here = not ray.is_initialized()
    if started_here:
        # Workers import coordinator/, verifier_service/, drafter_service/ from where this package lives.
        root = str(Path(__file__).resolve().parent.parent)
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 _node_ip_address="127.0.0.1", runtime_env={"env_vars": {"PYTHONPATH": path}})
    actors = []
    try:
        trace_file = _arg(args, "trace_file", None)
        common = {"dtype": _arg(args, "dtype", "float32"), "device": _arg(args, "device", "cpu"),
                  "trace_file": trace_file}
        drafter_name = _arg(args, "drafter", "pretrained")
        mode = _arg(args, "mode", "speculative")
        steering_dir = _steering_dir(drafter_name) if mode == "speculative" else None
        verifier = ray_app.VerifierActor.remote(model=str(_arg(args, "verifier", "verifier")),
                                                steering_head=steering_dir, **common)
        actors.append(verifier)
        drafter = None
        if mode == "speculative":
            drafter = ray_app.DrafterActor.remote(model=str(drafter_name), **common)
            actors.append(drafter)
        verifier_target = _started(ray, verifier, 300)
        drafter_target = _started(ray, drafter, 300) if drafter is not None else ""
        coordinator = ray_app.CoordinatorActor.remote(
            verifiers=[verifier_target], drafters=[drafter_target] if drafter_target else [],
            tokenizer=str(_arg(args, "verifier", "verifier")), rtt_ms=float(_arg(args, "rtt_ms", 0.0)),
            jitter_ms=float(_arg(args, "jitter_ms", 0.0)), bandwidth_mbps=float(_arg(args, "bandwidth_mbps", 0.0)),
            link_seed=int(_arg(args, "link_seed", 0)), trace_file=trace_file)
        actors.append(coordinator)
        target = _started(ray, coordinator, 120)
        start = time.perf_counter()
        with Client(target, retries=2) as client:
            summary = client.complete(
                prompt_ids=list(prompt_ids), max_new_tokens=int(_arg(args, "max_new_tokens", 64)),
                temperature=float(_arg(args, "temperature", 0.0)), top_k=int(_arg(args, "top_k", 0)),
                top_p=float(_arg(args, "top_p", 1.0)), seed=int(_arg(args, "seed", 0)), k=int(_arg(args, "k", 4)),
                draft_top_k=int(_arg(args, "draft_top_k", 64)), mode=mode, policy=str(_arg(args, "policy", "fixed")),
                steering=steering_dir is not None, timeout=float(_arg(args, "timeout", 600.0)))
        wall = time.perf_counter() - start
        return result_from_summary(summary, prompt_tokens=len(prompt_ids), mode=mode, wall_s=wall)
    finally:
        for actor in actors:
            try:
                ray.get(actor.stop.remote(), timeout=30)
            except Exception:
                pass
            try:
                ray.kill(actor)
            except Exception:
                pass
        if started_here:
            ray.shutdown()


def _started(ray, actor, timeout_s: float) -> str:
    """The address `actor.start()` bound; a UsageError it raised (bad model, flag) as that one line."""
    try:
        return ray.get(actor.start.remote(), timeout=timeout_s)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, UsageError):
            raise UsageError(str(exc.cause)) from None
        raise


def _steering_dir(drafter) -> Optional[str]:
    """The drafter's checkpoint directory when it carries SD² steering weights (the verifier needs W_hml)."""
    from steerspec.models import resolve_model_dir
    from steerspec.steering import has_steering

    path = resolve_model_dir(str(drafter))
    return str(path) if has_steering(path) else None


@dataclass
class SummaryResult(DistributedResult):
    """A DistributedResult rebuilt from a GenerationSummary (per-block means, no per-block list)."""

    wire_summary: object = None

    @property
    def accepted_per_position(self):
        return list(self.wire_summary.accepted_per_position)

    @property
    def rtt_ms(self) -> float:
        return float(self.wire_summary.rtt_ms)

    @property
    def bytes_up(self) -> float:
        return float(self.wire_summary.bytes_up)

    @property
    def bytes_down(self) -> float:
        return float(self.wire_summary.bytes_down)

    def stage_ms(self, reduce=None):
        return dict(self.wire_summary.stage_ms)

    def to_json(self):
        out = super().to_json()
        out.pop("stage_ms_median", None)
        out["batch_size"] = None
        out["coordinator_wall_s"] = round(float(self.wire_summary.wall_s), 6)
        return out


def result_from_summary(summary, prompt_tokens: int, mode: str, wall_s: float) -> SummaryResult:
    """The CLI's result object from the client's final Summary."""
    result = SummaryResult(token_ids=list(summary.token_ids), text=summary.text, mode=mode,
                           prompt_tokens=prompt_tokens, rounds=summary.rounds, drafted=summary.drafted,
                           accepted=summary.accepted, wall_s=wall_s, stop_reason=summary.finish_reason,
                           session_id=summary.session_id, resumes=summary.resumes, trace_id=summary.trace_id,
                           wire_summary=summary)
    result.draft_s = summary.stage_ms["draft"] * summary.rounds / 1000.0
    result.verify_s = summary.stage_ms["verify"] * summary.rounds / 1000.0
    return result

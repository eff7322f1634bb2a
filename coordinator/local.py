"""The local deployment: `LocalCluster`, every server in this process (`coordinator.launch` starts it).

    async with LocalCluster("verifier", "pretrained", link=LinkModel(rtt_ms=50)) as cluster:
        result = await cluster.generate(prompt_ids, max_new_tokens=64, k=4)   # DistributedResult
        with cluster.client() as client: ...                                  # through the public API

`LocalCluster` starts verifier and drafter replicas (grpc.aio servers on 127.0.0.1:0, models loaded
once and shared by replicas) and a coordinator server in the running event loop; tests and
`steerspec bench remote` use it because it costs no process start-up, and it is `steerspec run`'s
default deployment (`--deployment local`).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from coordinator.cli import coordinator_kwargs, coordinator_model
from coordinator.client import Client
from coordinator.loop import SessionLoop, SessionRequest
from coordinator.model_check import FOLLOW
from coordinator.results import DistributedResult
from coordinator.server import Coordinator, check_verification
from coordinator.server import serve as serve_coordinator
from drafter_service.cli import load_drafter
from drafter_service.server import DrafterConfig
from drafter_service.server import serve as serve_drafter
from steerspec.decoding.sampling import SamplingParams
from steerspec.models import context_length, load_model
from steerspec.models.dtype_choice import resolve_path
from steerspec.models.kernel_path import apply_invariance
from steerspec.models.layouts import drafter_dtype
from steerspec.models.loading import apply_threads
from steerspec.observability.tracing import flush_tracing, get_tracer, instrument_grpc, setup_tracing
from steerspec.serving.linkemu import NO_LINK, LinkModel
from steerspec.serving.store import Store, open_store
from steerspec.steering.io import steering_dir as find_steering_dir
from steerspec.v1 import drafter_pb2, verifier_pb2
from verifier_service.cli import load_head
from verifier_service.server import VerifierConfig
from verifier_service.server import serve as serve_verifier

log = logging.getLogger(__name__)


def _load(model, dtype: str, device: str):
    return load_model(model, dtype=dtype, device=device) if isinstance(model, (str, os.PathLike)) else model


def _name(given, model) -> str:
    """What a replica reports it serves: the name or directory given, else the loaded model's directory."""
    return str(given) if isinstance(given, (str, os.PathLike)) else str(getattr(model, "name_or_path", "") or "")


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
    dtype: str = "float32"  # "auto": the machine's choice (models/dtype_choice.py)
    drafter_dtype: Optional[str] = None  # None: `dtype`; "auto": bfloat16 on a CPU with native bf16 (layouts.drafter_dtype)
    device: str = "cpu"
    invariant: Optional[str] = None  # the verifier's batch-invariant passes: off | on | auto (None: as loaded)
    verifier_options: dict = field(default_factory=dict)  # VerifierConfig fields
    drafter_options: dict = field(default_factory=dict)  # DrafterConfig fields
    metrics: object = None
    tracer: object = None
    heartbeat_ttl_s: float = 5.0
    num_threads: Optional[int] = None  # torch intra-op threads: None = leave as is, 0 = auto (see apply_threads)
    trace_file: Optional[str] = None  # spans of every server here, as JSONL
    redis_url: Optional[str] = None  # registry and checkpoints in Redis (default: `store` or in-process)
    allow_lossy: bool = False  # the coordinator serves lossy verification (sprinter) requests
    coordinator_options: dict = field(default_factory=dict)  # more Coordinator arguments (max_sessions_per_identity)
    http_port: Optional[int] = None  # also serve the OpenAI-compatible HTTP API (0: any free port; `http_url`)

    def __post_init__(self) -> None:
        self._servers: List[object] = []
        self.verifier_targets: List[str] = []
        self.drafter_targets: List[str] = []
        self.verifier_servers: List[object] = []
        self.drafter_servers: List[object] = []
        self.drafter_servicers: List[object] = []  # DrafterServicers (their `ahead` counts drafting ahead)
        self.coordinator: Optional[Coordinator] = None
        self.target = ""
        self.steering = False  # an SD² drafter: requests ask for steering

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
        if self.trace_file and self.tracer is None:
            setup_tracing("steerspec-local", trace_file=self.trace_file)
            instrument_grpc()
            self.tracer = get_tracer("coordinator")
        if self.redis_url and self.store is None:
            self.store = await open_store(self.redis_url)
        if self.dtype == "auto":  # the machine's choice at the threads it will run; a loaded model's own
            if isinstance(self.verifier, (str, os.PathLike)):
                self.dtype, self.invariant = resolve_path("auto", self.invariant, self.verifier, self.device,
                                                          self.num_threads)
            else:
                self.dtype = str(next(self.verifier.parameters()).dtype).replace("torch.", "")
        verifier_model = _load(self.verifier, self.dtype, self.device)
        self._threads(verifier_model)
        if self.invariant is not None:
            apply_invariance(verifier_model, self.invariant)
        steering_dir = (find_steering_dir(self.drafter)
                        if self.drafters and isinstance(self.drafter, (str, os.PathLike)) else None)
        if self.drafters and steering_dir is None and not isinstance(self.drafter, (str, os.PathLike)):
            source = getattr(self.drafter, "name_or_path", "") or ""
            if source and os.path.isdir(source) and find_steering_dir(source) is not None:
                log.warning("the drafter was given as a loaded model from the SD² checkpoint %s: it runs "
                            "unsteered; pass the directory to steer it", source)
        self.steering = steering_dir is not None
        head = None
        if steering_dir is not None:  # an SD² drafter: the verifier runs its W_hml

            head = load_head(steering_dir, verifier_model.device)
        for i in range(self.verifiers):
            config = VerifierConfig(replica=f"local-verifier-{i}", model_name=_name(self.verifier, verifier_model),
                                    **self.verifier_options)
            running, _ = await serve_verifier(verifier_model, config, host="127.0.0.1", port=0, steering_head=head)
            self._servers.append(running)
            self.verifier_servers.append(running)
            self.verifier_targets.append(running.target)
        if self.drafters:
            dtype = drafter_dtype(self.drafter_dtype, self.dtype, self.device)
            if steering_dir is not None:  # the drafter's own loader attaches its W_s hooks

                drafter_model, hooks = load_drafter(steering_dir, dtype, self.device, steering=steering_dir)
            else:
                drafter_model, hooks = _load(self.drafter, dtype, self.device), None
            for i in range(self.drafters):
                config = DrafterConfig(model_name=_name(self.drafter, drafter_model), **self.drafter_options)
                running, servicer = await serve_drafter(drafter_model, config, host="127.0.0.1", port=0, hooks=hooks)
                self.drafter_servicers.append(servicer)
                self._servers.append(running)
                self.drafter_servers.append(running)
                self.drafter_targets.append(running.target)

        contexts = [context_length(verifier_model)] + ([context_length(drafter_model)] if self.drafters else [])
        kwargs: dict = {"max_length": min(contexts)}
        if self.tokenizer is not None:  # the check every deployment makes (coordinator/model_check.py)
            tokenizer = FOLLOW if self.tokenizer == "auto" else str(self.tokenizer)
            model = await coordinator_model(self.verifier_targets, self.drafter_targets, tokenizer, min(contexts))
            kwargs = coordinator_kwargs(model, min(contexts))
        if self.eos_ids is not None:
            kwargs["eos_ids"] = tuple(self.eos_ids)
        self.coordinator = Coordinator(store=self.store, verifiers=self.verifier_targets,
                                       drafters=self.drafter_targets, link=self.link, metrics=self.metrics,
                                       tracer=self.tracer, heartbeat_ttl_s=self.heartbeat_ttl_s,
                                       allow_lossy=self.allow_lossy, **kwargs, **self.coordinator_options)
        running = await serve_coordinator(self.coordinator, host="127.0.0.1", port=0, http_port=self.http_port)
        self._servers.append(running)
        self.target = running.target

    def _threads(self, verifier_model) -> None:
        if self.num_threads is not None:
            apply_threads(self.num_threads, verifier_model)

    async def stop(self) -> None:
        servers, self._servers = self._servers[::-1], []
        for running in servers:
            try:
                await running.stop(grace=1.0)
            except Exception:  # keep stopping the others
                pass
        if self.trace_file:
            flush_tracing()

    @property
    def http_url(self) -> str:
        """The OpenAI-compatible API's base URL ("" unless started with `http_port`)."""
        http = self.coordinator.http if self.coordinator is not None else None
        return http.url if http is not None else ""

    def set_link(self, link: LinkModel) -> None:
        """Change the emulated coordinator↔verifier link for the sessions started from now on."""
        self.link = link.validate()
        if self.coordinator is not None:
            self.coordinator.config.link = self.link

    def client(self, **kwargs):
        """A `steerspec.Client` for this cluster's coordinator."""
        return Client(self.target, **kwargs)

    async def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int = 64, temperature: float = 0.0,
                       top_k: int = 0, top_p: float = 1.0, seed: int = 0, k: int = 0, draft_top_k: int = 64,
                       mode: str = "speculative", policy: str = "", steering: bool = False,
                       session_id: str = "", timeout: Optional[float] = None,
                       verification: str = "exact", tree: str = "", block_kind: str = "", draft_ahead: str = "",
                       ahead_outcomes: int = 0, ahead_budget_ms: float = 0.0) -> DistributedResult:
        """One generation driven by this process's coordinator (no client hop); returns its result. Naming no k, tree
        or policy gets the deployment's default (`blocks.block_mode.default_fields`: the load-aware default)."""
        check_verification(verification, self.allow_lossy)
        request = SessionRequest(prompt_ids=list(prompt_ids), max_new_tokens=max_new_tokens,
                                 sampling=SamplingParams(temperature, top_k, top_p), seed=seed, k=k,
                                 draft_top_k=draft_top_k, mode=mode, policy=policy, steering=steering,
                                 session_id=session_id, verification=verification, tree=tree,
                                 block_kind=block_kind, draft_ahead=draft_ahead, ahead_outcomes=ahead_outcomes,
                                 ahead_budget_ms=ahead_budget_ms).validate()
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
        channels = self.coordinator.channels
        v = [(await channels.verifier(t).GetVerifierStats(verifier_pb2.GetVerifierStatsRequest(), timeout=5)).stats
             for t in self.verifier_targets]
        d = [(await channels.drafter(t).GetDrafterStats(drafter_pb2.GetDrafterStatsRequest(), timeout=5)).stats
             for t in self.drafter_targets]
        return v, d

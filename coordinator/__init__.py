"""The coordinator: session placement, the round-trip loop, the client SDK (the state store is `steerspec.serving.store`).

- `coordinator.client.Client` — the SDK (`steerspec.Client`);
- `coordinator.server.Coordinator` / `CoordinatorService` — the public Generate API (grpc.aio);
- `coordinator.loop.SessionLoop` — one session's drafter → verifier round trips;
- `coordinator.results` — per-block costs (`BlockStats`) and `DistributedResult`;
- `coordinator.streams` — shared channels, streams that report failed replicas;
- `coordinator.placement.Placer` — least-loaded / round-robin replica choice;
- `coordinator.launch` — `launch(Services(...), "local"|"ray")`, the one launcher (and the one `ray.init`);
  `run_distributed` is `steerspec run --transport grpc`;
- `coordinator.local` — `LocalCluster`, the local deployment (every server in this process);
- `coordinator.ray_app` — the Ray actors and `deploy` (placement by custom resources).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Client": "coordinator.client",
    "Coordinator": "coordinator.server",
    "CoordinatorService": "coordinator.server",
    "SessionLoop": "coordinator.loop",
    "SessionRequest": "coordinator.loop",
    "SessionError": "coordinator.streams",
    "DistributedResult": "coordinator.results",
    "LocalCluster": "coordinator.local",
    "Services": "coordinator.launch",
    "launch": "coordinator.launch",
    "run_distributed": "coordinator.launch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'coordinator' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

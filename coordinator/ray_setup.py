"""The one place that starts Ray: `init_ray` (a loopback Ray of our own, or an existing cluster) and
`import_ray`, which puts Ray's loopback-only setting into the environment when Ray is imported, not when a
module is imported. `EDGE` and `VERIFIER` name the resources the actors are placed by."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # read by Ray at import: a local Ray binds 127.0.0.1
RAY_CPUS = 2
EDGE = "edge"  # the Ray resource of an edge host (drafter, coordinator)
VERIFIER = "verifier"  # the Ray resource of a verifier host


def import_ray():
    """The `ray` module, imported with Ray's loopback-only setting in the environment (unless set otherwise)."""
    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)
    # lazy: Ray only for the Ray deployment
    import ray

    return ray


def init_ray(address: Optional[str] = None, *, edge: float = 2, verifier: float = 1) -> bool:
    """Connect to the Ray at `address`, or start a one-node loopback Ray with `edge`/`verifier` resources.

    Returns True when this call started or connected Ray (the caller then shuts it down), False when
    Ray was already initialised (a shared Ray, e.g. the test session's).
    """
    ray = import_ray()
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
        return True
    # Workers import coordinator/, verifier_service/ and drafter_service/ from where this package lives.
    root = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    # address="local": always a new Ray of our own, never one another process started on this machine
    # (a bare ray.init() joins the cluster named in /tmp/ray/ray_current_cluster).
    ray.init(address="local", num_cpus=RAY_CPUS, resources={EDGE: edge, VERIFIER: verifier}, include_dashboard=False,
             log_to_driver=False, configure_logging=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    return True

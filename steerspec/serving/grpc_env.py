"""gRPC core settings that must be in the environment before `grpc` is first imported.

SteerSpec's processes (the CLI and what it starts: servers, Ray workers, benches) run grpc's iomgr
TCP client and listener rather than its EventEngine ones (``GRPC_EXPERIMENTS=-event_engine_client,
-event_engine_listener``): a message that wakes an idle process costs fewer thread hand-offs there,
and the remote-verifier regime is one idle wait per round trip. `steerspec bench hop` on a 2-core VM
(docs/results/bundled-pair.md, "Per-hop cost"): one 1,846-byte message each way after 25 ms idle took 0.52 ms median
against 0.66 ms. A ``GRPC_EXPERIMENTS`` already set is left alone, and
``STEERSPEC_GRPC_TCP=event_engine`` keeps grpc's default.
"""

from __future__ import annotations

import os
import sys
from typing import Dict, MutableMapping, Optional

LEGACY_TCP_EXPERIMENTS = "-event_engine_client,-event_engine_listener"
OPT_OUT_VAR, OPT_OUT_VALUE = "STEERSPEC_GRPC_TCP", "event_engine"  # keep grpc's default transport


def tuned_env(environ: Optional[MutableMapping[str, str]] = None) -> Dict[str, str]:
    """The variables SteerSpec would add to `environ` (empty when the user chose otherwise)."""
    environ = os.environ if environ is None else environ
    if "GRPC_EXPERIMENTS" in environ or environ.get(OPT_OUT_VAR, "").strip().lower() == OPT_OUT_VALUE:
        return {}
    return {"GRPC_EXPERIMENTS": LEGACY_TCP_EXPERIMENTS}


def apply(environ: Optional[MutableMapping[str, str]] = None) -> bool:
    """Add `tuned_env()` to the environment (inherited by child processes, Ray workers included).

    Returns whether it takes effect in this process too, i.e. grpc was not imported yet.
    """
    environ = os.environ if environ is None else environ
    extra = tuned_env(environ)
    environ.update(extra)
    return bool(extra) and "grpc" not in sys.modules

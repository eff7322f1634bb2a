"""SteerSpec: distributed speculative decoding with SD² steering vectors."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Lazy exports, so `import steerspec` stays cheap (no grpc/torch import until a name is used).
_SDK = ("Client", "Chunk", "Summary")
_ERRORS = ("SteerSpecError", "InvalidArgument", "OutOfRange", "FailedPrecondition", "Unauthenticated",
           "PermissionDenied", "ResourceExhausted", "Unavailable", "Aborted", "DeadlineExceeded", "Cancelled",
           "InternalError", "ResumeMismatch", "MissingSummary", "from_rpc_error")
_EXPORTS = {**{name: "coordinator.client" for name in _SDK}, **{name: "coordinator.exceptions" for name in _ERRORS}}

__all__ = [*_SDK, *_ERRORS, "__version__"]


def __getattr__(name: str) -> Any:
    """Lazy exports: the SDK (`Client`, `Chunk`, `Summary`) and its errors (`coordinator.exceptions`)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'steerspec' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

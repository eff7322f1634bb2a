"""SteerSpec: distributed speculative decoding with SD² steering vectors."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Client", "__version__"]


def __getattr__(name: str) -> Any:
    """Lazy exports, so `import steerspec` stays cheap (no grpc/torch import until needed)."""
    if name == "Client":
        from coordinator.client import Client

        return Client
    raise AttributeError(f"module 'steerspec' has no attribute {name!r}")

"""The registry of block kinds: the bundled ones (imported here, so they register) and any registered elsewhere
with `block_kind.register_kind`. `kind_of(mode)` is how every round finds a session's kind."""

from __future__ import annotations

from typing import Dict

from steerspec.blocks import alone_kind, chain_kind, sprinter_kind, tree_kind  # noqa: F401  (the bundled kinds register themselves)
from steerspec.blocks.block_kind import BlockKind, registered_kinds


def known_kinds() -> Dict[str, BlockKind]:
    """Every registered kind, by name."""
    return registered_kinds()


def kind_of(mode) -> BlockKind:
    """The kind a `BlockMode` decodes with (KeyError naming the known kinds for an unregistered one)."""
    kinds = registered_kinds()
    try:
        return kinds[mode.kind]
    except KeyError:
        raise KeyError(f"unknown block kind {mode.kind!r}; known kinds: {', '.join(sorted(kinds))}") from None

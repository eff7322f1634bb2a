"""What a draft-length policy registers: its name, factory and keys (`@register`), and the context it is built in.

Kept below every policy module and the registry (`registry.py`, which parses specs and builds policies),
so a policy file imports only this and `base.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

from steerspec.policies.base import DraftLengthPolicy


class PolicyError(ValueError):
    """A policy spec that cannot be built; the message says what would work."""


@dataclass(frozen=True)
class PolicyContext:
    """What trained policies need to find their heads: the drafter's directory, model and device."""

    drafter_dir: Optional[str] = None
    drafter: Any = None
    hidden_size: Optional[int] = None
    device: str = "cpu"


@dataclass(frozen=True)
class Key:
    """One parameter of a policy: its type, default and a short description."""

    type: type
    default: Any
    doc: str = ""


@dataclass(frozen=True)
class PolicyEntry:
    """A registered policy: its factory (keyword parameters plus `context`) and its keys."""

    name: str
    factory: Callable[..., DraftLengthPolicy]
    keys: Dict[str, Key] = field(default_factory=dict)
    doc: str = ""
    length_keys: Tuple[str, ...] = ("k",)  # keys whose largest value bounds a block's length
    trees: bool = False  # sizes draft trees too: next_k is then the nodes of the tree's breadth-first prefix


REGISTERED: Dict[str, PolicyEntry] = {}  # filled by @register as each policy module is imported


def registered() -> Dict[str, PolicyEntry]:
    """A copy of what has registered so far, by name."""
    return dict(REGISTERED)


def register(name: str, keys: Dict[str, Key], doc: str = "", length_keys: Tuple[str, ...] = ("k",),
             trees: bool = False) -> Callable:
    """Class decorator: register a policy under `name` with its keys (factory(**params, context=));
    `length_keys` name the keys whose largest value is the most tokens one block can hold; `trees`: it sizes
    draft-tree blocks too (how many of the tree's nodes, breadth-first)."""

    def wrap(factory: Callable) -> Callable:
        REGISTERED[name] = PolicyEntry(name, factory, dict(keys), doc, tuple(length_keys), bool(trees))
        return factory

    return wrap

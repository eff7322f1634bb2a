"""One registry and one spec grammar for draft-length policies: `name:key=value,key=value`.

The CLI (`--policy`), the SDK (`policy=`), `GenerateRequest.policy`, `serve drafter|coordinator
--policy` and the Ray deployment all go through `make_policy(spec)`. An unknown name or key, or a
value of the wrong type, raises `PolicyError` (a ValueError) whose one-line message lists what is
known, so a CLI can exit 2 with it and a server can answer INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

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


_REGISTRY: Dict[str, PolicyEntry] = {}


def register(name: str, keys: Dict[str, Key], doc: str = "", length_keys: Tuple[str, ...] = ("k",)) -> Callable:
    """Class decorator: register a policy under `name` with its keys (factory(**params, context=));
    `length_keys` name the keys whose largest value is the most tokens one block can hold."""

    def wrap(factory: Callable) -> Callable:
        _REGISTRY[name] = PolicyEntry(name, factory, dict(keys), doc, tuple(length_keys))
        return factory

    return wrap


def known_policies() -> Dict[str, PolicyEntry]:
    """Every registered policy, by name (importing the bundled policy modules first)."""
    import steerspec.policies  # noqa: F401  (registers the bundled policies)

    return dict(_REGISTRY)


def _convert(name: str, key: str, spec: Key, raw: str) -> Any:
    try:
        if spec.type is bool:
            lowered = raw.strip().lower()
            if lowered not in {"1", "0", "true", "false", "yes", "no"}:
                raise ValueError(raw)
            return lowered in {"1", "true", "yes"}
        if spec.type is int:
            value = float(raw)
            if value != int(value):
                raise ValueError(raw)
            return int(value)
        value = spec.type(raw)
    except (TypeError, ValueError):
        raise PolicyError(f"policy {name}: {key}={raw!r} is not a valid {spec.type.__name__}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise PolicyError(f"policy {name}: {key} must be a finite number, got {raw!r}")
    return value


def parse_spec(spec: str) -> Tuple[str, Dict[str, Any]]:
    """'gammatune:eta=0.5,gmax=24' -> ('gammatune', {'eta': 0.5, 'gmax': 24}), checked against the registry."""
    registry = known_policies()
    text = (spec or "").strip()
    name, _, rest = text.partition(":")
    name = name.strip()
    if name not in registry:
        raise PolicyError(f"unknown draft-length policy {name!r}; known policies: {', '.join(sorted(registry))}")
    entry = registry[name]
    params: Dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if key not in entry.keys:
            known = ", ".join(sorted(entry.keys)) or "none"
            raise PolicyError(f"policy {name} has no key {key!r}; its keys: {known}")
        if not eq:
            raise PolicyError(f"policy {name}: {key} needs a value ({key}=...)")
        if key in params:
            raise PolicyError(f"policy {name}: {key} given twice")
        params[key] = _convert(name, key, entry.keys[key], raw.strip())
    return name, params


def split_specs(text: str) -> List[str]:
    """A list of policy specs from one option: comma-separated, or ';'-separated when a spec holds commas."""
    sep = ";" if ";" in text else ","
    return [spec.strip() for spec in text.split(sep) if spec.strip()]


def max_block(spec: str) -> int:
    """The most draft tokens one block of the policy a spec names can hold (its `max_k`), read from
    the spec without building the policy (no trained head needed): what a service reserves per block."""
    name, params = parse_spec(spec)
    entry = _REGISTRY[name]
    values = [params.get(key, entry.keys[key].default) for key in entry.length_keys]
    return max(int(v) for v in values)


def make_policy(spec: str, context: Optional[PolicyContext] = None) -> DraftLengthPolicy:
    """Build the policy a spec names; any value the policy refuses becomes a PolicyError too."""
    name, params = parse_spec(spec)
    entry = _REGISTRY[name]
    try:
        return entry.factory(**params, context=context or PolicyContext())
    except PolicyError:
        raise
    except (TypeError, ValueError, FileNotFoundError) as exc:
        raise PolicyError(f"policy {name}: {exc}") from None


def describe() -> str:
    """One line per policy: `name: key=default, ...`, for --help texts and error messages."""
    lines = []
    for name, entry in sorted(known_policies().items()):
        keys = ", ".join(f"{k}={v.default}" for k, v in entry.keys.items())
        lines.append(f"{name}: {keys}" if keys else name)
    return "; ".join(lines)

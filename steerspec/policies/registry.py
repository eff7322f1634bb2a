"""One registry and one spec grammar for draft-length policies: `name:key=value,key=value`.

The CLI (`--policy`), the SDK (`policy=`), `GenerateRequest.policy`, `serve drafter|coordinator
--policy` and the Ray deployment all go through `make_policy(spec)`. An unknown name or key, or a
value of the wrong type, raises `PolicyError` (a ValueError) whose one-line message lists what is
known, so a CLI can exit 2 with it and a server can answer INVALID_ARGUMENT. A policy registers itself
with `@register` (`catalog.py`, re-exported here for policies outside the package).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

from steerspec.policies import adaedl, fixed, gammatune, heuristic, latency, load, pacer, specdecpp, threshold  # noqa: F401  (the bundled policies register themselves)
from steerspec.policies.base import DraftLengthPolicy
from steerspec.policies.catalog import Key, PolicyContext, PolicyEntry, PolicyError, register, registered

__all__ = ["Key", "PolicyContext", "PolicyEntry", "PolicyError", "describe", "known_policies", "make_policy",
           "max_block", "parse_spec", "register", "split_specs"]


def known_policies() -> Dict[str, PolicyEntry]:
    """Every registered policy, by name: the bundled ones (imported above) and any a user registered."""
    return registered()


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
    entry = registered()[name]
    values = [params.get(key, entry.keys[key].default) for key in entry.length_keys]
    return max(int(v) for v in values)


def make_policy(spec: str, context: Optional[PolicyContext] = None) -> DraftLengthPolicy:
    """Build the policy a spec names; any value the policy refuses becomes a PolicyError too."""
    name, params = parse_spec(spec)
    entry = registered()[name]
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

"""Coordinator counters beyond the per-call ones (`steerspec.observability.service_metrics`).

``steerspec_sessions_uncheckpointed_total{service}``: sessions that went on without checkpoints
because the store (Redis) failed under them (a resume after a coordinator restart starts them from
their last stored prefix). ``steerspec_quota_refusals_total{service}``: sessions refused because
their identity already ran its --max-sessions-per-identity. Registered on the installed metrics
registry (the coordinator's /metrics) on first use; nothing is counted when metrics are off.
"""

from __future__ import annotations

from typing import Dict, Tuple

from prometheus_client import Counter

from steerspec.observability import service_metrics

_COUNTERS: Dict[Tuple[int, str], Counter] = {}
HELP = {
    "steerspec_sessions_uncheckpointed": "Sessions that went on without checkpoints (the store failed)",
    "steerspec_quota_refusals": "Sessions refused: the identity's concurrent-session quota was full",
}


def count(name: str, amount: float = 1.0) -> None:
    """Add `amount` to counter `name` (one of HELP) of the installed coordinator metrics, if any."""
    metrics = service_metrics.current()
    if metrics is None:
        return
    key = (id(metrics.registry), name)
    counter = _COUNTERS.get(key)
    if counter is None:
        counter = _COUNTERS[key] = Counter(name, HELP[name], ("service",), registry=metrics.registry)
    counter.labels(metrics.service).inc(amount)

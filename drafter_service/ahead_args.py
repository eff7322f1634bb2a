"""The drafting-ahead flags (drafter_service/ahead.py) for `steerspec serve drafter`, `steerspec run` and the Ray
deployment, checked in one place: a bad value is one line (UsageError, exit 2)."""

from __future__ import annotations

import argparse
from typing import Dict, Optional

from steerspec.errors import UsageError

DEFAULT_ENABLED = False  # off until it pays: on the shared 2-core CPU it did not (docs/results/draft-ahead.md)
DEFAULT_OUTCOMES = 8  # verdicts prepared per block (drafted together, one batched pass per step)
DEFAULT_BUDGET_MS = 60.0  # drafter time preparing per block: past it (a loaded host) nothing is prepared
MAX_OUTCOMES = 64


def add_arguments(parser: argparse.ArgumentParser, serving: bool) -> None:
    """`--draft-ahead on|off`, `--ahead-outcomes N`, `--ahead-budget-ms MS`: a drafter's defaults (`serving`), or
    a request's choice (unset: the drafter's default)."""
    where = "sessions that do not say" if serving else "this request (default: the drafter's default)"
    parser.add_argument("--draft-ahead", choices=("on", "off"), default=None,
                        help=f"drafting ahead for {where}: while a block is verified, the drafter prepares the next "
                             "block for its likeliest verdicts in idle time (exact either way; a seed gives the same "
                             f"tokens on or off, unsteered){' (default: ' + ('on' if DEFAULT_ENABLED else 'off') + ')' if serving else ''}")
    parser.add_argument("--ahead-outcomes", type=int, default=None, metavar="N",
                        help=f"verdicts prepared per block (default: {DEFAULT_OUTCOMES})")
    parser.add_argument("--ahead-budget-ms", type=float, default=None, metavar="MS",
                        help=f"drafter time spent preparing per block (default: {DEFAULT_BUDGET_MS:g}; "
                             f"{'0' if serving else 'negative'} = no time limit)")


def check(args: argparse.Namespace) -> None:
    """UsageError naming a bad drafting-ahead flag."""
    outcomes = getattr(args, "ahead_outcomes", None)
    if outcomes is not None and not 0 <= outcomes <= MAX_OUTCOMES:
        raise UsageError(f"--ahead-outcomes must be in [0, {MAX_OUTCOMES}], got {outcomes}")
    budget = getattr(args, "ahead_budget_ms", None)
    if budget is not None and budget != budget:  # NaN
        raise UsageError("--ahead-budget-ms must be a number of milliseconds")


def drafter_options(args: argparse.Namespace) -> Dict[str, object]:
    """DrafterConfig fields from the flags of `steerspec serve drafter` (only those given)."""
    out: Dict[str, object] = {}
    if getattr(args, "draft_ahead", None) is not None:
        out["draft_ahead"] = args.draft_ahead == "on"
    if getattr(args, "ahead_outcomes", None) is not None:
        out["ahead_outcomes"] = int(args.ahead_outcomes)
    if getattr(args, "ahead_budget_ms", None) is not None:
        out["ahead_budget_ms"] = max(float(args.ahead_budget_ms), 0.0)
    return out


def request_fields(args: argparse.Namespace) -> Dict[str, object]:
    """GenerateRequest fields from a request's flags: "" / 0 leave the drafter's defaults."""
    budget: Optional[float] = getattr(args, "ahead_budget_ms", None)
    return {"draft_ahead": getattr(args, "draft_ahead", None) or "",
            "ahead_outcomes": int(getattr(args, "ahead_outcomes", None) or 0),
            "ahead_budget_ms": 0.0 if budget is None else (-1.0 if budget <= 0 else float(budget))}

"""Errors a person can act on: the CLI prints them as one line and exits 2."""

from __future__ import annotations

import math
from typing import List


class UsageError(ValueError):
    """Bad input from a user (flag, prompt, model path): reported as one line, exit code 2."""


def float_list(text: str, flag: str, nonnegative: bool = False) -> List[float]:
    """The comma-separated numbers a flag was given; a UsageError naming the flag otherwise (with
    `nonnegative`: at least one, each finite and >= 0, e.g. RTTs)."""
    try:
        values = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} expects comma-separated numbers, got '{text}'") from None
    if nonnegative and (not values or any(v < 0 or not math.isfinite(v) for v in values)):
        raise UsageError(f"{flag} expects finite numbers >= 0, got '{text}'")
    return values

"""Replica addresses on the command line: `HOST:PORT[,HOST:PORT...]` (coordinator flags, --advertise)."""

from __future__ import annotations

from typing import List

from steerspec.errors import UsageError


def parse_targets(text: str, flag: str) -> List[str]:
    """'h:p,h:p' -> ['h:p', 'h:p']; UsageError naming `flag` on a malformed entry."""
    targets = [t.strip() for t in (text or "").split(",") if t.strip()]
    for target in targets:
        host, _, port = target.rpartition(":")
        if not host or not port.isdigit() or not (0 < int(port) < 65536):
            raise UsageError(f"{flag} expects HOST:PORT[,HOST:PORT...], got '{target}'")
    return targets

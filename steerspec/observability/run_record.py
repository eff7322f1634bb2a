"""What a benchmark's or a calibration's JSON records about its run: the command line that reproduces it, and a
digest of the tokens it generated (two runs drew alike exactly when their digests agree)."""

from __future__ import annotations

import argparse
import hashlib
import json
from typing import Optional, Sequence


def command_line(prog: str, args: argparse.Namespace) -> str:
    """`prog` and the options of `args` as the command line a run's JSON records: not the dispatch keys (func,
    command, GROUP_command); options left unset (None, False) out, a set flag as the bare --flag."""
    parts = [prog]
    for key, value in vars(args).items():
        if key in ("func", "command") or key.endswith("_command") or value is None or value is False:
            continue
        parts.append(f"--{key.replace('_', '-')}" + ("" if value is True else f" {value}"))
    return " ".join(parts)


def tokens_digest(token_lists: Sequence[Optional[Sequence[int]]]) -> Optional[str]:
    """sha256 (first 16 hex digits) of every generation's token ids, in order; None when any is unknown. An A/B of a
    change compares these: equal digests, the same tokens for the same seeds."""
    if any(tokens is None for tokens in token_lists):
        return None
    text = json.dumps([[int(t) for t in tokens] for tokens in token_lists], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]

"""What a benchmark's or a calibration's JSON records about its run: the command line that reproduces it."""

from __future__ import annotations

import argparse


def command_line(prog: str, args: argparse.Namespace) -> str:
    """`prog` and the options of `args` as the command line a run's JSON records: not the dispatch keys (func,
    command, GROUP_command); options left unset (None, False) out, a set flag as the bare --flag."""
    parts = [prog]
    for key, value in vars(args).items():
        if key in ("func", "command") or key.endswith("_command") or value is None or value is False:
            continue
        parts.append(f"--{key.replace('_', '-')}" + ("" if value is True else f" {value}"))
    return " ".join(parts)

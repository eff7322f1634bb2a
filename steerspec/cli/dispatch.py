"""Command groups whose sub-commands live in their own modules (`add_arguments(parser)` + `run(args)`)."""

from __future__ import annotations

import argparse
import importlib
from typing import Sequence, Tuple


def register_group(
    subparsers: "argparse._SubParsersAction",
    group: str,
    help_text: str,
    commands: Sequence[Tuple[str, str, str]],
) -> None:
    """Add `steerspec GROUP NAME` for each (name, module, help) whose module exists."""
    parser = subparsers.add_parser(group, help=help_text, description=help_text)
    sub = parser.add_subparsers(dest=f"{group}_command", required=True, parser_class=type(parser))
    for name, module_name, help_line in commands:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                continue  # not built yet
            raise
        cmd = sub.add_parser(name, help=help_line, description=(module.__doc__ or help_line).strip())
        module.add_arguments(cmd)
        cmd.set_defaults(func=module.run)

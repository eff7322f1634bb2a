"""`steerspec trace summarize FILE`: round-trip cost breakdown from a trace file."""

from steerspec.cli.dispatch import register_group

COMMANDS = (("summarize", "steerspec.observability.trace_summary", "per-stage median and p90 from a JSONL trace file"),)


def register(subparsers) -> None:
    register_group(subparsers, "trace", "trace tools", COMMANDS)

"""The `steerspec` command: one sub-module per command group, each with a `register` function."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn, Sequence

from steerspec.errors import UsageError
from steerspec.serving import grpc_env

# Command modules; each defines `register(subparsers) -> None` and sets `func` on its parsers.
COMMAND_MODULES = (
    "steerspec.cli.run",
    "steerspec.cli.models",
    "steerspec.cli.train",
    "steerspec.cli.bench",
    "steerspec.cli.serve",
    "steerspec.cli.trace",
)


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports bad input as a single line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    """The full parser with every available command group registered."""
    parser = OneLineParser(prog="steerspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # command group not built yet
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    grpc_env.apply()  # before any command module imports grpc
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        sys.stderr.write(f"steerspec: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("steerspec: interrupted\n")
        return 130
    except Exception as exc:  # a server's status (the services path): one line, not a traceback
        code = _rpc_code(exc)
        if code is None:
            raise
        details = (exc.details() or "").splitlines() or [""]
        sys.stderr.write(f"steerspec: error: {code.name}: {details[0]}\n")
        return 2 if code.name in REQUEST_ERRORS else 1


# Statuses that say the request itself cannot be served as sent: exit 2, like any bad input.
REQUEST_ERRORS = frozenset({"INVALID_ARGUMENT", "FAILED_PRECONDITION", "OUT_OF_RANGE", "NOT_FOUND",
                            "PERMISSION_DENIED", "UNAUTHENTICATED", "UNIMPLEMENTED"})


def _rpc_code(exc: BaseException):
    """The gRPC status code of a failed call, or None for any other exception."""
    if "grpc" not in sys.modules:
        return None
    # lazy: the CLI starts without loading torch
    import grpc

    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code") and hasattr(exc, "details"):
        return exc.code()
    return None


if __name__ == "__main__":
    raise SystemExit(main())

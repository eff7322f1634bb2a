"""Service logs with timestamps, levels and logger names; `--log-format json` for log collectors.

    logs.add_arguments(parser)   # --log-level, --log-format
    logs.setup(args.log_level, args.log_format)
"""

from __future__ import annotations

import json
import logging
import sys
import time

TEXT_FORMAT = "%(asctime)s.%(msecs)03dZ %(levelname)s %(name)s: %(message)s"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC ISO 8601), level, logger, message (+ session_id when given)."""

    def format(self, record: logging.LogRecord) -> str:
        body = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        session_id = getattr(record, "session_id", None)
        if session_id:
            body["session_id"] = session_id
        if record.exc_info:
            body["exception"] = self.formatException(record.exc_info)
        return json.dumps(body)


def add_arguments(parser) -> None:
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LEVELS, help="least level logged")
    parser.add_argument("--log-format", default="text", choices=("text", "json"),
                        help="text: 'TIME LEVEL logger: message'; json: one object per line")


def setup(level: str = "INFO", fmt: str = "text", stream=None) -> logging.Handler:
    """Send the root logger's records to stderr (or `stream`) with a timestamp and level."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        formatter = logging.Formatter(TEXT_FORMAT, datefmt="%Y-%m-%dT%H:%M:%S")
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_steerspec", False)]:
        root.removeHandler(old)
    handler._steerspec = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    return handler

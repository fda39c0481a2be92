"""Every service's logging (`--log-level`, `--log-format`), set up in one place.

text: `2026-12-04 23:20:41,123 INFO pagedserve.router message`, as the services always wrote.
json: one JSON object a line, `{"ts", "level", "logger", "message"}`, plus `request_id` when
the record carries one (`log.info(..., extra={"request_id": rid})`) and `exception` (the
formatted traceback) when it has one; for log shippers (Loki, Elasticsearch, CloudWatch).

Torch-free and service-free: the router and the gateway set up their logging with it too.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from datetime import UTC, datetime
from typing import IO

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    """`--log-level` and `--log-format`, the same on every service and `pagedserve up`."""
    parser.add_argument(
        "--log-level", default="info", choices=LOG_LEVELS,
        help="the least severe log records written (stderr)",
    )  # fmt: skip
    parser.add_argument(
        "--log-format", default="text", choices=LOG_FORMATS,
        help="text: one readable line a record; json: one JSON object a line (ts, level, "
        "logger, message, request_id when the record has one)",
    )  # fmt: skip


class JsonFormatter(logging.Formatter):
    """A record as one JSON line: ts (UTC, ISO 8601, ms), level (lower case), logger, message,
    request_id (when the record has one), exception (when it has one)."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        line: dict[str, object] = {
            "ts": ts.replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id:
            line["request_id"] = request_id
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            line["exception"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False)


def setup_logging(level: str = "info", fmt: str = "text", stream: IO[str] | None = None) -> None:
    """Send every log record of `level` or above to `stream` (stderr) in format `fmt`; replaces
    whatever handlers the root logger had. ValueError for a level or format not offered."""
    if level not in LOG_LEVELS:
        raise ValueError(f"log-level: {level!r} is not one of {', '.join(LOG_LEVELS)}")
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log-format: {fmt!r} is not one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)

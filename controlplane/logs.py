"""plinth's log format (§6): one JSON object per line, keys sorted, every value a string."""

from __future__ import annotations

import datetime
import sys
import time
from typing import TextIO

import msgspec


def format_timestamp(at: float) -> str:
    """UTC RFC 3339 with second precision, e.g. `2026-01-02T03:04:05Z`."""
    return datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


_GO_JSON_ESCAPES = (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))


def log_line(at: float, level: str, msg: str, fields: dict[str, object] | tuple[tuple[str, str], ...] = ()) -> str:
    record = {"timestamp": format_timestamp(at), "level": level, "msg": msg}
    items = fields.items() if isinstance(fields, dict) else fields
    record.update((key, str(value)) for key, value in items)
    line = msgspec.json.encode(dict(sorted(record.items()))).decode()
    # Go's encoder escapes these (they can only occur inside strings, so this is exact).
    for raw, escaped in _GO_JSON_ESCAPES:
        line = line.replace(raw, escaped)
    return line


class JsonLog:
    """Writes log lines to a stream (stdout by default); one write per line, so lines never interleave.

    `context` fields go into every line `log` writes (a worker process names itself with them).
    """

    def __init__(self, stream: TextIO | None = None, clock=time.time, context: dict[str, object] | None = None):
        self.stream = stream if stream is not None else sys.stdout
        self.clock = clock
        self.context = context or {}

    def write_line(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

    def log(self, level: str, msg: str, **fields: object) -> None:
        self.write_line(log_line(self.clock(), level, msg, {**self.context, **fields}))

    def info(self, msg: str, **fields: object) -> None:
        self.log("info", msg, **fields)

    def warn(self, msg: str, **fields: object) -> None:
        self.log("warn", msg, **fields)

    def error(self, msg: str, **fields: object) -> None:
        self.log("error", msg, **fields)

"""The gateway's log lines: plinth's format (§6), one JSON object per line, keys sorted, every
value a string; or the same lines as text, for a terminal."""

from __future__ import annotations

import datetime
import math
import sys
import time
from typing import TextIO

import msgspec

from events.config import LOG_FORMATS, LOG_LEVELS, GatewayConfig


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


def text_line(at: float, level: str, msg: str, fields: dict[str, object] | tuple[tuple[str, str], ...] = ()) -> str:
    """The same line for a terminal: `2026-01-02T03:04:05Z WARN  msg  key=value key="a b"`, the
    fields in their given order, a value quoted when it is empty or has a space, `"` or `=`."""
    items = fields.items() if isinstance(fields, dict) else fields
    pairs = []
    for key, value in items:
        text = str(value)
        if not text or any(char in text for char in ' "=') or not text.isprintable():
            text = msgspec.json.encode(text).decode()
        pairs.append(f"{key}={text}")
    line = f"{format_timestamp(at)} {level.upper():<5} {msg}"
    return f"{line}  {' '.join(pairs)}" if pairs else line


_SEVERITY = {level: rank for rank, level in enumerate(LOG_LEVELS)}
LINE_FORMATTERS = {"json": log_line, "text": text_line}
"""Each of LOG_FORMATS's line renderers: the live log's, and `interlock audit --log-format`'s."""


class JsonLog:
    """The gateway's log: plinth's JSON lines (§6) by default, or `text_line`s; lines below
    `level` are dropped. Writes to a stream (stdout by default), one write per line, so lines
    never interleave.

    `context` fields go into every line `log` writes (a worker process names itself with them).
    `configure` follows a config's `gateway.log_level` and `gateway.log_format`.
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        clock=time.time,
        context: dict[str, object] | None = None,
        *,
        level: str = LOG_LEVELS[0],
        format: str = LOG_FORMATS[0],
    ):
        self.stream = stream if stream is not None else sys.stdout
        self.clock = clock
        self.context = context or {}
        self._least = _SEVERITY[level]
        self._format = LINE_FORMATTERS[format]

    def configure(self, gateway: GatewayConfig) -> None:
        self._least = _SEVERITY[gateway.log_level]
        self._format = LINE_FORMATTERS[gateway.log_format]

    def write(self, at: float, level: str, msg: str, fields: dict[str, object] | tuple[tuple[str, str], ...]) -> None:
        """One line at time `at`, unless `level` is below the log's."""
        if _SEVERITY[level] >= self._least:
            self.stream.write(self._format(at, level, msg, fields) + "\n")
            self.stream.flush()

    def log(self, level: str, msg: str, **fields: object) -> None:
        self.write(self.clock(), level, msg, {**self.context, **fields})

    def info(self, msg: str, **fields: object) -> None:
        self.log("info", msg, **fields)

    def warn(self, msg: str, **fields: object) -> None:
        self.log("warn", msg, **fields)

    def error(self, msg: str, **fields: object) -> None:
        self.log("error", msg, **fields)


def clipped(text: str, limit: int = 128) -> str:
    """`text` cut to `limit` characters, the cut marked: client text in a log line stays bounded."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Throttle:
    """Lets one log line through per `interval` seconds and counts those it holds back, for the
    next line it lets through to report."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._next_at = -math.inf
        self._held_back = 0

    def allow(self, now: float) -> int | None:
        """None: hold this line back; else write it, with the count of lines held back since the last one."""
        if now < self._next_at:
            self._held_back += 1
            return None
        held_back, self._held_back = self._held_back, 0
        self._next_at = now + self.interval
        return held_back

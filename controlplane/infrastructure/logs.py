"""The gateway's log: its lines (in `controlplane.rules.log_lines`' format) written to a stream,
and the helpers that keep what it writes bounded."""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO

from controlplane.rules.log_lines import LINE_FORMATTERS
from events.config import LOG_FORMATS, LOG_LEVELS, GatewayConfig

_SEVERITY = {level: rank for rank, level in enumerate(LOG_LEVELS)}


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

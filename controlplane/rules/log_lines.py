"""plinth's log line format (§6): one JSON object per line, keys sorted, every value a string;
or the same line as text, for a terminal. Pure functions of a line's time, level, message and
fields: the transitions render with them, and the live log writes them."""

from __future__ import annotations

import datetime

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


LINE_FORMATTERS = {"json": log_line, "text": text_line}
"""Each of LOG_FORMATS's line renderers: the live log's, and `interlock audit --log-format`'s."""

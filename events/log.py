"""The event log: JSON Lines, one event per line, rotated into numbered segments.

A log named `var/events.jsonl` is written as segments `var/events.000001.jsonl`,
`var/events.000002.jsonl`, … in order; each run of the writer starts a new segment, so a
crash can only tear the last line of a segment. Readers take segments (or the log's name,
which expands to all its segments) and yield the events in order.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import msgspec

from events.types import Event

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Event)


class EventLogError(Exception):
    """A log line that is neither a valid event nor a torn last line; names file and line."""


def encode_event(event: Event) -> bytes:
    """One log line, newline included."""
    return _encoder.encode(event) + b"\n"


def decode_event(line: bytes | str) -> Event:
    return _decoder.decode(line)


def segment_path(log_path: str | os.PathLike, number: int) -> Path:
    path = Path(log_path)
    return path.with_name(f"{path.stem}.{number:06d}{path.suffix}")


def _segment_pattern(log_path: Path) -> re.Pattern[str]:
    return re.compile(re.escape(log_path.stem) + r"\.(\d{6,})" + re.escape(log_path.suffix) + "$")


def list_segments(log_path: str | os.PathLike) -> list[Path]:
    """The existing segments of a log, oldest first."""
    path = Path(log_path)
    folder = path.parent
    if not folder.is_dir():
        return []
    pattern = _segment_pattern(path)
    numbered = [(int(m.group(1)), folder / name) for name in os.listdir(folder) if (m := pattern.match(name))]
    return [p for _, p in sorted(numbered)]


def expand_log_paths(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Each argument is a segment file, or a log's name standing for all of its segments."""
    expanded: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            expanded.append(path)
            continue
        segments = list_segments(path)
        if not segments:
            raise EventLogError(f"{path}: no such event log or segment")
        expanded.extend(segments)
    return expanded


def read_events(
    paths: Iterable[str | os.PathLike],
    warn: Callable[[str], None] | None = None,
    skip_invalid: Callable[[str], None] | None = None,
) -> Iterator[Event]:
    """Yield the events of the given segments in order.

    A last line that is not even JSON is a torn write (a crash): it is skipped and reported
    through `warn`. Any other bad line, a complete last line of an unknown event type included,
    raises EventLogError naming the file and line number; or, given `skip_invalid`, is skipped
    and reported to it (for a damaged log).
    """
    for path in expand_log_paths(paths):
        lines = _segment_lines(path)
        last = len(lines)
        for number, line in enumerate(lines, start=1):
            try:
                yield _decoder.decode(line)
            except msgspec.DecodeError as err:
                if number == last and _is_torn(line):
                    if warn is not None:
                        warn(f"{path}:{number}: skipping torn last line ({err})")
                    continue
                if skip_invalid is not None:
                    skip_invalid(f"{path}:{number}: skipping invalid line ({err})")
                    continue
                raise EventLogError(f"{path}:{number}: {err}") from None


def _segment_lines(path: Path) -> list[bytes]:
    with open(path, "rb") as segment:
        lines = segment.read().split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return lines


def _is_torn(line: bytes) -> bool:
    """A line cut short by a crash is never a whole JSON value (an event is an object)."""
    try:
        msgspec.json.decode(line)
    except msgspec.DecodeError:
        return True
    return False


def last_seq(log_path: str | os.PathLike) -> int:
    """The highest seq recorded in a log (0 if none), so a new run continues the numbering.

    Seqs only grow within a log, so this is the seq of the last line that decodes, read from
    the end (a start-up need not decode a whole 64 MiB segment). Lines that do not decode are
    passed over: a damaged segment's good lines still count, so a new run never reuses them.
    """
    for segment in reversed(list_segments(log_path)):
        for line in reversed(_segment_lines(segment)):
            try:
                return _decoder.decode(line).seq
            except msgspec.DecodeError:
                continue
    return 0


class EventLogWriter:
    """Appends events to the log, starting a new segment per run and whenever one is full.

    Synchronous and unbuffered beyond the OS: the runtime calls it off the reducer's path and
    turns its OSErrors into an error log line and a metric.
    """

    def __init__(self, log_path: str | os.PathLike, max_segment_bytes: int):
        if max_segment_bytes <= 0:
            raise ValueError("max_segment_bytes must be positive")
        self.log_path = Path(log_path)
        self.max_segment_bytes = max_segment_bytes
        existing = list_segments(self.log_path)
        self._next_number = (int(_segment_pattern(self.log_path).match(existing[-1].name).group(1)) + 1) if existing else 1
        self._file = None
        self._size = 0

    @property
    def current_segment(self) -> Path | None:
        return Path(self._file.name) if self._file is not None else None

    def _open_next_segment(self) -> None:
        self.close()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        path = segment_path(self.log_path, self._next_number)
        self._next_number += 1
        self._file = open(path, "ab", buffering=0)
        self._size = 0

    def write_lines(self, lines: bytes) -> None:
        """Write already-encoded lines (whole lines only), rotating before a segment overflows."""
        if self._file is None or (self._size and self._size + len(lines) > self.max_segment_bytes):
            self._open_next_segment()
        self._file.write(lines)
        self._size += len(lines)

    def append(self, event: Event) -> None:
        self.write_lines(encode_event(event))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

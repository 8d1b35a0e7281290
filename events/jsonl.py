"""JSON Lines logs on disk: the segments a log is made of, and the one tolerant reader.

Both of the gateway's logs (the event log, the decision log) are written the same way: a log
named `var/events.jsonl` is the segments `var/events.000001.jsonl`, `var/events.000002.jsonl`, …
in order, and a writer only ever appends whole lines. A log written before it was segmented
(one plain file) is read too: a path that is a file is read as it is.

The torn-last-line rule, the same for every log: the last line of a segment that does not
decode and is not even a JSON value is a write cut short (a crash), skipped with a warning;
any other line that does not decode is an error naming the file and line. A line nested deeper
than msgspec decodes (its RecursionError) is such a line: the gateway never writes one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import msgspec

Record = TypeVar("Record")


class LogFileError(Exception):
    """A log that cannot be read: a line that is neither a valid record nor a torn last line
    (the message starts with `file:line:`), or a log that does not exist."""


def segment_path(log_path: str | os.PathLike, number: int) -> Path:
    path = Path(log_path)
    return path.with_name(f"{path.stem}.{number:06d}{path.suffix}")


def segment_number(log_path: str | os.PathLike, segment: Path) -> int | None:
    """The number of `segment` if it is one of the log's segments, else None."""
    path = Path(log_path)
    pattern = re.escape(path.stem) + r"\.(\d{6,})" + re.escape(path.suffix)
    match = re.fullmatch(pattern, segment.name)
    return int(match.group(1)) if match else None


def list_segments(log_path: str | os.PathLike) -> list[Path]:
    """The existing segments of a log, oldest first."""
    path = Path(log_path)
    folder = path.parent
    if not folder.is_dir():
        return []
    numbered = [(number, folder / name) for name in os.listdir(folder) if (number := segment_number(path, Path(name)))]
    return [segment for _, segment in sorted(numbered)]


def expand_log_paths(paths: Iterable[str | os.PathLike], what: str = "event log") -> list[Path]:
    """Each argument is a segment (or any file), or a log's name standing for all of its segments;
    `what` names the kind of log in the error for neither."""
    expanded: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            expanded.append(path)
            continue
        segments = list_segments(path)
        if not segments:
            raise LogFileError(f"{path}: no such {what} or segment")
        expanded.extend(segments)
    return expanded


def read_records(
    paths: Iterable[str | os.PathLike],
    decoder: msgspec.json.Decoder[Record],
    warn: Callable[[str], None] | None = None,
    what: str = "event log",
    skip_invalid: Callable[[str], None] | None = None,
) -> Iterator[tuple[Path, Record]]:
    """Each record of the given segments (or logs) in order, with the segment it is in; the
    torn-last-line rule of the module docstring applies (the warning goes to `warn`). Given
    `skip_invalid` (for a damaged log), any other bad line is skipped and reported to it."""
    for path in expand_log_paths(paths, what):
        for number, (line, last) in enumerate(_with_last(segment_lines(path)), start=1):
            try:
                record = decode_line(decoder, line)
            except msgspec.DecodeError as err:
                if last and _is_torn(line):
                    if warn is not None:
                        warn(f"{path}:{number}: skipping torn last line ({err})")
                    continue
                if skip_invalid is not None:
                    skip_invalid(f"{path}:{number}: skipping invalid line ({err})")
                    continue
                raise LogFileError(f"{path}:{number}: {err}") from None
            yield path, record


NESTED_TOO_DEEP = "JSON is nested too deep"


def decode_line(decoder: msgspec.json.Decoder[Record], line: bytes) -> Record:
    """`decoder.decode(line)`, with a line nested too deep to decode a DecodeError like any other."""
    try:
        return decoder.decode(line)
    except RecursionError:
        raise msgspec.DecodeError(NESTED_TOO_DEEP) from None


def segment_lines(path: Path) -> Iterator[bytes]:
    """The lines of one segment, newlines removed, read one at a time: a log may be larger than
    the memory a reader should take."""
    with open(path, "rb") as segment:
        for line in segment:
            yield line.removesuffix(b"\n")


def segment_lines_backwards(path: Path, block_size: int = 1 << 16) -> Iterator[bytes]:
    """The lines of one segment, last first, newlines removed, read from the end a block at a
    time (a start-up that needs only the last lines reads only those)."""
    with open(path, "rb") as segment:
        position = size = segment.seek(0, os.SEEK_END)
        line_end: list[bytes] = []  # what is read of the line being read, its blocks last first
        while position > 0:
            step = min(block_size, position)
            position -= step
            segment.seek(position)
            block = segment.read(step)
            if position + step == size:
                block = block.removesuffix(b"\n")  # the file's last newline ends its last line
            *line_starts, rest = block.split(b"\n")
            line_end.append(rest)
            for start in reversed(line_starts):
                yield b"".join(reversed(line_end))
                line_end = [start]
        if size:
            yield b"".join(reversed(line_end))


def _with_last(items: Iterator[bytes]) -> Iterator[tuple[bytes, bool]]:
    """Each item, and whether it is the last."""
    previous = next(items, None)
    for item in items:
        yield previous, False
        previous = item
    if previous is not None:
        yield previous, True


def _is_torn(line: bytes) -> bool:
    """A line cut short is never a whole JSON value (every record is an object); nor is it
    nested too deep to decode, which no record is."""
    try:
        msgspec.json.decode(line)
    except msgspec.DecodeError:
        return True
    except RecursionError:
        return False  # too deep to tell whether it is whole
    return False

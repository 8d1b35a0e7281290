"""The one tolerant reader of JSON Lines logs (the event log, the decision log), whose writer
(`journal/writer.py`) only ever appends whole lines to the segments (`journal/segments.py`).

The torn-last-line rule, the same for every log: the last line of a segment that does not
decode and is not even a JSON value is a write cut short (a crash), skipped with a warning;
any other line that does not decode is an error naming the file and line. A line nested deeper
than msgspec decodes (its RecursionError) is such a line: the gateway never writes one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import msgspec

from journal.segments import LogFileError, expand_log_paths

Record = TypeVar("Record")


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

"""The event log: JSON Lines, one event per line, in numbered segments (`events.jsonl`).

Each run of the gateway starts a new segment; a segment opens with the run's `run_started` or
with a `checkpoint` carrying the whole state, so that whatever segments remain can be replayed
(`journal.writer` writes it, `journal.segments` and `journal.reader` have the segments and the reading rules).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator

import msgspec

from events.types import Event
from journal.reader import decode_line, read_records, segment_lines_backwards
from journal.segments import list_segments

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Event)


def encode_event(event: Event) -> bytes:
    """One log line, newline included."""
    return _encoder.encode(event) + b"\n"


def decode_event(line: bytes | str) -> Event:
    return _decoder.decode(line)


def decode_events(lines: bytes) -> list[Event]:
    """The events of a block of whole log lines, in order, in one call."""
    return _decoder.decode_lines(lines)


def read_events(
    paths: Iterable[str | os.PathLike],
    warn: Callable[[str], None] | None = None,
    skip_invalid: Callable[[str], None] | None = None,
) -> Iterator[Event]:
    """The events of the given segments (or logs) in order. A torn last line is skipped and
    reported through `warn`; any other bad line, a complete line of an unknown event type
    included, raises LogFileError naming the file and line number, or, given `skip_invalid`
    (for a damaged log), is skipped and reported to it."""
    for _, event in read_records(paths, _decoder, warn, skip_invalid=skip_invalid):
        yield event


def last_seq(log_path: str | os.PathLike) -> int:
    """The highest seq recorded in a log (0 if none), so a new run continues the numbering.

    Seqs only grow within a log, so this is the seq of the last line that decodes, read from
    the end (a start-up need not decode a whole 64 MiB segment). Lines that do not decode are
    passed over: a damaged segment's good lines still count, so a new run never reuses them.
    """
    for segment in reversed(list_segments(log_path)):
        for line in segment_lines_backwards(segment):
            try:
                return decode_line(_decoder, line).seq
            except msgspec.DecodeError:
                continue
    return 0

"""`interlock fleet export DIR`: the fleet's event stream as the JSON Lines event log that
`replay`, `explain`, `audit`, `whatif` and `timeline` read (`DIR/events.jsonl`), and its
decision stream as the decision log they read (`DIR/decisions.jsonl`).

Each message of the stream holds a batch of consecutive events as JSON Lines, so the export is
the messages' events in order; a message that does not continue them (`continuing_events`) is
set aside, as every replica sets it aside, and named on stderr. When retention has removed the
stream's first events (the first message's first event is not seq 1), the file starts with the
newest checkpoint the remaining events follow, as a later log segment does.

A replica's partitions (`fleet.partition`) are not on the stream: each is a directory of the
replica's `partition_dir`, which the export is given (`--partitions`, one per replica or a
directory they share) and writes beside the stream's as `DIR/partitions/<name>/events.jsonl`
and `partition.json`. The records routed in a partition are in `DIR/decisions.jsonl` with the
others (so each routing process's numbering is whole), each naming its partition; `explain` and
`verify` read them against the partition's events with `--partition <name>`. A partition that
records name and no given directory holds is named on stderr: its events are not in the export.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import trio

import msgspec

from events.config import FleetConfig
from events.log import decode_event, decode_events, encode_event, read_events
from fleet.jetstream import MessageSetAside, command_link, continuing_events
from fleet.partition import PARTITION_EVENTS, PARTITION_RECORD, PartitionRecord
from journal.segments import LogFileError, list_segments


EXPORTED_EVENTS = "events.jsonl"
EXPORTED_DECISIONS = "decisions.jsonl"
"""The export's event log and decision log, in its directory (`check-config --against DIR` reads them)."""


class ExportError(Exception):
    """The stream cannot be read as a log (nothing in it, or a gap no checkpoint bridges)."""


def _name_on_stderr(message_seq: int, reason: str) -> None:
    print(f"interlock: fleet export: message {message_seq} of the event stream set aside: {reason}", file=sys.stderr)


async def export_events(
    fleet: FleetConfig, directory: Path, set_aside: Callable[[int, str], None] = _name_on_stderr
) -> tuple[Path, int]:
    """Write the fleet's event stream to `directory/events.jsonl`; the path and the events
    written. `set_aside(message_seq, reason)` is told of each message set aside."""

    async with command_link(fleet) as link:
        first_message, last_message = await link.message_seqs()
        if last_message == 0:
            raise ExportError(f"the fleet's event stream {link.names.events} is empty")
        messages = await link.read_messages(first_message, last_message)
        lines: list[bytes] = []
        expected = _first_seq(messages)
        if expected > 1:
            stored = await link.newest_checkpoint()
            checkpoint = None if stored is None else decode_event(stored.line)
            if checkpoint is None or checkpoint.seq < expected - 1:
                raise ExportError(f"the stream starts at event seq {expected} and no checkpoint reaches back to it")
            lines.append(stored.line)
            expected = checkpoint.seq + 1
        for message_seq, data in messages:
            try:
                events = continuing_events(data, expected)
            except MessageSetAside as aside:
                set_aside(message_seq, str(aside))
                continue
            lines += [encode_event(event) for event in events]
            expected += len(events)
    path = _write(directory / EXPORTED_EVENTS, b"".join(lines))
    return path, len(lines)


def _first_seq(messages: list[tuple[int, bytes]]) -> int:
    """The seq of the first event of the first message that decodes (1 when none does)."""
    for _, data in messages:
        try:
            events = decode_events(data)
        except ValueError:  # msgspec's DecodeError is one
            continue
        if events:
            return events[0].seq
    return 1


async def export_decisions(fleet: FleetConfig, directory: Path) -> tuple[Path, int]:
    """Write the fleet's decision stream (`fleet.decisions`: JSON Lines batches) to
    `directory/decisions.jsonl`; the path and the records written (an empty file for a fleet
    that has recorded none)."""
    batches: list[bytes] = []
    async with command_link(fleet) as link:
        async for batch in link.read_decision_batches():
            batches.append(batch)
    path = _write(directory / EXPORTED_DECISIONS, b"".join(batches))
    return path, sum(batch.count(b"\n") for batch in batches)


class _RoutedIn(msgspec.Struct):
    """Of a decision record, only the partition it was routed in."""

    partition: str = ""


def partitions_named(decisions: Path) -> set[str]:
    """The partitions the records of the exported decision log were routed in."""
    decoder = msgspec.json.Decoder(_RoutedIn)
    with decisions.open("rb") as lines:
        return {name for line in lines if line.strip() and (name := decoder.decode(line).partition)}


def export_partitions(sources: list[Path], directory: Path) -> list[PartitionRecord]:
    """Write every partition the `sources` (replicas' `partition_dir`s) hold as
    `directory/partitions/<name>/`: its events (the segments as one log; a torn last line left
    out, named on stderr) and its `partition.json`; the partitions written."""
    written = []
    for source in sources:
        if not source.is_dir():
            raise ExportError(f"{source}: no such directory of partitions")
        for found in sorted(source.iterdir()):
            if not (found / PARTITION_RECORD).is_file():
                continue
            try:
                record = msgspec.json.decode((found / PARTITION_RECORD).read_bytes(), type=PartitionRecord)
            except msgspec.DecodeError as error:
                raise ExportError(f"{found / PARTITION_RECORD}: {error}") from None
            target = directory / "partitions" / record.partition
            target.mkdir(parents=True, exist_ok=True)
            lines = []
            if list_segments(found / PARTITION_EVENTS):  # none until its first event
                warn = partial(print, file=sys.stderr)
                try:
                    lines = [encode_event(event) for event in read_events([found / PARTITION_EVENTS], warn=warn)]
                except LogFileError as error:
                    raise ExportError(str(error)) from None
            _write(target / PARTITION_EVENTS, b"".join(lines))
            _write(target / PARTITION_RECORD, (found / PARTITION_RECORD).read_bytes())
            written.append(record)
    return written


def _write(path: Path, data: bytes) -> Path:
    """Write `path` whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)
    return path


def run_export(fleet: FleetConfig, directory: Path) -> tuple[Path, int]:
    return trio.run(export_events, fleet, directory)


def run_export_decisions(fleet: FleetConfig, directory: Path) -> tuple[Path, int]:
    return trio.run(export_decisions, fleet, directory)

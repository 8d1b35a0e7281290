"""A replica's partition: routing on its own probes while the fleet's event stream is away.

A replica that has not reached the stream for `fleet.partition_after` (and does not lead)
enters a partition: it probes the nodes itself and numbers its own events through the same
apply path, so a node that dies during a NATS outage is excluded by every replica within the
health rules' time. Its seqs go on from the fleet's last seq it applied plus PARTITION_SEQ_GAP
(the fleet's state taken up again at that seq, a checkpoint): seqs the fleet's events do not
reach, so a decision record's seq says whether it was routed in the partition, also when the
record is made after the partition ended (a stream still relayed then). The partition's events
are recorded as they are applied, in the replica's partition directory (`fleet.partition_dir`),
one directory per partition named `<replica>-from-<seq>-<UTC time>`:

- `events.jsonl` (segments, as an event log): a checkpoint of the fleet's state it started
  from (at the partition's first seq), then its own events;
- `partition.json`: which replica, from which fleet seq, its first and last seqs, when it
  started and ended (`PartitionRecord`).

Files, not a publish when NATS returns: they are written as the events happen, so a replica
killed during the outage, or before NATS is back, loses none of them, and no memory bound
decides what is kept. `interlock fleet export --partitions DIR` gathers them beside the
stream's events. The decision records the replica makes on the partition's state name it
(`Decision.partition`) and go to the fleet's decision stream like any others (`fleet.decisions`
keeps them meanwhile).

When the fleet's events flow again (the follower receives a message of the stream, or the
replica's term as leader begins) the partition ends: the fleet's state at the seq it started
from is put back (a checkpoint, through the apply path: the replica's workers take it too) and
the follower goes on from there. NATS answering is not enough: until a leader appends, the
partition's probes are the only ones. The fleet's state wins; the partition's events are never published as the fleet's.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import prometheus_client
import trio

from controlplane.effects.applier import Applier
from controlplane.effects.control_plane import event_log_appender
from controlplane.effects.event_queue import EventQueue
from controlplane.effects.held_state import HeldState
from controlplane.effects.prober import Prober
from controlplane.effects.probes import ProbeClient
from controlplane.infrastructure.logs import JsonLog
from events.config import FleetConfig
from events.state import ClusterState
from events.types import Checkpoint, Event
from journal.writer import LogAppender, SegmentedFile

PARTITION_SEQ_GAP = 1_000_000_000
"""A partition's seqs start this far past the fleet's seq it started from (module docstring)."""

PARTITIONS_KEPT = 8
"""The last partitions whose seqs name the records routed in them (`Partitions.partition_of`)."""

PARTITION_EVENTS = "events.jsonl"
PARTITION_RECORD = "partition.json"


class PartitionRecord(msgspec.Struct, kw_only=True):
    """`partition.json`: one partition of one replica."""

    partition: str
    """Its name, the directory's (`Decision.partition` in the records routed in it)."""
    replica: str
    from_seq: int
    """The fleet's last event seq the replica had applied: its state is the partition's first."""
    first_seq: int
    """The seq of its first state (from_seq + PARTITION_SEQ_GAP): its events are numbered on from it."""
    started_at: float
    """UNIX seconds."""
    ended_at: float | None = None
    """UNIX seconds; None while it lasts (or when the replica died during it)."""
    last_seq: int = 0
    """The last seq it numbered (its events are first_seq + 1 to last_seq); 0 while it lasts."""

    def interval(self) -> str:
        """`/health`'s words for it: who, from which seq, from when (to when)."""
        span = _utc(self.started_at) + ("" if self.ended_at is None else f" to {_utc(self.ended_at)}")
        return f"{self.replica} from fleet seq {self.from_seq}, {span}"


def _utc(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class _Current:
    """The partition under way: its record, the fleet's state it started from, its task's scope."""

    def __init__(self, record: PartitionRecord, fleet_state: ClusterState) -> None:
        self.record = record
        self.fleet_state = fleet_state
        self.scope = trio.CancelScope()
        self.queue: EventQueue | None = None


class PartitionMetrics:
    def __init__(self, registry: prometheus_client.CollectorRegistry, partitions: Partitions) -> None:
        self.partitioned = prometheus_client.Gauge(
            "interlock_fleet_partitioned",
            "1 while this replica, without the fleet's stream for longer than partition_after, probes the nodes and "
            "routes on its own events (X-Interlock-Partition names the partition)",
            registry=registry,
        )
        self.partitioned.set_function(lambda: 1.0 if partitions.current() else 0.0)
        self.partitions = prometheus_client.Counter(
            "interlock_fleet_partitions_total", "Partitions this replica entered", registry=registry
        )
        self.record_errors = prometheus_client.Counter(
            "interlock_fleet_partition_record_errors_total",
            "Partitions whose directory or record could not be written (each logged; the replica partitions anyway; "
            "a failed write of a partition's events counts in interlock_event_log_write_errors_total)",
            registry=registry,
        )


class Partitions:
    """This replica's partitions (module docstring): `run` enters one when the stream has been
    away for `partition_after`; `end` ends it."""

    def __init__(
        self,
        fleet: FleetConfig,
        *,
        view: HeldState,
        applier: Applier,
        log: JsonLog,
        registry: prometheus_client.CollectorRegistry,
        may_partition: Callable[[], bool],
    ) -> None:
        """`may_partition()`: whether the replica may enter a partition now (it does not lead).
        A partition's event log and queue count in the replica's control-plane metrics
        (`applier.metrics`), as the gateway's own event log and queue do."""
        self._fleet = fleet
        self._view = view
        self._applier = applier
        self._log = log
        self._may_partition = may_partition
        self._stream_reached_at = time.monotonic()
        self._current: _Current | None = None
        self._recent: deque[PartitionRecord] = deque(maxlen=PARTITIONS_KEPT)
        """The last partitions, the newest last (the current one included)."""
        self.metrics = PartitionMetrics(registry, self)

    def current(self) -> PartitionRecord | None:
        return None if self._current is None else self._current.record

    def last(self) -> PartitionRecord | None:
        """The last partition that ended, for `/health`."""
        return next((record for record in reversed(self._recent) if record.ended_at is not None), None)

    def partition_of(self, seq: int) -> str:
        """The partition a decision routed on `seq` was routed in ("" for the fleet's state)."""
        for record in reversed(self._recent):
            if record.first_seq <= seq and (record.ended_at is None or seq <= record.last_seq):
                return record.partition
        return ""

    def observe(self, event: Event) -> bool:
        """Take a data-plane observation while in a partition (to be numbered here); False when
        not in one (it goes to the fleet's leader)."""
        current = self._current
        if current is None or current.queue is None:
            return False
        current.queue.observe(event)
        return True

    def fleet_seq(self, held: int) -> int:
        """The fleet's seq the replica's state stands for, `held` being its state's seq: the
        fleet's seq a partition under way started from."""
        return held if self._current is None else self._current.record.from_seq

    def stream_answered(self) -> None:
        """A read of the fleet's stream succeeded: no partition begins. One under way goes on
        until the fleet's events flow again (`end`): NATS may answer a while before a leader
        appends, and meanwhile the partition's probes are the only ones."""
        self._stream_reached_at = time.monotonic()

    def end(self) -> None:
        """The fleet's events flow again (a message of the stream, or this replica leads): the
        partition, if any, ends at once, the fleet's state it started from put back (the stream
        is applied on from there). An event of the partition that its task had already taken
        from the queue is dropped, never numbered on the fleet's state."""
        self._stream_reached_at = time.monotonic()
        current, self._current = self._current, None
        if current is None:
            return
        record = current.record
        record.ended_at = self._view.now()
        record.last_seq = self._view.snapshot.seq
        self._applier.event_log = None
        self._applier.prober = None
        current.scope.cancel()
        self._applier.apply(Checkpoint.of(current.fleet_state))
        self._log.info(
            "fleet: partition ended; following the fleet's stream again",
            partition=record.partition,
            from_seq=record.from_seq,
            last_seq=record.last_seq,
        )

    async def run(self, client: ProbeClient) -> None:
        """Enter a partition whenever the stream has been away for `partition_after` and the
        replica holds a state of the fleet and does not lead; serve it until it ends."""
        after = self._fleet.partition_after
        while True:
            await trio.sleep(min(after, self._fleet.lease_renewal))
            away = time.monotonic() - self._stream_reached_at
            if away >= after and self._view.snapshot.seq > 0 and self._may_partition():
                await self._serve(client)

    async def _serve(self, client: ProbeClient) -> None:
        state = self._view.snapshot
        started = self._view.now()
        name = f"{self._fleet.replica}-from-{state.seq}-{datetime.fromtimestamp(started, UTC):%Y%m%dT%H%M%SZ}"
        record = PartitionRecord(
            partition=name,
            replica=self._fleet.replica,
            from_seq=state.seq,
            first_seq=state.seq + PARTITION_SEQ_GAP,
            started_at=started,
        )
        current = self._current = _Current(record, state)
        self._recent.append(record)
        self._applier.apply(msgspec.structs.replace(Checkpoint.of(state), seq=record.first_seq))
        self.metrics.partitions.inc()
        self._log.warn(
            "fleet: partitioned from the fleet's stream; probing the nodes and routing on this replica's own events",
            partition=name,
            from_seq=state.seq,
            seconds_without_stream=f"{self._fleet.partition_after:g}",
        )
        directory = Path(self._fleet.partition_dir) / name
        event_log = await self._open_event_log(directory, record)
        try:
            with current.scope:
                await trio.lowlevel.checkpoint()  # ended already (the fleet's events came meanwhile): no further
                async with trio.open_nursery() as nursery:
                    if event_log is not None:
                        nursery.start_soon(event_log.run)
                        self._applier.event_log = event_log
                    current.queue = EventQueue(self._applier.metrics.observations_dropped)
                    self._applier.prober = prober = Prober(client, self._view, current.queue.emit)
                    await nursery.start(prober.run)
                    while True:
                        event, _ = await current.queue.receive()
                        if self._current is not current:
                            break  # `end` came after the event was handed over: the fleet's state is back
                        self._applier.apply(msgspec.structs.replace(event, seq=self._view.snapshot.seq + 1))
        finally:
            if self._current is current:  # not ended by the stream: the replica stops
                self._current = None
                self._applier.event_log = self._applier.prober = None
                record.ended_at, record.last_seq = self._view.now(), self._view.snapshot.seq
            with trio.CancelScope(shield=True):
                if event_log is not None:
                    await event_log.aclose()
                    await self._write_record(directory, record)

    async def _open_event_log(self, directory: Path, record: PartitionRecord) -> LogAppender | None:
        """The partition's event log (its first segment opens with a checkpoint of the fleet's
        state), its record written; None, logged and counted, when the directory cannot be."""

        def make() -> SegmentedFile:
            directory.mkdir(parents=True, exist_ok=True)
            file = SegmentedFile(
                directory / PARTITION_EVENTS,
                "partition event log",
                max_segment_bytes=self._view.snapshot.config.gateway.event_log_max_bytes,
            )
            file.lock()
            return file

        try:
            file = await trio.to_thread.run_sync(make)
        except OSError as error:
            self.metrics.record_errors.inc()
            self._log.error("fleet: cannot record the partition", path=str(directory), error=str(error))
            return None
        await self._write_record(directory, record)
        return event_log_appender(file, self._log, self._applier.metrics)

    async def _write_record(self, directory: Path, record: PartitionRecord) -> None:
        path = directory / PARTITION_RECORD
        data = msgspec.json.format(msgspec.json.encode(record)) + b"\n"

        def write() -> None:
            temporary = path.with_suffix(".json.tmp")
            temporary.write_bytes(data)
            os.replace(temporary, path)

        try:
            await trio.to_thread.run_sync(write)
        except OSError as error:
            self.metrics.record_errors.inc()
            self._log.error("fleet: cannot write the partition's record", path=str(path), error=str(error))

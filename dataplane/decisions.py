"""Writing the decision log: one record (`events.decisions.Decision`) per completion request
that reached routing. Each routing process (the gateway serving alone, or each worker) numbers
its records as it makes them (`NumberedRecords`), so that a record lost or repeated on its way to
the log shows in `interlock verify`. Recording never waits: `DecisionLog` hands records to the
appender the event log uses too (batched, off the trio thread, bounded; a full backlog drops and
counts).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec
from prometheus_client import CollectorRegistry, Counter

from controlplane.infrastructure.journals import open_configured_log
from controlplane.infrastructure.logs import JsonLog
from events.config import GatewayConfig
from events.decisions import Decision
from journal.writer import LogAppender, SegmentedFile


class DecisionRecorder(Protocol):
    """Where the request path hands its decision records (never blocking)."""

    def record(self, decision: Decision) -> None: ...


class NumberedRecords:
    """The recorder of one routing process (a gateway serving alone, or one worker): each
    record named after the worker and numbered in the order the process made them
    (`Decision.number`), before anything on its way to the log can drop or repeat it."""

    __slots__ = ("_recorder", "_worker", "_made")

    def __init__(self, recorder: DecisionRecorder, worker: int) -> None:
        self._recorder = recorder
        self._worker = worker
        self._made = 0

    def record(self, decision: Decision) -> None:
        self._made += 1
        self._recorder.record(msgspec.structs.replace(decision, worker=self._worker, number=self._made))


DECISION_LOG_BACKLOG = 10_000
"""Records waiting for the disk; beyond that the newest are dropped (and counted)."""


class DecisionLog:
    """The decision log's appender (`journal.writer`): records are queued, never waited
    for, and written in batches from a worker thread; a failing write is counted and logged once
    per streak, and never reaches the requests. `open_decision_log` locks the file first."""

    def __init__(self, file: SegmentedFile, log: JsonLog, registry: CollectorRegistry) -> None:
        self.replica = socket.gethostname()
        self.appender = LogAppender(
            file,
            log=log,
            write_errors=Counter(
                "interlock_decision_log_write_errors_total", "Failed writes to the decision log", registry=registry
            ),
            dropped=Counter(
                "interlock_decision_log_dropped_records_total",
                "Decision records dropped: the backlog was full",
                registry=registry,
            ),
            backlog_limit=DECISION_LOG_BACKLOG,
        )

    def record(self, decision: Decision) -> None:
        """Queue a decision, naming this replica; never blocks (a full backlog drops it)."""
        self.appender.submit(encode_decision(decision, self.replica))


class LineSink(Protocol):
    """A destination of encoded decision records that never blocks (a full backlog drops)."""

    def submit(self, line: bytes) -> None: ...


class DecisionFanOut:
    """A replica's recorder with several destinations: each record is named after the replica
    and the partition it was routed in, if any (`partition_of(seq)`, `fleet.partition`),
    encoded once, and handed to every sink (a fleet's replica: its decision log's appender and
    the fleet's decision stream, `fleet.decisions`)."""

    def __init__(self, replica: str, sinks: Sequence[LineSink], partition_of: Callable[[int], str]) -> None:
        self.replica = replica
        self._sinks = tuple(sinks)
        self._partition_of = partition_of

    def record(self, decision: Decision) -> None:
        line = encode_decision(decision, self.replica, self._partition_of(decision.seq))
        for sink in self._sinks:
            sink.submit(line)


_encode = msgspec.json.Encoder().encode


def encode_decision(decision: Decision, replica: str, partition: str = "") -> bytes:
    """The decision log's line for `decision`, naming `replica` as the gateway that routed it
    (and the replica's `partition` it was routed in)."""
    return _encode(msgspec.structs.replace(decision, replica=replica, partition=partition)) + b"\n"


def open_decision_log(gateway: GatewayConfig, log: JsonLog, registry: CollectorRegistry) -> DecisionLog | None:
    """The configured decision log with its lock taken (`open_configured_log`), or None when
    there is none."""
    if not gateway.decision_log:
        return None
    file = open_configured_log(gateway, "decision_log", "decision log")
    return DecisionLog(file, log, registry)

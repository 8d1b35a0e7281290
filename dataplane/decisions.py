"""Decision records: why each proxied request went where it went, as JSON Lines.

One record per completion request that reached routing (past the body checks): its id, the model,
the seq of the snapshot it was routed on (so `interlock explain --until-seq` over the event log
shows the same cluster), the ring pool, the nodes excluded and why, every attempt, the final
status and the duration. Recording never waits: `DecisionLog` hands records to the appender the
event log uses too (batched, off the trio thread, bounded; a full backlog drops and counts).

`find_decisions` reads a log back, for `interlock explain --request-id`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import msgspec
from prometheus_client import CollectorRegistry, Counter

from controlplane.journals import open_configured_log
from controlplane.logs import JsonLog
from controlplane.policies import CandidateScore
from events.config import GatewayConfig
from journal.reader import read_records
from journal.writer import LogAppender, SegmentedFile

# Outcomes of one attempt.
COMPLETED = "completed"
"""The node's whole response reached the client."""
TRUNCATED = "truncated"
"""Committed, then the node failed: the client got a response cut short."""
RETRIED = "retried"
"""A failure before anything was sent to the client; the next node was tried."""
FAILED = "failed"
"""A failure that ends the request with 502 (not retried: the node may have started work)."""
CLIENT_GONE = "client_gone"
"""The client went away during the attempt."""


class Exclusion(msgspec.Struct, frozen=True):
    node: str
    reason: str
    """missing, empty or expired (the model filter), dead, or offline."""


class AttemptRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    node: str
    outcome: str
    status: int | None = None
    """The node's HTTP status, when it answered."""
    error: str = ""


class Decision(msgspec.Struct, frozen=True):
    request_id: str
    at: float
    """When the request arrived (UNIX seconds)."""
    path: str
    model: str
    stream: bool
    seq: int
    """The seq of the control-plane snapshot the request was routed on."""
    ring: str
    ring_pool: tuple[str, ...]
    excluded: tuple[Exclusion, ...]
    attempts: tuple[AttemptRecord, ...]
    status: int | None
    """The status the client got; None when the client went away first."""
    duration: float
    worker: int = 0
    """The worker process that routed it (`serve --workers`); 0 in a gateway without workers."""
    replica: str = ""
    """The gateway that routed it, by its host's name (a pod's name in Kubernetes), so that the
    records of several replicas can be told apart; "" in records from before it was recorded."""
    policy: str = "round_robin"
    """The policy that chose the first attempt's node (records from before policies: round robin)."""
    prefix: str = ""
    """A short hash of the prompt's prefix (`routing.prefix_*`), recorded under every policy so
    that `interlock whatif` can route the request by prefix; never the prompt itself."""
    rotation: int = 0
    """The round-robin counter the first pick was made with (ties and round robin follow it)."""
    candidates: tuple[CandidateScore, ...] = ()
    """The first pick's candidates, best first, as the policy scored them."""
    margin: float | None = None
    """The chosen node's score lead over the next candidate; None with a single candidate."""
    remembered: str = ""
    """prefix_affinity: the node this process last sent the prefix to, tried first ("" if none)."""


class DecisionRecorder(Protocol):
    """Where the request path hands its decision records (never blocking)."""

    def record(self, decision: Decision) -> None: ...


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
    """A replica's recorder with several destinations: each record is named after the replica,
    encoded once, and handed to every sink (a fleet's replica: its decision log's appender and
    the fleet's decision stream, `fleet.decisions`)."""

    def __init__(self, replica: str, sinks: Sequence[LineSink]) -> None:
        self.replica = replica
        self._sinks = tuple(sinks)

    def record(self, decision: Decision) -> None:
        line = encode_decision(decision, self.replica)
        for sink in self._sinks:
            sink.submit(line)


_encode = msgspec.json.Encoder().encode


def encode_decision(decision: Decision, replica: str) -> bytes:
    """The decision log's line for `decision`, naming `replica` as the gateway that routed it."""
    return _encode(msgspec.structs.replace(decision, replica=replica)) + b"\n"


def open_decision_log(gateway: GatewayConfig, log: JsonLog, registry: CollectorRegistry) -> DecisionLog | None:
    """The configured decision log with its lock taken (`open_configured_log`), or None when
    there is none."""
    if not gateway.decision_log:
        return None
    file = open_configured_log(gateway, "decision_log", "decision log")
    return DecisionLog(file, log, registry)


# --- reading a decision log back -------------------------------------------------------------


_decode_decision = msgspec.json.Decoder(Decision)


def read_decisions(path: str | os.PathLike[str], warn: Callable[[str], None] | None = None) -> Iterator[Decision]:
    """The records of a decision log (its name, or one segment), oldest first; the reading rules
    are `events.jsonl`'s (LogFileError names a bad line)."""
    for _, decision in read_records([path], _decode_decision, warn, "decision log"):
        yield decision


def find_decisions(
    path: str | os.PathLike[str], request_id: str, warn: Callable[[str], None] | None = None
) -> list[Decision]:
    """Every record of `request_id`, oldest first: clients choose their X-Request-Id, and may
    send one twice."""
    return [decision for decision in read_decisions(path, warn) if decision.request_id == request_id]

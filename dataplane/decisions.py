"""Decision records: why each proxied request went where it went, as JSON Lines.

One record per completion request that reached routing (past the body checks): its id, the model,
the seq of the snapshot it was routed on (so `interlock explain --until-seq` over the event log
shows the same cluster), the ring pool, the nodes excluded and why, every attempt, the final
status and the duration. Recording never waits: records go into a bounded buffer that a
background task drains in batches, writing from a worker thread; when the buffer is full a
record is dropped and counted rather than stalling a request.

`find_decisions` reads a log back, for `interlock explain --request-id`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import BinaryIO, Protocol

import msgspec
import trio

from controlplane.logs import JsonLog

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


class DecisionRecorder(Protocol):
    """Where the request path hands its decision records (never blocking)."""

    def record(self, decision: Decision) -> None: ...


class DecisionLog:
    """A bounded buffer of decisions and the task that appends them to the configured file.

    `path_of()` names the file at each batch ("" = discard), so a reload that changes
    `gateway.decision_log` takes effect without a restart. A failing write is logged once (until
    writing works again) and never reaches the requests.
    """

    def __init__(self, path_of: Callable[[], str], log: JsonLog, capacity: int = 10_000) -> None:
        self._path_of = path_of
        self._log = log
        self._send, self._receive = trio.open_memory_channel[Decision](capacity)
        self._file: BinaryIO | None = None
        self._failing = False
        self.dropped = 0

    def record(self, decision: Decision) -> None:
        """Queue a decision; never blocks (a full buffer drops it)."""
        try:
            self._send.send_nowait(decision)
        except (trio.WouldBlock, trio.ClosedResourceError):
            self.dropped += 1

    def close(self) -> None:
        """No more records: `run` writes what is queued and returns."""
        self._send.close()

    async def run(self) -> None:
        encoder = msgspec.json.Encoder()
        try:
            async for first in self._receive:
                batch = [first]
                while True:
                    try:
                        batch.append(self._receive.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                lines = b"".join(encoder.encode(decision) + b"\n" for decision in batch)
                path = self._path_of()
                error = await trio.to_thread.run_sync(self._write, path, lines)
                if error and not self._failing:
                    self._log.error("decision log write failed", path=path, error=error)
                self._failing = bool(error)
                if self.dropped:
                    self._log.warn("decision log buffer full; records dropped", dropped=self.dropped)
                    self.dropped = 0
        finally:
            if self._file is not None:
                self._file.close()

    def _write(self, path: str, lines: bytes) -> str:
        """Append whole lines (in a worker thread); the error text, or "" when written."""
        try:
            if self._file is not None and self._file.name != path:
                self._file.close()
                self._file = None
            if not path:
                return ""
            if self._file is None:
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                self._file = open(path, "ab")
            self._file.write(lines)
            self._file.flush()
        except OSError as err:
            return str(err)
        return ""


# --- reading a decision log back -------------------------------------------------------------


class DecisionLogError(Exception):
    """A decision log line that is not a record; the message names the file and line."""


_decode_decision = msgspec.json.Decoder(Decision)


def read_decisions(path: str | os.PathLike[str], warn: Callable[[str], None] | None = None) -> Iterator[Decision]:
    """The records of a decision log, oldest first.

    A last line without its newline that does not decode is a write cut short (a crash): it
    is skipped and reported through `warn`. Any other bad line raises DecisionLogError.
    """
    with open(path, "rb") as lines:
        for number, line in enumerate(lines, start=1):
            try:
                yield _decode_decision.decode(line)
            except msgspec.DecodeError as err:
                if line.endswith(b"\n"):
                    raise DecisionLogError(f"{os.fspath(path)}:{number}: {err}") from None
                if warn is not None:
                    warn(f"{os.fspath(path)}:{number}: skipping torn last line ({err})")


def find_decisions(
    path: str | os.PathLike[str], request_id: str, warn: Callable[[str], None] | None = None
) -> list[Decision]:
    """Every record of `request_id`, oldest first: clients choose their X-Request-Id, and may
    send one twice."""
    return [decision for decision in read_decisions(path, warn) if decision.request_id == request_id]

"""A replica's decision records on their way to the fleet's decision stream (`N-decisions`).

The replica's recorder (`dataplane.decisions.DecisionFanOut`, set up by `interlock.serve`) names
every record its data plane makes after the replica (its own, and its workers', which come up
their socketpairs to the replica's process), encodes it once, and hands the line to the local
decision log, when one is configured, and here. Submitting never waits: the queue, the spool
of records waiting for the stream, is bounded (`fleet.decision_spool_bytes`, in memory; beyond
that a record is dropped and counted), and a task sends what is queued every BATCH_SECONDS, as
one message of JSON Lines per up to BATCH_BYTES. A batch stays queued until JetStream has
acknowledged it; one sent again after an unknown outcome carries the same message id and the
same records, none added since (its first send may have been stored after all: JetStream's
duplicate window drops the second, and a record added to it would be dropped with it). So a
replica cut off from NATS keeps every record up to the bound (those routed in a partition
among them, `Decision.partition`) and sends them when it is back; what it dropped is counted
(`interlock_fleet_decisions_dropped_total`), what waits is in
`interlock_fleet_decision_spool_bytes` beside its bound.

`interlock fleet export DIR` writes the stream as `DIR/decisions.jsonl`, the decision log that
`explain --request-id`, `timeline` and `whatif` read.
"""

from __future__ import annotations

import secrets
from collections import deque

import prometheus_client
import trio

from controlplane.infrastructure.logs import JsonLog
from fleet.jetstream import NATS_ERRORS, OPERATION_SECONDS, FleetLink

BATCH_SECONDS = 0.1
"""How long records gather before they are sent (one JetStream round trip per batch)."""

BATCH_BYTES = 512 * 1024
"""The most one message carries (NATS refuses a message over its max_payload, 1 MiB by
default); a single record longer than this is dropped and counted."""


class FleetDecisions:
    """The queue of a replica's decision records for the fleet's stream (module docstring);
    `run` sends the batches."""

    def __init__(
        self, replica: str, log: JsonLog, registry: prometheus_client.CollectorRegistry, *, spool_bytes: int
    ) -> None:
        """`spool_bytes`: the most encoded records waiting for the stream (the newest beyond
        it are dropped, and counted)."""
        self.replica = replica
        self._log = log
        self._spool_bytes = spool_bytes
        self._queued: deque[bytes] = deque()
        self._queued_bytes = 0
        self._process = secrets.token_hex(6)
        """Names this process's batches apart from an earlier run's (the message ids)."""
        self._batches_sent = 0
        self._unacknowledged = 0
        """How many records, from the queue's front, the batch being sent holds, until JetStream
        acknowledges it: a send that failed (or was cancelled) is made again with these, under
        the same id."""
        self._failing = False
        self.dropped = prometheus_client.Counter(
            "interlock_fleet_decisions_dropped_total",
            "Decision records not sent to the fleet's decision stream: its spool was full "
            "(fleet.decision_spool_bytes), or the record too long",
            registry=registry,
        )
        self.publish_errors = prometheus_client.Counter(
            "interlock_fleet_decision_publish_errors_total",
            "Failed sends of a batch of decision records to the fleet's decision stream (the batch is sent again)",
            registry=registry,
        )
        self.spooled_bytes = prometheus_client.Gauge(
            "interlock_fleet_decision_spool_bytes",
            "Encoded decision records waiting for the fleet's decision stream (sent once it acknowledges them)",
            registry=registry,
        )
        self.spooled_bytes.set_function(lambda: self._queued_bytes)
        self.spooled_records = prometheus_client.Gauge(
            "interlock_fleet_decision_spool_records",
            "Decision records waiting for the fleet's decision stream",
            registry=registry,
        )
        self.spooled_records.set_function(lambda: len(self._queued))
        self.spool_limit = prometheus_client.Gauge(
            "interlock_fleet_decision_spool_limit_bytes",
            "The bound of the decision records waiting for the fleet's stream (fleet.decision_spool_bytes); "
            "beyond it records are dropped (interlock_fleet_decisions_dropped_total)",
            registry=registry,
        )
        self.spool_limit.set(spool_bytes)

    def submit(self, line: bytes) -> None:
        """Queue one encoded decision record (a JSON line); never blocks."""
        if len(line) > BATCH_BYTES or self._queued_bytes + len(line) > self._spool_bytes:
            self.dropped.inc()
            return
        self._queued.append(line)
        self._queued_bytes += len(line)

    async def run(self, link: FleetLink) -> None:
        """Send the queued records for good; at the end (cancelled), what is left, once."""
        try:
            while True:
                await trio.sleep(BATCH_SECONDS)
                await link.connected.wait()
                await self._send_queued(link)
        finally:
            if link.is_connected:
                with trio.CancelScope(shield=True), trio.move_on_after(OPERATION_SECONDS):
                    await self._send_queued(link)

    async def _send_queued(self, link: FleetLink) -> None:
        """Send the queue from its front, a batch at a time, until it is empty or a send fails
        (that batch is sent again, the same records under the same id, next time)."""
        while self._queued:
            count = self._unacknowledged = self._unacknowledged or self._batch_length()
            batch = b"".join(self._queued[index] for index in range(count))
            try:
                await link.publish_decisions(batch, f"{self.replica}-{self._process}-{self._batches_sent}")
            except NATS_ERRORS as error:
                self.publish_errors.inc()
                if not self._failing:
                    self._log.warn("fleet: cannot send decision records; keeping them", error=str(error) or repr(error))
                self._failing = True
                return
            self._failing = False
            self._unacknowledged = 0
            self._batches_sent += 1
            for _ in range(count):
                self._queued_bytes -= len(self._queued.popleft())

    def _batch_length(self) -> int:
        """How many records from the queue's front the next batch holds (up to BATCH_BYTES)."""
        count, size = 0, 0
        for line in self._queued:
            if size + len(line) > BATCH_BYTES:
                break
            count, size = count + 1, size + len(line)
        return count


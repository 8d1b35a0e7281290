"""Whether a replica's state agrees with the fleet's: each checkpoint the leader publishes is
compared with this replica's state after the same message of the event stream.

A checkpoint at event seq S naming message M says: after every event of messages up to M, the
fleet was at S (S may reach into message M + 1: the leader took it between two events). A
replica that applied M and stands at seq S must hold the same state (the same digest); one
that stands past S after M disagrees on the seq. Either is said (`disagreement`: degraded on
`/ready` and `/health`, `interlock_fleet_state_disagrees` 1) until a later checkpoint agrees
or the stream starts a new epoch. The replica keeps its state after each of the last
STATES_KEPT messages (references to immutable snapshots), so a checkpoint that arrives after
the replica moved on is still compared; one ahead of it waits for the replica to get there.
"""

from __future__ import annotations

from collections import deque

import prometheus_client

from events.state import ClusterState
from events.types import Checkpoint

STATES_KEPT = 64
"""The replica's states after its last messages kept for comparing a checkpoint that arrives late."""


class StateAgreement:
    def __init__(self, registry: prometheus_client.CollectorRegistry) -> None:
        self._states: deque[tuple[int, ClusterState]] = deque(maxlen=STATES_KEPT)
        self._waiting: tuple[Checkpoint, int] | None = None
        self.disagreement = ""
        """How this replica's state disagrees with the fleet's last checkpoint compared ("" when not)."""
        self.disagrees = prometheus_client.Gauge(
            "interlock_fleet_state_disagrees",
            "1 while this replica's state after a message of the fleet's stream disagrees (seq or digest) with the "
            "fleet's checkpoint of that message",
            registry=registry,
        )
        self.disagrees.set_function(lambda: 1.0 if self.disagreement else 0.0)

    def followed(self, message_seq: int, state: ClusterState) -> None:
        """The replica's state once it has applied (or set aside) every message through
        `message_seq`; compares a checkpoint waiting for that message."""
        self._states.append((message_seq, state))
        if self._waiting is not None and self._waiting[1] <= message_seq:
            checkpoint, message = self._waiting
            self._waiting = None
            if message == message_seq:
                self._compare(checkpoint, message, state)

    def checkpoint(self, checkpoint: Checkpoint, message_seq: int) -> None:
        """A checkpoint of the stream this replica follows: compared with the replica's state
        after `message_seq` (now, or once the replica gets there)."""
        if not self._states or message_seq > self._states[-1][0]:
            self._waiting = (checkpoint, message_seq)
            return
        state = next((state for message, state in self._states if message == message_seq), None)
        if state is not None:
            self._compare(checkpoint, message_seq, state)

    def new_epoch(self) -> None:
        """The stream is a new one: what was kept of the old one compares with nothing."""
        self._states.clear()
        self._waiting = None
        self.disagreement = ""

    def _compare(self, checkpoint: Checkpoint, message_seq: int, state: ClusterState) -> None:
        if state.seq > checkpoint.seq:
            self.disagreement = (
                f"after message {message_seq} of the fleet's event stream this replica is at seq {state.seq}, the "
                f"fleet's checkpoint at seq {checkpoint.seq}"
            )
        elif state.seq == checkpoint.seq:
            here, fleet = Checkpoint.of(state).digest(), checkpoint.digest()
            self.disagreement = (
                ""
                if here == fleet
                else f"at seq {state.seq} this replica's state digest is {here}, the fleet's checkpoint's {fleet}"
            )

"""A follower: the control plane of a worker process, which applies the leader's numbered events.

The leader owns the probes, the numbering and the event log; a follower starts from a
checkpoint (the leader's state at some seq) and applies every later event with the same pure
`reduce`, so it holds the leader's state at each seq. What the worker's requests observe (a node
refused a connection) goes back to the leader, which numbers it like any event and sends it to
every follower, this one included.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from controlplane.effects.held_state import HeldState
from events.types import Checkpoint, Event


class OutOfStep(Exception):
    """An event that does not follow the follower's state (a lost or repeated event)."""


class Follower:
    """Holds the leader's state (`view`, the data plane's `ControlPlaneView`) from its event
    stream."""

    def __init__(self, report: Callable[[Event], None], now: Callable[[], float] = time.time) -> None:
        """`report` sends a data-plane observation to the leader; never blocks."""
        self._stale = ""
        self._replica_headers: dict[str, str] = {}
        self._replica_stale = ""
        self.view = HeldState(
            now=now, observe=report, stale_reason=self._stale_reason, fleet_headers=self._fleet_headers
        )

    def _stale_reason(self) -> str:
        """Current from the leader's first checkpoint on, until `mark_stale` says otherwise, and
        while its leader, when a fleet replica, is current itself."""
        if self.view.snapshot.config is None:
            return "no checkpoint from the leader yet"
        return self._stale or self._replica_stale

    def mark_stale(self, reason: str) -> None:
        """Whether the leader's events still reach this follower: `reason` why they may not
        (the leader's stream ended), "" when they do again."""
        self._stale = reason

    def _fleet_headers(self) -> dict[str, str]:
        """Its leader's, when that is a fleet replica (`follow_replica`); none otherwise."""
        return self._replica_headers

    def follow_replica(self, headers: dict[str, str], stale: str) -> None:
        """What its leader, a fleet replica, says of itself: the `/health` headers naming the
        replica and the fleet's leader, and why the replica's state may not be current ("")."""
        self._replica_headers = headers
        self._replica_stale = stale

    def apply(self, event: Event) -> None:
        """Apply the leader's next event: a checkpoint replaces the state, any other event must
        carry the next seq. Raises OutOfStep otherwise. An event that puts a config in force
        needs that config's keys read first (`view.upstream_keys.read_before`)."""
        if not isinstance(event, Checkpoint) and event.seq != self.view.snapshot.seq + 1:
            raise OutOfStep(f"event seq {event.seq} does not follow seq {self.view.snapshot.seq}")
        self.view.apply(event)

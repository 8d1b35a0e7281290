"""A follower: the control plane of a worker process, which applies the leader's numbered events.

The leader owns the probes, the numbering and the event log; a follower starts from a
checkpoint (the leader's state at some seq) and applies every later event with the same pure
`reduce`, so it holds the leader's state at each seq. What the worker's requests observe (a node
refused a connection) goes back to the leader, which numbers it like any event and sends it to
every follower, this one included.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable

from controlplane.infrastructure.keyfiles import UpstreamKeys
from controlplane.rules.reducer import INITIAL_STATE, reduce
from events.state import ClusterState
from events.types import Checkpoint, Event


class OutOfStep(Exception):
    """An event that does not follow the follower's state (a lost or repeated event)."""


class Follower:
    """Implements the data plane's `ControlPlaneView` from the leader's event stream."""

    def __init__(self, report: Callable[[Event], None], now: Callable[[], float] = time.time) -> None:
        self._report = report
        self._clock = now
        self._snapshot = INITIAL_STATE
        self._stale = ""
        self.upstream_keys = UpstreamKeys()
        self._replica_headers: dict[str, str] = {}
        self._replica_stale = ""

    @property
    def snapshot(self) -> ClusterState:
        """The current state: read it once per decision; it is replaced, never mutated."""
        return self._snapshot

    @property
    def upstream_authorizations(self) -> dict[str, bytes]:
        return self.upstream_keys.in_force

    @property
    def upstream_tls(self) -> dict[str, ssl.SSLContext]:
        return self.upstream_keys.tls_in_force

    def now(self) -> float:
        return self._clock()

    def stale_reason(self) -> str:
        """Current from the leader's first checkpoint on, until `mark_stale` says otherwise, and
        while its leader, when a fleet replica, is current itself."""
        if self._snapshot.config is None:
            return "no checkpoint from the leader yet"
        return self._stale or self._replica_stale

    def mark_stale(self, reason: str) -> None:
        """Whether the leader's events still reach this follower: `reason` why they may not
        (the leader's stream ended), "" when they do again."""
        self._stale = reason

    def fleet_headers(self) -> dict[str, str]:
        """Its leader's, when that is a fleet replica (`follow_replica`); none otherwise."""
        return self._replica_headers

    def follow_replica(self, headers: dict[str, str], stale: str) -> None:
        """What its leader, a fleet replica, says of itself: the `/health` headers naming the
        replica and the fleet's leader, and why the replica's state may not be current ("")."""
        self._replica_headers = headers
        self._replica_stale = stale

    def observe(self, event: Event) -> None:
        """Report a data-plane observation to the leader; never blocks."""
        self._report(event)

    def apply(self, event: Event) -> None:
        """Apply the leader's next event: a checkpoint replaces the state, any other event must
        carry the next seq. Raises OutOfStep otherwise. An event that puts a config in force
        needs that config's keys read first (`upstream_keys.read_before`)."""
        state = self._snapshot
        if not isinstance(event, Checkpoint) and event.seq != state.seq + 1:
            raise OutOfStep(f"event seq {event.seq} does not follow seq {state.seq}")
        self._snapshot, _ = reduce(state, event)
        if self._snapshot.config is not state.config:
            self.upstream_keys.take_up(self._snapshot.config)

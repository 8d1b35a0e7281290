"""The state one process holds, as the data plane reads it, and the one way it changes.

The gateway's control plane, a worker's follower and a fleet replica each hold one `HeldState`
and hand it to the data plane as its `dataplane.control.ControlPlaneView`: the snapshot, the
keys and TLS contexts of the config in force, the clock, and what the holder's role answers
(where an observation goes, whether the state is current, the fleet's headers). Each applies
its numbered events with `apply`: the same `reduce`, the same taking up of a new config's keys.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable

from controlplane.infrastructure.keyfiles import UpstreamKeys
from controlplane.rules.reducer import INITIAL_STATE, reduce
from controlplane.rules.transitions import Step
from events.config import Config
from events.state import ClusterState
from events.types import Event


def _no_fleet_headers() -> dict[str, str]:
    return {}


class HeldState:
    """Implements `ControlPlaneView` (see the module docstring)."""

    def __init__(
        self,
        *,
        now: Callable[[], float],
        observe: Callable[[Event], None],
        stale_reason: Callable[[], str],
        fleet_headers: Callable[[], dict[str, str]] = _no_fleet_headers,
    ) -> None:
        self.snapshot: ClusterState = INITIAL_STATE
        """The current state: read it once per decision; it is replaced, never mutated."""
        self.upstream_keys = UpstreamKeys()
        self.now = now
        """The clock events are stamped with."""
        self.observe = observe
        """Report a data-plane observation; never blocks."""
        self.stale_reason = stale_reason
        """Why the holder may not be routing on the current state ("" when it is)."""
        self.fleet_headers = fleet_headers
        """`/health`'s headers naming the replica and the fleet's leader (none off a fleet)."""
        self.config_listeners: list[Callable[[Config], None]] = []
        """Called with each config the state takes up, on the thread that applies it: the parts
        of a process that follow the config in force (its KV event subscribers). Never raise."""

    @property
    def upstream_authorizations(self) -> dict[str, bytes]:
        """The `Authorization` each node with a key file gets under the snapshot's config."""
        return self.upstream_keys.in_force

    @property
    def upstream_tls(self) -> dict[str, ssl.SSLContext]:
        """The context each https node's connections are made with under the snapshot's config."""
        return self.upstream_keys.tls_in_force

    def apply(self, event: Event) -> Step:
        """Reduce a numbered event into the state and publish the result; a config it puts in
        force has its keys taken up (read beforehand: `upstream_keys.read_before`). The step."""
        before = self.snapshot
        self.snapshot, step = reduce(before, event)
        if self.snapshot.config is not before.config:
            self.upstream_keys.take_up(self.snapshot.config)
            if self.snapshot.config is not None:
                for listener in self.config_listeners:
                    listener(self.snapshot.config)
        return step

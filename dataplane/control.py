"""What the data plane needs of a control plane, and nothing more.

The request path reads the current snapshot, stamps observations with the control plane's
clock, and reports what it observed; `/ready` asks whether that snapshot is current.
`controlplane.effects.held_state.HeldState` implements it: the gateway's control plane, a
worker's follower and a fleet replica each hold one and hand it to the data plane.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Protocol

from events.config import Config
from events.state import ClusterState
from events.types import Event


class ControlPlaneView(Protocol):
    @property
    def snapshot(self) -> ClusterState:
        """The current state: read it once per decision; it is replaced, never mutated."""

    @property
    def upstream_authorizations(self) -> dict[str, bytes]:
        """The `Authorization` each node with a key file gets under the snapshot's config, by IP:
        read off the event loop when this process took the config up, never on a request.
        Replaced together with the snapshot."""

    @property
    def upstream_tls(self) -> dict[str, ssl.SSLContext]:
        """The context each https node's connections are made with under the snapshot's config,
        by IP: built with `upstream_authorizations`, never on a request."""

    def now(self) -> float:
        """The clock events are stamped with."""

    def observe(self, event: Event) -> None:
        """Report a data-plane observation (an upstream failed or recovered); never blocks."""

    def stale_reason(self) -> str:
        """Why this process may not be routing on the current state, "" when it is: the one
        place `/ready` asks (a load balancer then sends its requests to another replica)."""

    @property
    def config_listeners(self) -> list[Callable[[Config], None]]:
        """Called with each config this process takes up (see `HeldState`)."""

    def fleet_headers(self) -> dict[str, str]:
        """`/health`'s headers naming this replica and the fleet's leader (none off a fleet)."""

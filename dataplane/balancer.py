"""plinth's balancer (§3): one round-robin counter shared by every model and every retry."""

from __future__ import annotations

from controlplane.routing import balancer_pool
from events.state import NodeState


class RoundRobin:
    """Picks `pool[counter % len(pool)]` from the healthy candidates (else the degraded ones).

    The counter starts at 0 and advances on every pick from a non-empty pool. The data plane
    runs in one trio thread, so no lock is needed for the shared sequence.
    """

    def __init__(self) -> None:
        self._counter = 0

    def select(self, candidates: list[NodeState]) -> NodeState | None:
        """The next node, or None when no candidate is healthy or degraded (plinth's ErrNoHealthyNode)."""
        pool = balancer_pool(candidates)
        if not pool:
            return None
        node = pool[self._counter % len(pool)]
        self._counter += 1
        return node

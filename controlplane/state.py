"""Immutable control-plane state: per-node health and model discovery (plinth §2.1, §8.1).

Every type here is frozen; the reducer derives a new state from the old one and an event,
and readers (the data plane, replay, explain) can hold any state as long as they like.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import msgspec

from events.config import Config, NodeConfig
from events.types import GpuSample

HEALTHY = "healthy"
DEGRADED = "degraded"
DEAD = "dead"

UNTRIED = "untried"
KNOWN = "known"
KNOWN_EMPTY = "known_empty"
DISCOVERY_DEGRADED = "degraded"
EXPIRED = "expired"

OFFLINE_SECONDS = 10.0
"""How long the data plane skips a node after a connection failure (plinth's skip-set)."""


def compute_status(failures: int, threshold: int) -> str:
    """plinth's computeStatus: dead at the threshold, degraded from half of it (at least 1)."""
    if failures >= threshold:
        return DEAD
    if failures >= max(1, threshold // 2):
        return DEGRADED
    return HEALTHY


class ModelDiscovery(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What a node's `GET /v1/models` has told us (plinth §8.1)."""

    state: str = UNTRIED
    names: tuple[str, ...] | None = None
    """The last successful non-empty list, in the node's order; None when there is none."""
    fetched_at: float | None = None
    """Time of the last successful fetch (empty ones included); None if never."""
    fails: int = 0
    empties: int = 0
    last_error: str = ""

    def allows(self, model: str) -> bool:
        if self.state == UNTRIED:
            return True
        if self.state in (KNOWN, DISCOVERY_DEGRADED):
            return self.names is not None and model in self.names
        return False

    def exclusion_reason(self, model: str) -> str:
        """`missing`, `empty` or `expired` when the node may not serve `model`, else ""."""
        if self.allows(model):
            return ""
        if self.state == KNOWN_EMPTY:
            return "empty"
        if self.state == EXPIRED:
            return "expired"
        if self.state in (KNOWN, DISCOVERY_DEGRADED):
            return "missing"
        return ""

    def age(self, now: float) -> float | None:
        """Seconds since the last successful fetch, or None if there never was one."""
        return None if self.fetched_at is None else now - self.fetched_at

    def settled(self) -> bool:
        """plinth's models_ok: the node's listing is known (possibly empty)."""
        return self.state in (KNOWN, KNOWN_EMPTY)

    def apply_result(
        self, names: tuple[str, ...] | None, error: str, threshold: int, now: float
    ) -> tuple[ModelDiscovery, bool]:
        """plinth's applyResult (§8.2): the next record and whether the model list changed.

        `names` is None exactly when the fetch failed with `error`.
        """
        if names is None:
            fails = self.fails + 1
            if threshold > 0 and fails >= threshold:
                state = EXPIRED
            elif self.state in (KNOWN, DISCOVERY_DEGRADED):
                state = DISCOVERY_DEGRADED
            else:
                state = self.state
            return msgspec.structs.replace(self, state=state, fails=fails, empties=0, last_error=error), False
        if names:
            changed = self.names != names
            return ModelDiscovery(state=KNOWN, names=names, fetched_at=now), changed
        empties = self.empties + 1
        if empties >= 2:
            changed = bool(self.names)
            return ModelDiscovery(state=KNOWN_EMPTY, names=None, fetched_at=now, empties=empties), changed
        return msgspec.structs.replace(self, fetched_at=now, fails=0, empties=empties, last_error=""), False


class NodeState(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One configured node as the control plane sees it (plinth's NodeState plus the skip-set)."""

    ip: str
    name: str = ""
    ring: str = ""
    status: str = HEALTHY
    consecutive_failures: int = 0
    last_check: float | None = None
    gpus: tuple[GpuSample, ...] = ()
    models: ModelDiscovery = ModelDiscovery()
    offline_until: float | None = None
    """Set by a data-plane connection failure; the node is skipped while `now < offline_until`."""

    def is_offline(self, now: float) -> bool:
        return self.offline_until is not None and now < self.offline_until

    @classmethod
    def fresh(cls, node: NodeConfig) -> NodeState:
        return cls(ip=node.ip, name=node.name, ring=node.ring)


class ClusterState(msgspec.Struct, frozen=True, kw_only=True):
    """The whole control-plane state after the event numbered `seq` (applied at `at`)."""

    seq: int = 0
    at: float = 0.0
    version: str = ""
    config_path: str = ""
    config: Config | None = None
    nodes: Mapping[str, NodeState] = MappingProxyType({})
    """Read-only, keyed by IP, iterating in plinth's order (a plain string sort of the IPs)."""

    def node_list(self) -> list[NodeState]:
        return list(self.nodes.values())


def node_mapping(nodes: Mapping[str, NodeState] | list[NodeState]) -> Mapping[str, NodeState]:
    """A read-only IP → node mapping in IP string order."""
    items = nodes.values() if isinstance(nodes, Mapping) else nodes
    return MappingProxyType({node.ip: node for node in sorted(items, key=lambda n: n.ip)})


def with_node(nodes: Mapping[str, NodeState], node: NodeState) -> Mapping[str, NodeState]:
    """A copy of `nodes` with one existing node replaced (order is kept, as the IP is)."""
    updated = nodes.copy()  # a mappingproxy copies its dict directly: far cheaper than dict(nodes)
    updated[node.ip] = node
    return MappingProxyType(updated)

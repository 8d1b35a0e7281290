"""The control plane's state as data: per-node health and model discovery (plinth §2.1, §8.1).

Every type here is frozen; the reducer (`controlplane.reducer`) derives a new state from the old
one and an event, and readers (the data plane, replay, explain) can hold any state as long as
they like. The rules that move a node from one state to the next live in the control plane
(`controlplane.health`, `controlplane.discovery`); here are only the states and the questions
routing asks of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType

import msgspec

from events.config import Config, NodeConfig


class GpuSample(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    uuid: str
    memory_used: int = 0
    memory_total: int = 0
    utilization: int = 0
    temperature: int = 0


class Health(StrEnum):
    """A node's health (plinth's computeStatus)."""

    HEALTHY = "healthy"
    DEGRADED = "degraded"
    DEAD = "dead"


class Discovery(StrEnum):
    """What a node's `GET /v1/models` has told us (GH-31). `Discovery.DEGRADED` (listing failures,
    the last list still trusted) is not `Health.DEGRADED`, though both are spelled `degraded`."""

    UNTRIED = "untried"
    KNOWN = "known"
    KNOWN_EMPTY = "known_empty"
    DEGRADED = "degraded"
    EXPIRED = "expired"


class ModelDiscovery(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A node's model discovery record (plinth §8.1)."""

    state: Discovery = Discovery.UNTRIED
    names: tuple[str, ...] | None = None
    """The last successful non-empty list, in the node's order; None when there is none."""
    fetched_at: float | None = None
    """Time of the last successful fetch (empty ones included); None if never."""
    fails: int = 0
    empties: int = 0
    last_error: str = ""

    def allows(self, model: str) -> bool:
        if self.state == Discovery.UNTRIED:
            return True
        if self.state in (Discovery.KNOWN, Discovery.DEGRADED):
            return self.names is not None and model in self.names
        return False

    def exclusion_reason(self, model: str) -> str:
        """`missing`, `empty` or `expired` when the node may not serve `model`, else ""."""
        if self.allows(model):
            return ""
        if self.state == Discovery.KNOWN_EMPTY:
            return "empty"
        if self.state == Discovery.EXPIRED:
            return "expired"
        if self.state in (Discovery.KNOWN, Discovery.DEGRADED):
            return "missing"
        return ""

    def age(self, now: float) -> float | None:
        """Seconds since the last successful fetch, or None if there never was one."""
        return None if self.fetched_at is None else now - self.fetched_at

    def settled(self) -> bool:
        """plinth's models_ok: the node's listing is known (possibly empty)."""
        return self.state in (Discovery.KNOWN, Discovery.KNOWN_EMPTY)


class NodeState(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One configured node as the control plane sees it (plinth's NodeState plus the skip-set)."""

    ip: str
    name: str = ""
    ring: str = ""
    status: Health = Health.HEALTHY
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

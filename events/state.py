"""The control plane's state as data: per-node health and model discovery (plinth §2.1, §8.1).

Every type here is frozen; the reducer (`controlplane.rules.reducer`) derives a new state from the old
one and an event, and readers (the data plane, replay, explain) can hold any state as long as
they like. The rules that move a node from one state to the next live in the control plane
(`controlplane.rules.health`, `controlplane.rules.discovery`); here are only the states and the questions
routing asks of them.
"""

from __future__ import annotations

import functools
from typing import Annotated
from collections.abc import Iterator, Mapping
from enum import StrEnum

import msgspec

from events.config import Config, NodeConfig

LATEST_MOMENT = 253402300799.0
"""9999-12-31T23:59:59Z, the last second a date can be written in (Python's `datetime` ends there)."""

Moment = Annotated[float, msgspec.Meta(ge=0, le=LATEST_MOMENT)]
"""A time in UNIX seconds as the logs hold it: a line whose time is out of this range (1e300)
fails to decode naming the file, the line and the field, instead of every tool that shows the
time failing with OverflowError."""


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


class ModelCard(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """What a node's listing says of one model besides its id and parent, as vLLM gives it, for
    the gateway's own `GET /v1/models`: "" or None where the node gives nothing."""

    id: str
    root: str = ""
    """The model the id serves (vLLM's model path; for an adapter, its path)."""
    max_model_len: int | None = None


class ModelDiscovery(msgspec.Struct, frozen=True, kw_only=True, dict=True):
    """A node's model discovery record (plinth §8.1). Whether it lists a model is a set lookup:
    a node may list thousands of ids, and routing and the metrics ask of each (`dict=True`
    lets the set be built once per record, beside its fields, and never encoded)."""

    state: Discovery = Discovery.UNTRIED
    names: tuple[str, ...] | None = None
    """The last successful non-empty list, in the node's order; None when there is none."""
    fetched_at: float | None = None
    """Time of the last successful fetch (empty ones included); None if never."""
    fails: int = 0
    empties: int = 0
    last_error: str = ""
    parents: tuple[tuple[str, str], ...] = ()
    """The LoRA adapters of the last list, each with its base model (vLLM's `parent`)."""
    cards: tuple[ModelCard, ...] = ()
    """The entries of the last list that give a `root` or a `max_model_len`, in list order."""
    digest: str = ""
    """The last list's digest (`events.types.listing_digest`), which a ModelsUnchanged names."""

    @functools.cached_property
    def listed(self) -> frozenset[str]:
        """The names of the last list, as a set."""
        return frozenset(self.names or ())

    @functools.cached_property
    def adapters(self) -> dict[str, str]:
        """The last list's adapters, each with its parent."""
        return dict(self.parents)

    def card(self, model: str) -> ModelCard | None:
        """vLLM's other fields of `model` in the last list, when it gave any."""
        return self._cards.get(model)

    @functools.cached_property
    def _cards(self) -> dict[str, ModelCard]:
        return {card.id: card for card in self.cards}

    def allows(self, model: str) -> bool:
        if self.state == Discovery.UNTRIED:
            return True
        if self.state in (Discovery.KNOWN, Discovery.DEGRADED):
            return model in self.listed
        return False

    def allowed_among(self, models: frozenset[str]) -> frozenset[str]:
        """Those of `models` this record allows (`allows`), at the cost of the smaller set."""
        if self.state == Discovery.UNTRIED:
            return models
        if self.state in (Discovery.KNOWN, Discovery.DEGRADED):
            return models & self.listed
        return frozenset()

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


MAX_LORA_ADAPTERS = 256
"""The most adapter names a scrape keeps of each list of `vllm:lora_requests_info` (vLLM's
`--max-loras` is a handful); the rest are counted (`LoraInfo.truncated`)."""


class LoraInfo(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """vLLM's `vllm:lora_requests_info` at a scrape (its newest sample): how many adapters the
    node runs at once, and the adapters of its running and of its waiting requests."""

    max_lora: int = 0
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    truncated: int = 0
    """Adapter names left out: beyond MAX_LORA_ADAPTERS a list, or longer than MAX_MODEL_NAME_LENGTH."""


class NodeLoad(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What the node's vLLM `/metrics` said at its last scrape (`LoadScraped`), for the
    load-aware policies. A failed scrape makes the load unknown, which never stops routing to
    the node (unknown load is not ill health); the last known figures stay for display."""

    known: bool = False
    """The last scrape succeeded: `running` and `waiting` are current."""
    running: float = 0.0
    """`vllm:num_requests_running`."""
    waiting: float = 0.0
    """`vllm:num_requests_waiting`."""
    kv_cache_usage: float | None = None
    """The KV-cache usage gauge (0..1), when the node exports it."""
    seconds_per_token: float | None = None
    """The node's mean time between two output tokens over the last scrape interval in which it
    produced tokens (vLLM's token histogram); None until two scrapes have counted tokens. Kept
    through idle intervals and failed scrapes: it says how fast the node is, not how busy."""
    token_seconds: float | None = None
    tokens: float | None = None
    """The token histogram's sum and count at the last scrape that had them, for the next
    interval's mean."""
    scraped_at: float | None = None
    """Time of the last successful scrape; None if never."""
    fails: int = 0
    """Failed scrapes in a row."""
    last_error: str = ""
    lora: LoraInfo | None = None
    """The node's LoRA adapters at the last successful scrape; None when it exports none."""

    @property
    def queued(self) -> float:
        """Requests the node has, running or waiting: a policy's view of its load."""
        return self.running + self.waiting


class AdapterLoadState(StrEnum):
    """Where the gateway's last load of an adapter onto a node stands."""

    REQUESTED = "requested"
    LOADED = "loaded"
    FAILED = "failed"


class AdapterLoad(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The gateway's last load of a configured adapter (`ModelEntry.lora_path`) onto a node."""

    adapter: str
    state: AdapterLoadState
    at: Moment
    """When it was requested, or answered."""
    error: str = ""
    unlisted: int = 0
    """The loads before this one in a row that the node answered loaded and then did not list
    (each doubles the back-off before the next: `controlplane.rules.adapters`)."""


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
    load: NodeLoad = NodeLoad()
    adapter_loads: tuple[AdapterLoad, ...] = ()
    """The gateway's last load of each configured adapter onto the node, in the order first asked."""

    def adapter_load(self, adapter: str) -> AdapterLoad | None:
        for load in self.adapter_loads:
            if load.adapter == adapter:
                return load
        return None

    def is_offline(self, now: float) -> bool:
        return self.offline_until is not None and now < self.offline_until

    @classmethod
    def fresh(cls, node: NodeConfig) -> NodeState:
        return cls(ip=node.ip, name=node.name, ring=node.ring)


class NodeMap(Mapping[str, NodeState]):
    """A read-only IP → node mapping that is cheap to update one node at a time.

    The nodes sit in a `base` dict that is never changed once built, plus a small overlay of the
    nodes replaced since (`replacing` copies only the overlay); the overlay is folded into a new
    base once it holds FOLD_AFTER nodes. So an update at a thousand nodes copies a few dozen
    entries instead of a thousand, lookups stay O(1), and a full iteration merges the two once
    per map. Iterates in the base's order (`node_mapping` builds it in IP order; a replaced node
    keeps its place).
    """

    FOLD_AFTER = 32

    __slots__ = ("_base", "_overlay", "_merged")

    def __init__(self, base: dict[str, NodeState], overlay: dict[str, NodeState] | None = None) -> None:
        self._base = base
        self._overlay = overlay or {}
        self._merged: dict[str, NodeState] | None = None if self._overlay else base

    def __getitem__(self, ip: str) -> NodeState:
        node = self._overlay.get(ip)
        return self._base[ip] if node is None else node

    def get(self, ip: str, default: NodeState | None = None) -> NodeState | None:
        node = self._overlay.get(ip)
        return self._base.get(ip, default) if node is None else node

    def __contains__(self, ip: object) -> bool:
        return ip in self._base

    def __iter__(self) -> Iterator[str]:
        return iter(self._base)

    def __len__(self) -> int:
        return len(self._base)

    def keys(self):  # noqa: ANN201 - a read-only view of a private dict
        return self._base.keys()

    def values(self):  # noqa: ANN201
        return self._all().values()

    def items(self):  # noqa: ANN201
        return self._all().items()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, NodeMap):
            return self._all() == other._all()
        return isinstance(other, Mapping) and self._all() == dict(other.items())

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"NodeMap({self._all()!r})"

    def replacing(self, node: NodeState) -> NodeMap:
        """This map with the node of the same IP (which must be in it) replaced by `node`."""
        if node.ip not in self._base:
            raise KeyError(node.ip)
        if len(self._overlay) >= self.FOLD_AFTER:
            base = self._all().copy()
            base[node.ip] = node
            return NodeMap(base)
        overlay = self._overlay.copy()
        overlay[node.ip] = node
        return NodeMap(self._base, overlay)

    def _all(self) -> dict[str, NodeState]:
        """Every node in order, as a dict no one changes (the overlay merged in once)."""
        merged = self._merged
        if merged is None:
            merged = self._base.copy()
            merged.update(self._overlay)
            self._merged = merged
        return merged


class ClusterState(msgspec.Struct, frozen=True, kw_only=True):
    """The whole control-plane state after the event numbered `seq` (applied at `at`)."""

    seq: int = 0
    at: float = 0.0
    version: str = ""
    config_path: str = ""
    config: Config | None = None
    nodes: Mapping[str, NodeState] = NodeMap({})
    """Read-only, keyed by IP, iterating in plinth's order (a plain string sort of the IPs)."""

    def node_list(self) -> list[NodeState]:
        return list(self.nodes.values())


def node_mapping(nodes: Mapping[str, NodeState] | list[NodeState]) -> NodeMap:
    """A read-only IP → node mapping in IP string order."""
    items = nodes.values() if isinstance(nodes, Mapping) else nodes
    return NodeMap({node.ip: node for node in sorted(items, key=lambda n: n.ip)})


def with_node(nodes: NodeMap, node: NodeState) -> NodeMap:
    """`nodes` with one existing node replaced (order is kept, as the IP is)."""
    return nodes.replacing(node)

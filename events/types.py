"""The vocabulary of the control plane: every event that can change a routing decision.

Each event is a frozen msgspec Struct in one tagged union (the `type` field names it in the
JSON Lines log). `at` is wall-clock UNIX seconds, set by whoever observed the event; `seq` is
0 until the reducer task applies the event and numbers it 1, 2, 3, …
"""

from __future__ import annotations

import hashlib
from typing import Union

import msgspec

from events.config import Config
from events.state import ClusterState, GpuSample, LoraInfo, ModelCard, Moment, NodeState, node_mapping


class EventBase(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", gc=False):
    at: Moment
    seq: int = 0


class RunStarted(EventBase, frozen=True, tag="run_started"):
    """A gateway run began with this validated config, so a log is self-contained."""

    version: str
    config_path: str
    config: Config


class ConfigReloaded(EventBase, frozen=True, tag="config_reloaded"):
    """SIGHUP loaded and validated a new config, which replaces the current one."""

    config_path: str
    config: Config


class ReloadRejected(EventBase, frozen=True, tag="reload_rejected"):
    """SIGHUP found an invalid config; the current one stays in force."""

    config_path: str
    error: str


class HealthProbed(EventBase, frozen=True, tag="health_probe"):
    """One `GET /health` of a node: healthy iff it answered 200 (`status` is None on a transport error)."""

    node: str
    ok: bool
    status: int | None = None
    error: str = ""
    latency: float = 0.0


class ProbeCrashed(EventBase, frozen=True, tag="probe_crashed"):
    """A health check raised instead of answering (plinth's recovered panic)."""

    node: str
    error: str


class GpuScraped(EventBase, frozen=True, tag="gpu_scrape"):
    """One scrape of a node's GPU exporter; `gpus` is empty when it gave no result."""

    node: str
    gpus: tuple[GpuSample, ...] = ()
    error: str = ""


class LoadScraped(EventBase, frozen=True, tag="load_scrape"):
    """One scrape of a node's vLLM `GET /metrics`: its running and waiting requests (and KV-cache
    usage and the time-between-tokens histogram's sum and count, when exported), or the error
    when the scrape gave no usable answer."""

    node: str
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None
    token_seconds: float | None = None
    tokens: float | None = None
    lora: LoraInfo | None = None
    """The node's `vllm:lora_requests_info`, when it serves LoRA adapters."""
    error: str = ""


MAX_MODEL_NAME_LENGTH = 512
"""The longest model name: one a request gives (else a 400) or a node lists (else its listing is
an error). vLLM's ids are paths, a few hundred characters at most; every name ends up in log
lines, the event log and /health, and some in metric labels."""


class ModelsListed(EventBase, frozen=True, tag="model_listing"):
    """One `GET /v1/models` of a node: the ids in order, or None with the error text. A listing
    the node's state holds already is recorded as a ModelsUnchanged instead."""

    node: str
    models: tuple[str, ...] | None = None
    parents: tuple[tuple[str, str], ...] = ()
    """The listed LoRA adapters, each with its base model (the entry's `parent`), in list order."""
    cards: tuple[ModelCard, ...] = ()
    """The entries that give vLLM's `root` or `max_model_len`, in list order."""
    error: str = ""

    def digest(self) -> str:
        """What a ModelsUnchanged names this listing by (its ids, parents and cards)."""
        return listing_digest(self.models or (), self.parents, self.cards)


def listing_digest(models: tuple[str, ...], parents: tuple[tuple[str, str], ...], cards: tuple[ModelCard, ...]) -> str:
    """The digest of a model listing: equal for equal lists (ids, parents and cards, in order)."""
    return hashlib.sha256(msgspec.json.encode((models, parents, cards))).hexdigest()[:32]


class ModelsUnchanged(EventBase, frozen=True, tag="model_listing_unchanged"):
    """One `GET /v1/models` of a node that listed what its state holds (`ModelDiscovery.digest`):
    applied as that listing again, at the cost of a digest instead of the whole list in the log.
    Not applied (a warning) when the state holds another list by then."""

    node: str
    digest: str


class AdapterLoadRequested(EventBase, frozen=True, tag="adapter_load_requested"):
    """The gateway asked a node to load a configured LoRA adapter (`ModelEntry.lora_path`): the
    node was healthy, listed the adapter's parent and not the adapter."""

    node: str
    adapter: str
    parent: str
    lora_path: str


class AdapterLoaded(EventBase, frozen=True, tag="adapter_loaded"):
    """The node answered the load of an adapter with success."""

    node: str
    adapter: str


class AdapterLoadFailed(EventBase, frozen=True, tag="adapter_load_failed"):
    """The node did not load an adapter: its answer (status and text) or the transport error."""

    node: str
    adapter: str
    error: str
    status: int | None = None


class UpstreamFailed(EventBase, frozen=True, tag="upstream_failed"):
    """The data plane could not reach a node (connection-level failure)."""

    node: str
    error: str


class UpstreamRecovered(EventBase, frozen=True, tag="upstream_recovered"):
    """The data plane completed an attempt on a node: it is reachable again."""

    node: str


class RunStopped(EventBase, frozen=True, tag="run_stopped"):
    """The gateway shut down cleanly."""


class Checkpoint(EventBase, frozen=True, tag="checkpoint"):
    """The whole control-plane state after the event numbered `seq` (applied at `at`), so that a
    reader can start here instead of at the beginning: a worker that follows the leader's events,
    or a replay of the segments that remain. It takes no number of its own: `seq` is the number
    of the last event the state includes."""

    version: str
    config_path: str
    config: Config | None
    nodes: tuple[NodeState, ...]

    @classmethod
    def of(cls, state: ClusterState) -> Checkpoint:
        return cls(
            seq=state.seq,
            at=state.at,
            version=state.version,
            config_path=state.config_path,
            config=state.config,
            nodes=tuple(state.nodes.values()),
        )

    def digest(self) -> str:
        """A short hash of the state this checkpoint carries, to compare states across processes."""
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:16]

    def state(self) -> ClusterState:
        """The state this checkpoint carries."""
        return ClusterState(
            seq=self.seq,
            at=self.at,
            version=self.version,
            config_path=self.config_path,
            config=self.config,
            nodes=node_mapping(list(self.nodes)),
        )


Event = Union[
    RunStarted,
    ConfigReloaded,
    ReloadRejected,
    HealthProbed,
    ProbeCrashed,
    GpuScraped,
    ModelsListed,
    ModelsUnchanged,
    LoadScraped,
    UpstreamFailed,
    UpstreamRecovered,
    AdapterLoadRequested,
    AdapterLoaded,
    AdapterLoadFailed,
    RunStopped,
    Checkpoint,
]

EVENT_TYPES: tuple[type[EventBase], ...] = Event.__args__

"""What a control-plane snapshot gives every request, computed once per snapshot and shared by
its requests: the config's part (node ports, limits, headers, the default model), each model's
`Route`, what `/ready` counts, the metrics' model labels."""

from __future__ import annotations

import functools
import math
import ssl
from typing import Any

import msgspec

from controlplane.rules.adapters import is_loading, loaded_unlisted
from controlplane.effects.metrics import OTHER_MODELS, labelled_list, metric_models
from controlplane.rules.routing import Route, pick_pool
from dataplane.admission.tenants import TenantLimits
from dataplane.control import ControlPlaneView
from dataplane.headers import served_by_headers
from events.config import Config, UpstreamTimeouts
from events.state import ClusterState, NodeState
from events.types import Checkpoint


class ConfigView:
    """What requests need from one config: node ports, limits, the default model, the keys
    sent to nodes and the TLS contexts of https nodes (`upstream_authorizations`, `upstream_tls`,
    as the process read them when it took the config up)."""

    def __init__(
        self,
        config: Config,
        upstream_authorizations: dict[str, bytes],
        upstream_tls: dict[str, ssl.SSLContext] | None = None,
        replica: str = "",
    ) -> None:
        self.config = config
        gateway = config.gateway
        self.default_model = config.models.default
        self.aliases = config.aliases()
        self.loaded_adapters = frozenset(config.loaded_adapters())
        """The adapters the gateway loads onto nodes (`ModelEntry.lora_path`)."""
        """Each alias with the model it stands for (`ModelEntry.target`)."""
        self.body_limit = gateway.request_body_limit
        self.body_timeout = gateway.request_body_timeout
        self.body_idle_timeout = gateway.request_body_idle_timeout
        self.response_body_timeout = gateway.response_body_timeout
        self.buffer_limit = gateway.response_buffer_limit
        self.decision_log = bool(gateway.decision_log) or config.fleet is not None
        """Whether decisions are recorded: to the decision log, and in a fleet always (to its stream)."""
        routing = config.routing
        self.cluster_policy = routing.policy
        self.model_policies = {model.name: config.model_policy(model.name) for model in config.models.available}
        self.tokenizers = {
            model.name: model.tokenizer
            for model in config.models.available
            if model.tokenizer and self.model_policies[model.name] == "kv_aware"
        }
        """The tokenizer directory of each model routed by `kv_aware` that has one: only their
        prompts are tokenized and matched against the nodes' KV events (`kvcache`)."""
        self.prefix_messages = routing.prefix_messages
        self.prefix_bytes = routing.prefix_bytes
        self.load_bound = routing.load_bound
        self.retry_unanswered = gateway.retry_unanswered
        self.timeouts = UpstreamTimeouts(gateway.connect_timeout, gateway.first_byte_timeout, gateway.response_timeout)
        """The timeouts of an attempt for a model without its own (`[gateway]`'s)…"""
        self.upstream_timeouts = {model: config.upstream_timeouts(model) for model in config.served_models()}
        """…and of each configured model."""
        self.ports = {node.ip: node.vllm_port for node in config.nodes}
        self.tenant_limits = TenantLimits(config)
        self.api_key_digests = self.tenant_limits.key_digests
        """Every accepted client key's digest with its tenant; () when no key is needed."""
        self.admission = config.admission
        self.max_in_flight = {node.ip: node.max_in_flight for node in config.nodes if node.max_in_flight is not None}
        self.priority_scheduled = frozenset(node.ip for node in config.nodes if node.scheduling == "priority")
        """The nodes sent each request's admission priority (`NodeConfig.scheduling`)."""
        self.health_open = not gateway.health_requires_api_key
        self.health_hides_errors = gateway.health_hides_errors
        self.health_shows_load = config.load_scrape_interval() > 0
        """/health shows each node's load only when it is scraped (plinth's body stays as it is)."""
        self.upstream_authorizations = upstream_authorizations
        """The `Authorization` each node with a key gets instead of the client's."""
        self.upstream_tls = upstream_tls or {}
        """The context each https node's connections are made with (a plain node has none)."""
        self.replica = replica
        self.node_headers = {node.ip: served_by_headers(node, replica) for node in config.nodes}
        """The headers naming the node that served a request (a node's own header may say
        anything) and, in a fleet, the replica that proxied it."""


MODEL_CREATED = 0
"""A listed model's `created` (OpenAI's schema requires one): 0, as a name in the config has no
creation time, and a fixed value keeps every replica's and every reload's listing byte for byte alike."""


class ModelList:
    """`GET /v1/models` on one snapshot at one moment: the list's body, and each model's object
    (`GET /v1/models/{id}`) as the list has it."""

    __slots__ = ("body", "cards")

    def __init__(self, cards: list[dict[str, Any]]) -> None:
        self.body = msgspec.json.encode({"object": "list", "data": cards})
        self.cards = {card["id"]: msgspec.json.encode(card) for card in cards}


def _first_offline_end(candidates: list[NodeState], now: float) -> float:
    """When the first offline mark among `candidates` ends (inf: none is offline at `now`): until
    then, on one snapshot, which of them a pick may choose stays the same."""
    return min((node.offline_until for node in candidates if node.is_offline(now)), default=math.inf)


class SnapshotView:
    """One snapshot and what is derived from it, computed once and shared by its requests."""

    MAX_ROUTES = 1024
    """Routes cached per snapshot; requests for ever new model names are routed uncached."""

    def __init__(self, snapshot: ClusterState, config: ConfigView) -> None:
        self.snapshot = snapshot
        self.config = config
        self._routes: dict[str, Route] = {}
        self._adapters_loading: dict[str, bool] = {}
        self._routable: tuple[tuple[str, ...], float] | None = None
        """`routable_models`' last answer, and the moment until which it holds."""
        self._model_list: tuple[ModelList, float] | None = None
        """`model_list`'s last answer, and the moment until which it holds."""

    def route(self, model: str) -> Route:
        route = self._routes.get(model)
        if route is None:
            route = Route(self.snapshot, model)
            if len(self._routes) < self.MAX_ROUTES:
                self._routes[model] = route
        return route

    def adapter_loading(self, model: str) -> bool:
        """Whether `model` is a configured adapter the gateway is loading onto a node
        (`adapters.is_loading`), asked only of a request no node may serve: kept per adapter."""
        loading = self._adapters_loading.get(model)
        if loading is None:
            if model not in self.config.loaded_adapters:
                return False
            loading = self._adapters_loading[model] = any(
                is_loading(node, model) for node in self.snapshot.nodes.values()
            )
        return loading

    def adapter_unlisted(self, model: str) -> NodeState | None:
        """A node that answered the gateway's load of the configured adapter `model` as done and
        does not list it (`adapters.loaded_unlisted`), asked only of a request no node may serve."""
        if model not in self.config.loaded_adapters:
            return None
        return next((node for node in self.snapshot.node_list() if loaded_unlisted(node, model)), None)

    def routable_models(self, now: float) -> tuple[str, ...]:
        """The models `/ready` counts (the configured ones, an alias as its target; with none
        configured, those the nodes list) that have a node a request's first pick would be made from at `now`.

        On one snapshot the answer changes only when an offline mark ends, so it is kept until
        the first such moment among the models' candidates."""
        cached = self._routable
        if cached is not None and now < cached[1]:
            return cached[0]
        routable = []
        holds_until = math.inf
        for model in self._readiness_models:
            candidates = self.route(model).candidates
            if pick_pool(candidates, now):
                routable.append(model)
            holds_until = min(holds_until, _first_offline_end(candidates, now))
        self._routable = tuple(routable), holds_until
        return self._routable[0]

    def model_list(self, now: float) -> ModelList:
        """`GET /v1/models`: the configured models (aliases and adapters included), then every
        other model a node lists that a request could be routed to at `now` (its first pick's
        pool is not empty), in node and list order. Each carries vLLM's `root`, `parent` and
        `max_model_len` as the first of its candidates that gives them lists them (an alias:
        its target's `root` and `max_model_len`). Kept, as `routable_models` is, until an
        offline mark among the candidates ends."""
        cached = self._model_list
        if cached is not None and now < cached[1]:
            return cached[0]
        config = self.snapshot.config
        entries = config.models.available if config is not None else ()
        configured = {entry.name: entry for entry in entries}
        cards = []
        holds_until = math.inf
        listed = dict.fromkeys(name for node in self.snapshot.node_list() for name in node.models.names or ())
        for name in [*configured, *(name for name in listed if name not in configured)]:
            entry = configured.get(name)
            routed = entry.target if entry is not None and entry.target else name
            candidates = self.route(routed).candidates
            holds_until = min(holds_until, _first_offline_end(candidates, now))
            if entry is None and not pick_pool(candidates, now):
                continue
            card: dict[str, Any] = {"id": name, "object": "model", "created": MODEL_CREATED, "owned_by": "cluster"}
            card.update(_vllm_fields(routed, candidates, with_parent=routed == name))
            if entry is not None and entry.parent:
                card["parent"] = entry.parent
            cards.append(card)
        self._model_list = ModelList(cards), holds_until
        return self._model_list[0]

    @functools.cached_property
    def _readiness_models(self) -> tuple[str, ...]:
        configured = dict.fromkeys(model.target or model.name for model in self.snapshot.config.models.available)
        if configured:
            return tuple(configured)
        return tuple(sorted({name for node in self.snapshot.node_list() for name in node.models.names or ()}))

    def metric_model(self, model: str) -> str:
        """`model` as the metrics' `model` label: itself when it has a label of its own
        (`controlplane.effects.metrics.metric_models`), else OTHER_MODELS."""
        return model if model in self.metric_models else OTHER_MODELS

    @functools.cached_property
    def metric_models(self) -> frozenset[str]:
        return metric_models(self.snapshot)

    @functools.cached_property
    def state_digest(self) -> str:
        """The snapshot's `Checkpoint.digest`: processes that followed the same events agree on it."""
        return Checkpoint.of(self.snapshot).digest()


class SnapshotViews:
    """The view of the control plane's current snapshot, rebuilt only when the snapshot changes
    (and its config part only when the config does)."""

    def __init__(self, control_plane: ControlPlaneView) -> None:
        self._control_plane = control_plane
        self._view: SnapshotView | None = None

    def current(self) -> SnapshotView:
        snapshot = self._control_plane.snapshot
        view = self._view
        if view is None or view.snapshot is not snapshot:
            # a fleet's replica: its name (a worker learns it from its replica soon after it starts)
            replica = self._control_plane.fleet_headers().get("X-Interlock-Replica", "")
            same_config = view is not None and view.config.config is snapshot.config and view.config.replica == replica
            config = view.config if same_config else ConfigView(
                snapshot.config, self._control_plane.upstream_authorizations, self._control_plane.upstream_tls, replica
            )
            previous, view = view, SnapshotView(snapshot, config)
            if same_config and "metric_models" in vars(previous) and _same_lists(previous.snapshot, snapshot):
                view.metric_models = previous.metric_models
            self._view = view
        return view


def _vllm_fields(model: str, candidates: list[NodeState], *, with_parent: bool) -> dict[str, Any]:
    """`model`'s `root` and `max_model_len` (and `parent`, `with_parent`) as the first candidate
    that gives each lists them."""
    fields: dict[str, Any] = {}
    for node in candidates:
        discovery = node.models
        card = discovery.card(model)
        if card is not None:
            if card.root and "root" not in fields:
                fields["root"] = card.root
            if card.max_model_len is not None and "max_model_len" not in fields:
                fields["max_model_len"] = card.max_model_len
        if with_parent and "parent" not in fields and (parent := discovery.adapters.get(model)):
            fields["parent"] = parent
    return fields


def _same_lists(before: ClusterState, after: ClusterState) -> bool:
    """Whether every node lists what it listed before (most events change no list, and the
    labelled models cost a pass over every list)."""
    if len(before.nodes) != len(after.nodes):
        return False
    for old, new in zip(before.nodes.values(), after.nodes.values()):
        if old.ip != new.ip:
            return False
        if old.models is not new.models and labelled_list(old.models) != labelled_list(new.models):
            return False
    return True

"""The control plane's Prometheus metrics: plinth's names, labels and help texts (§5), plus
Interlock's own `interlock_*` series about the event pipeline.

Everything lives on the registry it is given (never prometheus_client's default one, so a
process can hold many control planes); the data plane adds its request metrics to the same one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge

from controlplane.rules.routing import model_ring
from controlplane.rules.transitions import HEALTH, MODELS, RELOAD, RUN, Step, StopProbing
from events.state import ClusterState, Discovery, Health, ModelDiscovery, NodeLoad, NodeState
from events.types import Event, LoadScraped, ModelsListed, ModelsUnchanged, ProbeCrashed

MAX_DISCOVERED_MODEL_LABELS = 100
"""Models that get a `model` label without being configured: the first ones the nodes list (in
node and list order). Every other model a request or a node names is counted as OTHER_MODELS,
so the series stay bounded by the config, whatever the nodes list."""

OTHER_MODELS = "(other)"
"""The `model` label of a request for a model that has no label of its own (`metric_models`)."""


def metric_models(state: ClusterState) -> frozenset[str]:
    """The models with a `model` label of their own: the configured ones (not the aliases, whose
    requests count as their target's) and the first
    MAX_DISCOVERED_MODEL_LABELS others that the nodes list (an expired list lists nothing)."""
    labelled = set(state.config.served_models()) if state.config is not None else set()
    room = MAX_DISCOVERED_MODEL_LABELS
    for node in state.nodes.values():
        names = labelled_list(node.models)
        if not names or node.models.listed <= labelled:
            continue  # a set operation: most nodes list what others (or the config) named already
        for name in names:
            if name not in labelled:
                if not room:
                    return frozenset(labelled)
                labelled.add(name)
                room -= 1
    return frozenset(labelled)

def labelled_list(models: ModelDiscovery) -> tuple[str, ...] | None:
    """What `metric_models` reads of a node's discovery: its list, unless expired."""
    return None if models.state == Discovery.EXPIRED else models.names


_RECOUNT_KINDS = frozenset((RUN, RELOAD, HEALTH))
"""Transitions after which the node-status counts may differ; every status change logs one."""

_NODE_STATE_KINDS = _RECOUNT_KINDS | {MODELS}
"""Transitions after which a node's discovery state, or the nodes that may serve a model, may differ."""

_LISTING_KINDS = frozenset((RUN, RELOAD, MODELS))
"""Transitions after which the models configured or listed may differ."""

_STATUS_INDEX = {status: index for index, status in enumerate(Health)}


class _Counted(NamedTuple):
    """A node as `interlock_model_nodes` last counted it."""

    ring: str
    status: Health
    models: ModelDiscovery

    @classmethod
    def of(cls, node: NodeState) -> _Counted:
        return cls(node.ring, node.status, node.models)

    def same_as(self, other: _Counted) -> bool:
        """Counted the same (the model lists compared by identity: a list is never changed in place)."""
        return self.models is other.models and self.status == other.status and self.ring == other.ring


class ControlPlaneMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.nodes_healthy = Gauge("cluster_nodes_healthy", "Number of healthy nodes", registry=registry)
        self.nodes_degraded = Gauge("cluster_nodes_degraded", "Number of degraded nodes", registry=registry)
        self.nodes_dead = Gauge("cluster_nodes_dead", "Number of dead nodes", registry=registry)
        self.health_check_panics = Counter(
            "health_check_panics_total", "Total health probe panics recovered by the monitor", registry=registry
        )
        self.node_models_ok = Gauge(
            "gateway_node_models_ok",
            "1 when node model discovery is settled (known or known_empty)",
            ["node"],
            registry=registry,
        )
        self.model_discovery = Counter(
            "gateway_model_discovery_total",
            "Model discovery fetch results by node",
            ["node", "result"],
            registry=registry,
        )
        self.events = Counter(
            "interlock_events_total", "Events applied by the control plane, by type", ["type"], registry=registry
        )
        self.event_log_write_errors = Counter(
            "interlock_event_log_write_errors_total", "Failed writes to the event log", registry=registry
        )
        self.event_log_dropped_events = Counter(
            "interlock_event_log_dropped_events_total",
            "Events never written to the event log (a failed write, or a full backlog)",
            registry=registry,
        )
        self.observations_dropped = Counter(
            "interlock_observations_dropped_total",
            "Data-plane observations dropped because the control plane's event queue was full",
            registry=registry,
        )
        self.snapshot_seq = Gauge(
            "interlock_snapshot_seq", "Sequence number of the last event applied to the published state", registry=registry
        )
        self.node_health = Gauge(
            "interlock_node_health",
            "1 for the node's health status (healthy, degraded or dead), 0 for the others",
            ["node", "status"],
            registry=registry,
        )
        self.node_discovery = Gauge(
            "interlock_node_discovery",
            "1 for the node's model discovery state (untried, known, known_empty, degraded or expired), "
            "0 for the others",
            ["node", "state"],
            registry=registry,
        )
        self.model_nodes = Gauge(
            "interlock_model_nodes",
            "Nodes that may serve a model (its ring pool, past the model filter) by health status; "
            "configured models, and the first models the nodes list",
            ["model", "status"],
            registry=registry,
        )
        self.node_load_known = Gauge(
            "interlock_node_load_known",
            "1 when the node's last load scrape (vLLM's /metrics) succeeded, 0 when it failed",
            ["node"],
            registry=registry,
        )
        self.node_requests_running = Gauge(
            "interlock_node_requests_running",
            "Requests running on the node (vllm:num_requests_running) at its last successful load scrape",
            ["node"],
            registry=registry,
        )
        self.node_requests_waiting = Gauge(
            "interlock_node_requests_waiting",
            "Requests waiting on the node (vllm:num_requests_waiting) at its last successful load scrape",
            ["node"],
            registry=registry,
        )
        self.node_kv_cache_usage = Gauge(
            "interlock_node_kv_cache_usage",
            "The node's KV-cache usage (0 to 1) at its last successful load scrape, when it exports it",
            ["node"],
            registry=registry,
        )
        self.node_seconds_per_token = Gauge(
            "interlock_node_seconds_per_token",
            "The node's mean time between output tokens (vLLM's token histogram) over the last"
            " scrape interval in which it produced tokens",
            ["node"],
            registry=registry,
        )
        # At thousands of events a second `.labels()` and a locked `set` per event are a good
        # part of the reducer task's time: the labelled children are looked up once, the
        # sequence number is read when scraped, and a gauge is set only when its value changes.
        self._seq = 0
        self.snapshot_seq.set_function(lambda: self._seq)
        self._events_by_type: dict[str, Counter] = {}
        self._discovery_results: dict[tuple[str, str], Counter] = {}
        self._models_ok: dict[str, int] = {}
        self._node_states: dict[str, tuple[Health, Discovery]] = {}
        # interlock_model_nodes, kept up to date one node at a time (see `_count_model_nodes`).
        self._labelled: frozenset[str] = frozenset()
        self._counted_config: object = None
        self._model_rings: dict[str, str] = {}
        self._model_counts: dict[str, list[int]] = {}
        self._counted: dict[str, _Counted] = {}
        self._published_counts: dict[str, tuple[int, ...]] = {}
        self._loads: dict[str, NodeLoad] = {}

    def record(self, event: Event, state: ClusterState, step: Step) -> None:
        """Account for one applied event; `state` is the snapshot it produced."""
        event_type = type(event).__struct_config__.tag
        events = self._events_by_type.get(event_type)
        if events is None:
            events = self._events_by_type[event_type] = self.events.labels(type=event_type)
        events.inc()
        self._seq = state.seq
        if isinstance(event, ProbeCrashed):
            self.health_check_panics.inc()
        elif isinstance(event, ModelsListed | ModelsUnchanged) and (node := state.nodes.get(event.node)) is not None:
            # plinth §8.4: counted on every listing, and the gauge holds the latest answer.
            result = _listing_result(event)
            results = self._discovery_results.get((event.node, result))
            if results is None:
                results = self._discovery_results[(event.node, result)] = self.model_discovery.labels(
                    node=event.node, result=result
                )
            results.inc()
            models_ok = 1 if node.models.settled() else 0
            if self._models_ok.get(event.node) != models_ok:
                self._models_ok[event.node] = models_ok
                self.node_models_ok.labels(node=event.node).set(models_ok)
        elif isinstance(event, LoadScraped) and (node := state.nodes.get(event.node)) is not None:
            self._publish_load(node.ip, node.load)
        kinds = {transition.kind for transition in step.transitions}
        if kinds & _RECOUNT_KINDS:
            self._count_statuses(state)
        if kinds & _NODE_STATE_KINDS:
            self._publish_node_states(state)
            self._count_model_nodes(state, event, listings_changed=bool(kinds & _LISTING_KINDS))
        for effect in step.effects:
            if isinstance(effect, StopProbing):
                self._forget_node(effect.node)

    def _count_statuses(self, state: ClusterState) -> None:
        counts = {Health.HEALTHY: 0, Health.DEGRADED: 0, Health.DEAD: 0}
        for node in state.nodes.values():
            counts[node.status] += 1
        self.nodes_healthy.set(counts[Health.HEALTHY])
        self.nodes_degraded.set(counts[Health.DEGRADED])
        self.nodes_dead.set(counts[Health.DEAD])

    def _publish_node_states(self, state: ClusterState) -> None:
        for node in state.nodes.values():
            current = (node.status, node.models.state)
            previous = self._node_states.get(node.ip)
            if previous == current:
                continue
            self._node_states[node.ip] = current
            for status in Health:
                self.node_health.labels(node=node.ip, status=status).set(1 if status == node.status else 0)
            for discovery in Discovery:
                is_current = 1 if discovery == node.models.state else 0
                self.node_discovery.labels(node=node.ip, state=discovery).set(is_current)

    def _publish_load(self, ip: str, load: NodeLoad) -> None:
        if self._loads.get(ip) == load:
            return
        self._loads[ip] = load
        self.node_load_known.labels(node=ip).set(1 if load.known else 0)
        if load.scraped_at is not None:
            self.node_requests_running.labels(node=ip).set(load.running)
            self.node_requests_waiting.labels(node=ip).set(load.waiting)
        for gauge, value in (
            (self.node_kv_cache_usage, load.kv_cache_usage),
            (self.node_seconds_per_token, load.seconds_per_token),
        ):
            if value is not None:
                gauge.labels(node=ip).set(value)
            else:
                with contextlib.suppress(KeyError):
                    gauge.remove(ip)  # the node stopped exporting it

    def _count_model_nodes(self, state: ClusterState, event: Event, *, listings_changed: bool) -> None:
        """For every labelled model (`metric_models`), the nodes that may serve it (its ring
        pool, past the model filter) by health status. An event about one node changes that
        node's counts only: what it counted for before is taken off, what it counts for now is
        added, each a set operation over the labelled models (a node may list thousands of
        ids). The rest (a new config, new labelled models, a checkpoint) is counted anew."""
        labelled = metric_models(state) if listings_changed else self._labelled
        ip = getattr(event, "node", None)
        if ip is None or labelled != self._labelled or state.config is not self._counted_config:
            self._recount_model_nodes(state, labelled)
            return
        node = state.nodes.get(ip)
        counted = self._counted.get(ip)
        if node is None or counted is None:
            return
        now = _Counted.of(node)
        if now.same_as(counted):
            return
        self._counted[ip] = now
        touched = self._add_to_counts(counted, -1) | self._add_to_counts(now, 1)
        self._publish_model_counts(touched)

    def _recount_model_nodes(self, state: ClusterState, labelled: frozenset[str]) -> None:
        self._labelled = labelled
        self._counted_config = state.config
        self._model_rings = {model: model_ring(state, model) for model in labelled}
        self._model_counts = {model: [0] * len(Health) for model in labelled}
        self._counted = {node.ip: _Counted.of(node) for node in state.nodes.values()}
        for counted in self._counted.values():
            self._add_to_counts(counted, 1)
        self._publish_model_counts(labelled)
        for model in self._published_counts.keys() - labelled:
            del self._published_counts[model]
            for status in Health:
                self.model_nodes.remove(model, status)

    def _add_to_counts(self, counted: _Counted, sign: int) -> set[str]:
        """Add (or with sign -1 take off) the node to the count of every labelled model it may
        serve; those models."""
        index = _STATUS_INDEX[counted.status]
        touched = set()
        for model in counted.models.allowed_among(self._labelled):
            if self._model_rings[model] == counted.ring:
                self._model_counts[model][index] += sign
                touched.add(model)
        return touched

    def _publish_model_counts(self, models: Iterable[str]) -> None:
        for model in models:
            counts = tuple(self._model_counts[model])
            published = self._published_counts.get(model)
            if published == counts:
                continue
            self._published_counts[model] = counts
            for index, status in enumerate(Health):
                if published is None or published[index] != counts[index]:
                    self.model_nodes.labels(model=model, status=status).set(counts[index])

    def _forget_node(self, ip: str) -> None:
        """A node removed by a reload no longer reports its states."""
        self._models_ok.pop(ip, None)
        try:
            self.node_models_ok.remove(ip)
        except KeyError:
            pass
        if self._loads.pop(ip, None) is not None:
            for gauge in (
                self.node_load_known,
                self.node_requests_running,
                self.node_requests_waiting,
                self.node_kv_cache_usage,
                self.node_seconds_per_token,
            ):
                with contextlib.suppress(KeyError):
                    gauge.remove(ip)
        if self._node_states.pop(ip, None) is not None:
            for status in Health:
                self.node_health.remove(ip, status)
            for discovery in Discovery:
                self.node_discovery.remove(ip, discovery)


def _listing_result(event: ModelsListed | ModelsUnchanged) -> str:
    """A listing's result as `interlock_model_discovery_total` counts it."""
    if isinstance(event, ModelsUnchanged):
        return "success"
    return "error" if event.models is None else "success" if event.models else "empty"

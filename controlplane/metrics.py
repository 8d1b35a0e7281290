"""The control plane's Prometheus metrics: plinth's names, labels and help texts (§5), plus
Interlock's own `interlock_*` series about the event pipeline.

Everything lives on the registry it is given (never prometheus_client's default one, so a
process can hold many control planes); the data plane adds its request metrics to the same one.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from controlplane.transitions import HEALTH, RELOAD, RUN, Step, StopProbing
from events.state import ClusterState, Health
from events.types import Event, ModelsListed, ProbeCrashed

_RECOUNT_KINDS = frozenset((RUN, RELOAD, HEALTH))
"""Transitions after which the node-status counts may differ; every status change logs one."""


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
        # At thousands of events a second `.labels()` and a locked `set` per event are a good
        # part of the reducer task's time: the labelled children are looked up once, the
        # sequence number is read when scraped, and a gauge is set only when its value changes.
        self._seq = 0
        self.snapshot_seq.set_function(lambda: self._seq)
        self._events_by_type: dict[str, Counter] = {}
        self._discovery_results: dict[tuple[str, str], Counter] = {}
        self._models_ok: dict[str, int] = {}

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
        elif isinstance(event, ModelsListed) and (node := state.nodes.get(event.node)) is not None:
            # plinth §8.4: counted on every listing, and the gauge holds the latest answer.
            result = "error" if event.models is None else "success" if event.models else "empty"
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
        if any(transition.kind in _RECOUNT_KINDS for transition in step.transitions):
            self._count_statuses(state)
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

    def _forget_node(self, ip: str) -> None:
        """A node removed by a reload no longer reports whether its models are settled."""
        self._models_ok.pop(ip, None)
        try:
            self.node_models_ok.remove(ip)
        except KeyError:
            pass

"""The control plane's Prometheus metrics: plinth's names, labels and help texts (§5), plus
Interlock's own `interlock_*` series about the event pipeline.

Everything lives on the registry it is given (never prometheus_client's default one, so a
process can hold many control planes); the data plane adds its request metrics to the same one.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from controlplane.reducer import HEALTH, RELOAD, RUN, Step, StopProbing
from controlplane.state import DEAD, DEGRADED, HEALTHY, ClusterState
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

    def record(self, event: Event, state: ClusterState, step: Step) -> None:
        """Account for one applied event; `state` is the snapshot it produced."""
        self.events.labels(type=type(event).__struct_config__.tag).inc()
        self.snapshot_seq.set(state.seq)
        if isinstance(event, ProbeCrashed):
            self.health_check_panics.inc()
        elif isinstance(event, ModelsListed) and (node := state.nodes.get(event.node)) is not None:
            # plinth §8.4: counted and set on every listing, changed or not.
            result = "error" if event.models is None else "success" if event.models else "empty"
            self.model_discovery.labels(node=event.node, result=result).inc()
            self.node_models_ok.labels(node=event.node).set(1 if node.models.settled() else 0)
        if any(transition.kind in _RECOUNT_KINDS for transition in step.transitions):
            self._count_statuses(state)
        for effect in step.effects:
            if isinstance(effect, StopProbing):
                self._forget_node(effect.node)

    def _count_statuses(self, state: ClusterState) -> None:
        counts = {HEALTHY: 0, DEGRADED: 0, DEAD: 0}
        for node in state.nodes.values():
            counts[node.status] += 1
        self.nodes_healthy.set(counts[HEALTHY])
        self.nodes_degraded.set(counts[DEGRADED])
        self.nodes_dead.set(counts[DEAD])

    def _forget_node(self, ip: str) -> None:
        """A node removed by a reload no longer reports whether its models are settled."""
        try:
            self.node_models_ok.remove(ip)
        except KeyError:
            pass

"""The reducer: `reduce(state, event) -> (state, step)`, the only place state changes.

Pure and deterministic: no I/O, no clock (time comes from `event.at`), no randomness, no
logging. The step lists the transitions (plinth's log messages and fields, for the live log,
metrics and audit) and the effects the runtime must run (data, never callables).
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

import msgspec

from controlplane.logs import log_line
from controlplane.state import (
    DEAD,
    DEGRADED,
    DISCOVERY_DEGRADED,
    EXPIRED,
    KNOWN,
    KNOWN_EMPTY,
    OFFLINE_SECONDS,
    UNTRIED,
    ClusterState,
    NodeState,
    compute_status,
    node_mapping,
    with_node,
)
from events.config import Config
from events.types import (
    ConfigReloaded,
    Event,
    GpuScraped,
    HealthProbed,
    ModelsListed,
    ProbeCrashed,
    ReloadRejected,
    RunStarted,
    RunStopped,
    UpstreamFailed,
    UpstreamRecovered,
)

# Kinds of transition, for `interlock audit --kind`.
RUN = "run"
RELOAD = "reload"
HEALTH = "health"
MODELS = "models"
OFFLINE = "offline"
TRANSITION_KINDS = (RUN, RELOAD, HEALTH, MODELS, OFFLINE)


class Transition(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One line of the transition log: plinth's message and fields, stamped with the event."""

    seq: int
    at: float
    kind: str
    level: str
    msg: str
    node: str = ""
    fields: tuple[tuple[str, str], ...] = ()

    def log_line(self) -> str:
        """plinth's JSON log line (§6) at the event's time, plus `seq`."""
        return log_line(self.at, self.level, self.msg, (("seq", str(self.seq)),) + self.fields)


class Recheck(msgspec.Struct, frozen=True, tag="recheck"):
    """Probe this node's health once, now (after the data plane found it unreachable)."""

    node: str


class StartProbing(msgspec.Struct, frozen=True, tag="start_probing"):
    node: str


class StopProbing(msgspec.Struct, frozen=True, tag="stop_probing"):
    node: str


Effect = Recheck | StartProbing | StopProbing


class Step(msgspec.Struct, frozen=True):
    transitions: tuple[Transition, ...] = ()
    effects: tuple[Effect, ...] = ()


NOTHING = Step()


class _StepBuilder:
    """Collects one event's transitions, stamped with its seq and time."""

    def __init__(self, event: Event):
        self.event = event
        self.transitions: list[Transition] = []
        self.effects: list[Effect] = []

    def log(self, kind: str, level: str, msg: str, node: str = "", **fields: object) -> None:
        pairs = tuple((key, str(value)) for key, value in fields.items())
        if node:
            pairs = (("node", node),) + pairs
        self.transitions.append(
            Transition(seq=self.event.seq, at=self.event.at, kind=kind, level=level, msg=msg, node=node, fields=pairs)
        )

    def step(self) -> Step:
        return Step(tuple(self.transitions), tuple(self.effects)) if self.transitions or self.effects else NOTHING


def reduce(state: ClusterState, event: Event) -> tuple[ClusterState, Step]:
    """Apply one numbered event; events about unknown nodes change nothing but seq and at."""
    out = _StepBuilder(event)
    node_handler = _NODE_HANDLERS.get(type(event))
    if node_handler is None:
        state = _CLUSTER_HANDLERS[type(event)](state, event, out)
        return msgspec.structs.replace(state, seq=event.seq, at=event.at), out.step()
    node = state.nodes.get(event.node)
    if node is None or state.config is None:
        return msgspec.structs.replace(state, seq=event.seq, at=event.at), NOTHING
    updated = node_handler(node, event, state.config, out)
    nodes = state.nodes if updated is node else with_node(state.nodes, updated)
    return msgspec.structs.replace(state, seq=event.seq, at=event.at, nodes=nodes), out.step()


# --- run and reload -------------------------------------------------------------------------


def _run_started(state: ClusterState, event: RunStarted, out: _StepBuilder) -> ClusterState:
    config = event.config
    out.log(RUN, "info", "starting gateway", cluster=config.cluster.name)
    out.log(RUN, "info", "config loaded", nodes=len(config.nodes), models=len(config.models.available))
    out.effects.extend(StartProbing(node.ip) for node in config.nodes)
    nodes = node_mapping([NodeState.fresh(node) for node in config.nodes])
    return msgspec.structs.replace(
        state, version=event.version, config_path=event.config_path, config=config, nodes=nodes
    )


_RESTART_KEYS = ("listen", "metrics_listen", "event_log", "event_log_max_bytes")
"""Gateway settings a running gateway keeps until it restarts (plinth warns for the listen addresses)."""


def _config_reloaded(state: ClusterState, event: ConfigReloaded, out: _StepBuilder) -> ClusterState:
    config = event.config
    if state.config is not None:
        for key in _RESTART_KEYS:
            old, new = getattr(state.config.gateway, key), getattr(config.gateway, key)
            if old != new:
                out.log(RELOAD, "warn", f"gateway.{key} changed; requires restart", old=old, new=new)
    nodes = []
    for node_config in config.nodes:
        previous = state.nodes.get(node_config.ip)
        if previous is None:
            nodes.append(NodeState.fresh(node_config))
            out.effects.append(StartProbing(node_config.ip))
        else:
            # plinth's NewMonitorWithState: health, discovery and the skip-set carry over.
            nodes.append(
                NodeState(
                    ip=node_config.ip,
                    name=node_config.name,
                    ring=node_config.ring,
                    status=previous.status,
                    consecutive_failures=previous.consecutive_failures,
                    models=previous.models,
                    offline_until=previous.offline_until,
                )
            )
    kept = {node.ip for node in config.nodes}
    out.effects.extend(StopProbing(ip) for ip in state.nodes if ip not in kept)
    out.log(RELOAD, "info", "config reloaded", nodes=len(config.nodes), models=len(config.models.available))
    return msgspec.structs.replace(state, config_path=event.config_path, config=config, nodes=node_mapping(nodes))


def _reload_rejected(state: ClusterState, event: ReloadRejected, out: _StepBuilder) -> ClusterState:
    out.log(RELOAD, "error", "config reload failed; keeping current config", error=event.error)
    return state


def _run_stopped(state: ClusterState, event: RunStopped, out: _StepBuilder) -> ClusterState:
    out.log(RUN, "info", "gateway stopped")
    return state


# --- health ---------------------------------------------------------------------------------

_STATUS_LEVEL = {DEAD: "error", DEGRADED: "warn"}


def _health_probed(node: NodeState, event: HealthProbed, config: Config, out: _StepBuilder) -> NodeState:
    failures = 0 if event.ok else node.consecutive_failures + 1
    status = compute_status(failures, config.gateway.health_fail_threshold)
    if status != node.status:
        detail = {} if event.ok else {"error": _probe_error(event)}
        out.log(
            HEALTH,
            _STATUS_LEVEL.get(status, "info"),
            "node health changed",
            node=node.ip,
            **{"from": node.status, "to": status, "failures": failures},
            **detail,
        )
    return msgspec.structs.replace(node, status=status, consecutive_failures=failures, last_check=event.at)


def _probe_error(event: HealthProbed) -> str:
    return event.error or f"health endpoint returned status {event.status}"


def _probe_crashed(node: NodeState, event: ProbeCrashed, config: Config, out: _StepBuilder) -> NodeState:
    out.log(HEALTH, "error", "health check panicked", node=node.ip, panic=event.error)
    return node


def _gpu_scraped(node: NodeState, event: GpuScraped, config: Config, out: _StepBuilder) -> NodeState:
    if not event.gpus:
        return node  # plinth keeps the previous GPUs when a scrape gives no result
    return msgspec.structs.replace(node, gpus=event.gpus)


# --- model discovery (GH-31) ----------------------------------------------------------------


def _models_listed(node: NodeState, event: ModelsListed, config: Config, out: _StepBuilder) -> NodeState:
    before = node.models
    after, list_changed = before.apply_result(event.models, event.error, config.gateway.health_fail_threshold, event.at)
    if after.state != before.state:
        if after.state == KNOWN_EMPTY:
            out.log(MODELS, "warn", "node reports no models", node=node.ip)
        elif after.state == DISCOVERY_DEGRADED:
            out.log(MODELS, "warn", "model discovery failed", node=node.ip, error=after.last_error)
        elif after.state == EXPIRED:
            out.log(MODELS, "error", "model discovery expired", node=node.ip, error=after.last_error)
        elif after.state == KNOWN:
            msg = "models discovered" if before.state == UNTRIED else "model discovery recovered"
            out.log(MODELS, "info", msg, node=node.ip, models=",".join(after.names or ()))
    if list_changed:
        out.log(MODELS, "info", "node model list changed", node=node.ip, models=",".join(after.names or ()))
        for model in configured_models_missing(node.ring, after.names or (), config):
            out.log(MODELS, "warn", "configured model not served by node", node=node.ip, model=model)
    return msgspec.structs.replace(node, models=after)


def configured_models_missing(ring: str, names: tuple[str, ...], config: Config) -> list[str]:
    """plinth's warnConfigModelsMissing (§8.5): configured models a node of `ring` ("" for a
    standalone node) should serve but does not (`names`)."""
    missing = []
    available_names = set()
    for entry in config.models.available:
        available_names.add(entry.name)
        if entry.ring == ring and entry.name and entry.name not in names:
            missing.append(entry.name)
    default = config.models.default
    if default and default not in available_names and default not in names:
        missing.append(default)
    return missing


# --- data-plane observations (the offline skip-set) -----------------------------------------


def _upstream_failed(node: NodeState, event: UpstreamFailed, config: Config, out: _StepBuilder) -> NodeState:
    if node.is_offline(event.at):
        return node  # plinth's mark() returns false when already offline: no second recheck
    until = event.at + OFFLINE_SECONDS
    out.log(OFFLINE, "warn", "node marked offline", node=node.ip, error=event.error, seconds=f"{OFFLINE_SECONDS:g}")
    out.effects.append(Recheck(node.ip))
    return msgspec.structs.replace(node, offline_until=until)


def _upstream_recovered(node: NodeState, event: UpstreamRecovered, config: Config, out: _StepBuilder) -> NodeState:
    if node.offline_until is None:
        return node
    if node.is_offline(event.at):
        out.log(OFFLINE, "info", "node back online", node=node.ip)
    return msgspec.structs.replace(node, offline_until=None)


_CLUSTER_HANDLERS: dict[type, Callable[[ClusterState, Event, _StepBuilder], ClusterState]] = {
    RunStarted: _run_started,
    ConfigReloaded: _config_reloaded,
    ReloadRejected: _reload_rejected,
    RunStopped: _run_stopped,
}

_NODE_HANDLERS: dict[type, Callable[[NodeState, Event, Config, _StepBuilder], NodeState]] = {
    HealthProbed: _health_probed,
    ProbeCrashed: _probe_crashed,
    GpuScraped: _gpu_scraped,
    ModelsListed: _models_listed,
    UpstreamFailed: _upstream_failed,
    UpstreamRecovered: _upstream_recovered,
}
"""Events about one node (`event.node`): the handler gets that node and returns it, changed or not."""

INITIAL_STATE = ClusterState(nodes=MappingProxyType({}))

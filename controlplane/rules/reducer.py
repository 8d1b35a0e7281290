"""The reducer: `reduce(state, event) -> (state, step)`, the only place the control-plane state changes.

`reduce` is a pure function of its two arguments: no I/O, no clock (time comes from `event.at`),
no randomness, no logging. Given the same state and the same numbered event it returns the same
new state and the same `Step` (the transitions to log and the effects to run), byte for byte; so
folding it over a recorded event log reproduces every state and every transition line of the
live run. Cluster events (run, reload, stop) are handled here; node events go to the handler of
the rule they feed: health (`controlplane.rules.health`), model discovery (`controlplane.rules.discovery`),
load (`controlplane.rules.load`), the loads of LoRA adapters (`controlplane.rules.adapters`), and the data
plane's offline skip-set (here).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from controlplane.rules.adapters import adapter_load_failed, adapter_load_requested, adapter_loaded
from controlplane.rules.discovery import models_listed, models_unchanged
from controlplane.rules.health import gpu_scraped, health_probed, probe_crashed
from controlplane.rules.load import load_scraped
from controlplane.rules.transitions import (
    NOTHING,
    OFFLINE,
    RELOAD,
    RUN,
    Recheck,
    StartProbing,
    Step,
    StepBuilder,
    StopProbing,
)
from events.config import RESTART_KEYS, Config
from events.state import ClusterState, NodeMap, NodeState, node_mapping, with_node
from events.types import (
    AdapterLoaded,
    AdapterLoadFailed,
    AdapterLoadRequested,
    Checkpoint,
    ConfigReloaded,
    Event,
    GpuScraped,
    HealthProbed,
    LoadScraped,
    ModelsListed,
    ModelsUnchanged,
    ProbeCrashed,
    ReloadRejected,
    RunStarted,
    RunStopped,
    UpstreamFailed,
    UpstreamRecovered,
)

OFFLINE_SECONDS = 10.0
"""How long the data plane skips a node after a connection failure (plinth's skip-set)."""


def reduce(state: ClusterState, event: Event) -> tuple[ClusterState, Step]:
    """Apply one numbered event; events about unknown nodes change nothing but seq and at."""
    out = StepBuilder(event)
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


def _run_started(state: ClusterState, event: RunStarted, out: StepBuilder) -> ClusterState:
    config = event.config
    out.log(RUN, "info", "starting gateway", cluster=config.cluster.name)
    out.log(RUN, "info", "config loaded", nodes=len(config.nodes), models=len(config.models.available))
    out.effects.extend(StartProbing(node.ip) for node in config.nodes)
    nodes = node_mapping([NodeState.fresh(node) for node in config.nodes])
    return msgspec.structs.replace(
        state, version=event.version, config_path=event.config_path, config=config, nodes=nodes
    )


def _config_reloaded(state: ClusterState, event: ConfigReloaded, out: StepBuilder) -> ClusterState:
    config = event.config
    if state.config is not None:
        for key in RESTART_KEYS:
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
            # plinth's NewMonitorWithState: health, discovery and the skip-set carry over; the
            # node's configured name and ring are the new ones, and its GPUs are scraped anew.
            nodes.append(
                msgspec.structs.replace(
                    previous, name=node_config.name, ring=node_config.ring, last_check=None, gpus=()
                )
            )
    kept = {node.ip for node in config.nodes}
    out.effects.extend(StopProbing(ip) for ip in state.nodes if ip not in kept)
    # At warn when the new config logs nothing below it, so an operator sees the reload take effect.
    level = "info" if config.gateway.log_level == "info" else "warn"
    out.log(RELOAD, level, "config reloaded", nodes=len(config.nodes), models=len(config.models.available))
    return msgspec.structs.replace(state, config_path=event.config_path, config=config, nodes=node_mapping(nodes))


def _reload_rejected(state: ClusterState, event: ReloadRejected, out: StepBuilder) -> ClusterState:
    out.log(RELOAD, "error", "config reload failed; keeping current config", error=event.error)
    return state


def _run_stopped(state: ClusterState, event: RunStopped, out: StepBuilder) -> ClusterState:
    out.log(RUN, "info", "gateway stopped")
    return state


def _checkpoint(state: ClusterState, event: Checkpoint, out: StepBuilder) -> ClusterState:
    """The state is the one the checkpoint carries, whatever came before (nothing to log)."""
    return event.state()


# --- data-plane observations (the offline skip-set) -----------------------------------------


def _upstream_failed(node: NodeState, event: UpstreamFailed, config: Config, out: StepBuilder) -> NodeState:
    if node.is_offline(event.at):
        return node  # plinth's mark() returns false when already offline: no second recheck
    until = event.at + OFFLINE_SECONDS
    out.log(OFFLINE, "warn", "node marked offline", node=node.ip, error=event.error, seconds=f"{OFFLINE_SECONDS:g}")
    out.effects.append(Recheck(node.ip))
    return msgspec.structs.replace(node, offline_until=until)


def _upstream_recovered(node: NodeState, event: UpstreamRecovered, config: Config, out: StepBuilder) -> NodeState:
    if node.offline_until is None:
        return node
    if node.is_offline(event.at):
        out.log(OFFLINE, "info", "node back online", node=node.ip)
    return msgspec.structs.replace(node, offline_until=None)


_CLUSTER_HANDLERS: dict[type, Callable[[ClusterState, Event, StepBuilder], ClusterState]] = {
    RunStarted: _run_started,
    ConfigReloaded: _config_reloaded,
    ReloadRejected: _reload_rejected,
    RunStopped: _run_stopped,
    Checkpoint: _checkpoint,
}

_NODE_HANDLERS: dict[type, Callable[[NodeState, Event, Config, StepBuilder], NodeState]] = {
    HealthProbed: health_probed,
    ProbeCrashed: probe_crashed,
    GpuScraped: gpu_scraped,
    ModelsListed: models_listed,
    ModelsUnchanged: models_unchanged,
    LoadScraped: load_scraped,
    UpstreamFailed: _upstream_failed,
    UpstreamRecovered: _upstream_recovered,
    AdapterLoadRequested: adapter_load_requested,
    AdapterLoaded: adapter_loaded,
    AdapterLoadFailed: adapter_load_failed,
}
"""Events about one node (`event.node`): the handler gets that node and returns it, changed or not."""

INITIAL_STATE = ClusterState(nodes=NodeMap({}))

"""Small builders shared by the control-plane tests: a config, its RunStarted, and `apply`."""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from controlplane.rules.reducer import INITIAL_STATE, reduce
from controlplane.rules.transitions import Effect, Transition
from events.config import Config, GatewayConfig, ModelEntry, ModelsConfig, NodeConfig
from events.state import ClusterState
from events.types import Event, RunStarted

T0 = 1767323045.0
"""2026-01-02T03:04:05Z: the time of the first event in most tests."""


def node_ip(index: int) -> str:
    """The IP of node number `index` (1-based): 10.0.0.1, 10.0.0.2, …"""
    return f"10.0.0.{index}"


def make_config(
    nodes: int | Iterable[NodeConfig] = 3,
    *,
    threshold: int = 3,
    models: Iterable[ModelEntry] = (),
    default: str = "",
    **gateway: object,
) -> Config:
    """A config of `nodes` standalone nodes (or the given NodeConfigs); `gateway` overrides keys."""
    if isinstance(nodes, int):
        nodes = [NodeConfig(ip=node_ip(i), name=f"node-{i}") for i in range(1, nodes + 1)]
    return Config(
        gateway=GatewayConfig(health_fail_threshold=threshold, **gateway),
        nodes=tuple(nodes),
        models=ModelsConfig(default=default, available=tuple(models)),
    )


def run_started(config: Config, at: float = T0) -> RunStarted:
    return RunStarted(at=at, version="test", config_path="gateway.toml", config=config)


def apply(
    events: Iterable[Event], state: ClusterState = INITIAL_STATE
) -> tuple[ClusterState, list[Transition], list[Effect]]:
    """Number the events after `state.seq` and reduce them in order, as the reducer task does.

    Returns the final state and every transition and effect, in order.
    """
    transitions: list[Transition] = []
    effects: list[Effect] = []
    for event in events:
        state, step = reduce(state, msgspec.structs.replace(event, seq=state.seq + 1))
        transitions.extend(step.transitions)
        effects.extend(step.effects)
    return state, transitions, effects


def messages(transitions: Iterable[Transition]) -> list[str]:
    return [transition.msg for transition in transitions]


def encode_state(state: ClusterState) -> bytes:
    """A state as JSON bytes (its read-only node mapping as an object), to compare states exactly."""
    return msgspec.json.encode(state, enc_hook=dict)

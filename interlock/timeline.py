"""The model of `interlock timeline`: a recorded run as lanes of states over time, drawn by
`interlock.timeline_page`.

A lane per node holds its health and its model discovery over time, as the states
`controlplane.effects.replay.replay_steps` rebuilds them (nothing is re-derived here), and each
transition with its seq and message; gateway starts, stops and reloads, a reload with what it
changed (nodes, models, policy); a lane per model, when no node would have served it
(`controlplane.rules.routing.plan_route`'s pick pool empty); with a decision log, the requests
and the failed ones (5xx, or a response its node cut short) per bin of time.
"""

from __future__ import annotations

import datetime
import math
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from controlplane.effects.replay import replay_steps
from controlplane.rules.routing import plan_route
from controlplane.rules.transitions import OFFLINE, Transition
from events.config import Config
from events.decisions import AttemptOutcome, Decision, read_decisions
from events.state import ClusterState, NodeState
from events.types import Checkpoint, ConfigReloaded, ReloadRejected, RunStarted, RunStopped


class TimelineError(Exception):
    """Nothing to draw: no events, or none before the window ends."""


class Band(NamedTuple):
    """A node (or the gateway) in one state from `start` to `end`."""

    start: float
    end: float
    state: str


@dataclass
class Lane:
    ip: str
    name: str = ""
    ring: str = ""
    health: list[Band] = field(default_factory=list)
    models: list[Band] = field(default_factory=list)
    offline: list[Band] = field(default_factory=list)
    """When the data plane skipped the node after failing to reach it."""
    marks: list[Transition] = field(default_factory=list)


@dataclass
class ModelLane:
    """A model, and when a request for it would have found a node to go to (`SERVED`) or none
    (`UNSERVED`: the gateway would have answered 503)."""

    name: str
    bands: list[Band] = field(default_factory=list)


SERVED = "served"
UNSERVED = "no node"


@dataclass
class GatewayEvent:
    """A start, stop or reload: a vertical line through every lane, with its transitions; a
    reload's `changes` say what it changed (`nodes: +10.0.0.5 (gpu-node-5)`)."""

    at: float
    label: str
    transitions: list[Transition]
    changes: list[str] = field(default_factory=list)


class TrafficBin(NamedTuple):
    start: float
    requests: int
    failures: int
    """Requests that failed the client: answered with a 5xx status, or cut short by their node
    after the answer had begun (a stream ended with an error event; its status stays 200)."""


@dataclass
class Traffic:
    bin_seconds: float
    bins: list[TrafficBin]


@dataclass
class Timeline:
    start: float
    end: float
    lanes: list[Lane]
    model_lanes: list[ModelLane]
    gateway_events: list[GatewayEvent]
    stopped: list[Band]
    """When the gateway was not running (between a stop and the next start)."""
    traffic: Traffic | None
    cluster: str
    sources: list[str]
    event_count: int
    """Events within the window (those before it are replayed, not counted)."""


_GATEWAY_LABELS = {RunStarted: "start", RunStopped: "stop", ConfigReloaded: "reload", ReloadRejected: "reload rejected"}


# --- building --------------------------------------------------------------------------------


class _LaneRecorder:
    """Turns a node's successive states into bands, keeping the one still open per row."""

    def __init__(self, lane: Lane):
        self.lane = lane
        self.health: tuple[str, float] | None = None
        self.models: tuple[str, float] | None = None
        self.offline: tuple[float, float] | None = None
        """(since, until) of the open offline band."""

    def observe(self, node: NodeState, at: float) -> None:
        self.lane.name, self.lane.ring = node.name, node.ring
        self.health = _advance(self.lane.health, self.health, node.status, at)
        self.models = _advance(self.lane.models, self.models, node.models.state, at)
        until = node.offline_until if node.is_offline(at) else None
        if self.offline is not None and until != self.offline[1]:
            self.lane.offline.append(Band(self.offline[0], min(self.offline[1], at), OFFLINE))
            self.offline = None
        if until is not None and self.offline is None:
            self.offline = (at, until)

    def close(self, at: float) -> None:
        for bands, open_band in ((self.lane.health, self.health), (self.lane.models, self.models)):
            if open_band is not None:
                bands.append(Band(open_band[1], at, open_band[0]))
        if self.offline is not None:
            self.lane.offline.append(Band(self.offline[0], min(self.offline[1], at), OFFLINE))
        self.health = self.models = self.offline = None


def _advance(bands: list[Band], open_band: tuple[str, float] | None, state: str, at: float) -> tuple[str, float]:
    if open_band is not None and open_band[0] == state:
        return open_band
    if open_band is not None:
        bands.append(Band(open_band[1], at, open_band[0]))
    return (state, at)


class _ModelRecorder:
    """Turns the states into each model's served / unserved bands. Whether a model has a node
    changes with the state, or when an offline mark ends: `catch_up` looks at those moments."""

    def __init__(self) -> None:
        self.lanes: dict[str, ModelLane] = {}
        self.open: dict[str, tuple[str, float]] = {}
        self.state: ClusterState | None = None
        self.seen_at = -math.inf

    def observe(self, state: ClusterState, at: float) -> None:
        self.catch_up(at)
        self.state, self.seen_at = state, at
        self._look(at)

    def catch_up(self, until: float) -> None:
        """Look again, on the last state, at each moment an offline mark ended before `until`."""
        if self.state is None:
            return
        ends = {node.offline_until for node in self.state.nodes.values() if node.offline_until is not None}
        ends = sorted(at for at in ends if self.seen_at < at < until)
        for at in ends:
            self.seen_at = at
            self._look(at)

    def close(self, at: float) -> None:
        self.catch_up(at)
        for name in list(self.open):
            self._end(name, at)
        self.state = None

    def _look(self, at: float) -> None:
        models = _lane_models(self.state)
        for name in [name for name in self.open if name not in models]:  # removed by a reload
            self._end(name, at)
        for name in models:
            lane = self.lanes.setdefault(name, ModelLane(name))
            served = SERVED if plan_route(self.state, name, at).pick_pool else UNSERVED
            self.open[name] = _advance(lane.bands, self.open.get(name), served, at)

    def _end(self, name: str, at: float) -> None:
        state, since = self.open.pop(name)
        self.lanes[name].bands.append(Band(since, at, state))


def _lane_models(state: ClusterState) -> list[str]:
    """The models that get a lane, as `/ready` counts them: the configured ones, else those the nodes list."""
    configured = [model.name for model in state.config.models.available] if state.config is not None else []
    if configured:
        return list(dict.fromkeys(configured))
    return sorted({name for node in state.nodes.values() for name in node.models.names or ()})


def reload_changes(before: Config | None, after: Config) -> list[str]:
    """What a reload changed of the nodes, the models and the routing policies, one line each."""
    if before is None:
        return []

    def difference(what: str, old: dict[str, str], new: dict[str, str]) -> list[str]:
        added = [f"+{key}{new[key]}" for key in new if key not in old]
        removed = [f"-{key}{old[key]}" for key in old if key not in new]
        return [f"{what}: {' '.join(added + removed)}"] if added or removed else []

    def nodes(config: Config) -> dict[str, str]:
        return {node.ip: f" ({node.name})" if node.name else "" for node in config.nodes}

    def models(config: Config) -> dict[str, str]:
        return {model.name: f" (ring {model.ring})" if model.ring else "" for model in config.models.available}

    models_before = models(before)
    changes = difference("nodes", nodes(before), nodes(after)) + difference("models", models_before, models(after))
    if before.routing.policy != after.routing.policy:
        changes.append(f"policy: {before.routing.policy} → {after.routing.policy}")
    for model in after.models.available:
        old, new = before.model_policy(model.name), after.model_policy(model.name)
        if old != new and model.name in models_before:
            changes.append(f"policy of {model.name}: {old} → {new}")
    return changes


def build_timeline(
    logs: Iterable[str | os.PathLike],
    *,
    since: float | None = None,
    until: float | None = None,
    decisions: str | os.PathLike | None = None,
    warn: Callable[[str], None] | None = None,
) -> Timeline:
    """Replay the logs up to `until` and keep what happened within [since, until] (default: the
    whole log); with a decision log, its requests in that window too."""
    logs = list(logs)
    lanes: dict[str, Lane] = {}
    running: dict[str, _LaneRecorder] = {}
    models = _ModelRecorder()
    config: Config | None = None
    gateway_events: list[GatewayEvent] = []
    stopped: list[Band] = []
    stopped_since: float | None = None
    first_at = last_at = None
    event_count = 0
    cluster = ""
    for event, state, step in replay_steps(logs, until_at=until, warn=warn):
        event_count += since is None or event.at >= since
        first_at = event.at if first_at is None else first_at
        last_at = event.at
        if not step.transitions and not isinstance(event, Checkpoint):
            continue  # every other state change that shows comes with a transition
        if isinstance(event, RunStopped):
            for recorder in running.values():
                recorder.close(event.at)
            running.clear()
            models.close(event.at)
            stopped_since = event.at
        else:
            if stopped_since is not None:
                stopped.append(Band(stopped_since, event.at, "stopped"))
                stopped_since = None
            for ip, node in state.nodes.items():
                if ip not in running:
                    running[ip] = _LaneRecorder(lanes.setdefault(ip, Lane(ip)))
                running[ip].observe(node, event.at)
            for ip in [ip for ip in running if ip not in state.nodes]:  # removed by a reload
                running.pop(ip).close(event.at)
            models.observe(state, event.at)
        if state.config is not None:
            cluster = state.config.cluster.name
        label = _GATEWAY_LABELS.get(type(event))
        if label is not None:
            changes = reload_changes(config, state.config) if isinstance(event, ConfigReloaded) else []
            gateway_events.append(GatewayEvent(event.at, label, list(step.transitions), changes))
        else:
            for transition in step.transitions:
                lanes[transition.node].marks.append(transition)
        config = state.config
    if first_at is None:
        raise TimelineError("no events in the log" + ("" if until is None else " up to --until"))
    start = first_at if since is None else since
    end = last_at if until is None else until
    if start >= end and since is not None:
        raise TimelineError(f"nothing to draw: the log ends at {utc(end)}, before --since")
    end = max(end, start + 1.0)
    for recorder in running.values():
        recorder.close(end)
    models.close(end)
    if stopped_since is not None:
        stopped.append(Band(stopped_since, end, "stopped"))
    traffic = None
    if decisions is not None:
        traffic = bin_requests(read_decisions(decisions, warn), start, end)
    return Timeline(
        start=start,
        end=end,
        lanes=[
            _clip_lane(lane, start, end)
            for lane in sorted(lanes.values(), key=lambda lane: _natural(lane.ip))
            if _shows(lane, start, end)
        ],
        model_lanes=[
            ModelLane(lane.name, _clip(lane.bands, start, end))
            for lane in models.lanes.values()
            if any(band.start < end and band.end > start for band in lane.bands)
        ],
        gateway_events=[event for event in gateway_events if start <= event.at <= end],
        stopped=_clip(stopped, start, end),
        traffic=traffic,
        cluster=cluster,
        sources=[os.fspath(log) for log in logs],
        event_count=event_count,
    )


def _natural(text: str) -> list[str | int]:
    """A sort key that puts 10.0.0.2 before 10.0.0.10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _clip(bands: list[Band], start: float, end: float) -> list[Band]:
    return [
        Band(max(band.start, start), min(band.end, end), band.state)
        for band in bands
        if band.start < end and band.end > start
    ]


def _clip_lane(lane: Lane, start: float, end: float) -> Lane:
    return Lane(
        ip=lane.ip,
        name=lane.name,
        ring=lane.ring,
        health=_clip(lane.health, start, end),
        models=_clip(lane.models, start, end),
        offline=_clip(lane.offline, start, end),
        marks=[mark for mark in lane.marks if start <= mark.at <= end],
    )


def _shows(lane: Lane, start: float, end: float) -> bool:
    """Whether the node was configured at some time in the window."""
    return any(band.start < end and band.end > start for band in lane.health)


def failed(decision: Decision) -> bool:
    """Whether the client got a failure: a 5xx, or an answer its node cut short."""
    answered_5xx = decision.status is not None and decision.status >= 500
    return answered_5xx or any(attempt.outcome == AttemptOutcome.TRUNCATED for attempt in decision.attempts)


def bin_requests(decisions: Iterable[Decision], start: float, end: float) -> Traffic:
    """Requests and failures (`failed`) per bin of a round width, about 60 bins across the window."""
    width = nice_step((end - start) / 60, BIN_STEPS)
    bins = [[0, 0] for _ in range(math.ceil((end - start) / width))]
    for decision in decisions:
        if start <= decision.at < end:
            counts = bins[int((decision.at - start) // width)]
            counts[0] += 1
            counts[1] += failed(decision)
    return Traffic(
        width, [TrafficBin(start + i * width, requests, errors) for i, (requests, errors) in enumerate(bins)]
    )


# --- time ------------------------------------------------------------------------------------

BIN_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)


def nice_step(at_least: float, steps: tuple[int, ...]) -> int:
    return next((step for step in steps if step >= at_least), steps[-1])


def utc(at: float, spec: str = "%Y-%m-%dT%H:%M:%SZ") -> str:
    return datetime.datetime.fromtimestamp(at, datetime.UTC).strftime(spec)

"""Replay, explain and audit a recorded event log: the reason the control plane is event-sourced.

A log is self-contained (each run starts with its config), so folding `reduce` over its events
gives back every state the live gateway had and every transition line it printed. `explain` asks
routing (`plan_route`, the function the data plane uses) about one recorded moment; `audit`
filters the transitions. The `interlock` CLI parses the arguments and renders the results
(`interlock.render`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator

import msgspec

from controlplane.rules.reducer import INITIAL_STATE, reduce
from controlplane.rules.routing import NO_HEALTHY_NODE, NO_REACHABLE_NODE, RoutePlan, plan_route
from controlplane.rules.transitions import Step, Transition
from events.config import Config
from events.log import read_events
from events.state import ClusterState
from events.types import Checkpoint, ConfigReloaded, Event, RunStarted, RunStopped


class ReplayResult(msgspec.Struct, frozen=True, kw_only=True):
    state: ClusterState
    """The state after the last applied event."""
    transitions: tuple[Transition, ...]
    """Every transition of the applied events, in order: the live run's transition log."""
    event_count: int
    last_at: float | None
    """`at` of the last applied event; None when no event was applied."""
    stopped: Transition | None = None
    """The `gateway stopped` transition when the last applied event stopped the gateway: it
    served nothing from then on, until a run_started that this replay did not reach."""
    configured_nodes: frozenset[tuple[str, str]] = frozenset()
    """Every (ip, name) a config of the log gave a node, for finding a node by either."""
    from_seq: int = 0
    """The replay starts from the state after this seq: 0 for a log read from its first event,
    else the seq of the checkpoint (or the one before the run_started) the remaining segments
    begin with."""

    def moment(self, at: float | None = None) -> float:
        """The time to judge the state at: `at` if given, else the last applied event's time."""
        if at is not None:
            return at
        return self.last_at if self.last_at is not None else 0.0


def replay_steps(
    paths: Iterable[str | os.PathLike],
    *,
    until_seq: int | None = None,
    until_at: float | None = None,
    warn: Callable[[str], None] | None = None,
    skip_invalid: Callable[[str], None] | None = None,
    rewrite: Callable[[Iterator[Event]], Iterator[Event]] | None = None,
) -> Iterator[tuple[Event, ClusterState, Step]]:
    """Apply the events of the given segments (or logs) in order, as the live reducer did, and
    yield each event with the state after it and its step.

    Stops before the first event numbered above `until_seq` or observed after `until_at`. A log
    whose older segments are gone starts at a checkpoint (the whole state at its seq), and says
    so through `warn`. A torn last line, and a gap or a step back in the numbering (events the
    live run could not write: the state may differ from the live one until the next
    checkpoint), are reported through `warn`; other bad lines raise LogFileError, unless
    `skip_invalid` takes them (`read_events`). `rewrite` (a what-if: `with_config`) turns the
    recorded events into the ones folded, after their numbering is checked.
    """
    events = _numbering_checked(read_events(paths, warn, skip_invalid), warn)
    state = INITIAL_STATE
    for event in rewrite(events) if rewrite is not None else events:
        if (until_seq is not None and event.seq > until_seq) or (until_at is not None and event.at > until_at):
            break
        state, step = reduce(state, event)
        yield event, state, step


def _numbering_checked(events: Iterator[Event], warn: Callable[[str], None] | None) -> Iterator[Event]:
    """`events`, with a warning through `warn` for a log that starts at a checkpoint and for a
    gap or a step back in the numbering."""
    previous: Event | None = None
    for event in events:
        if warn is not None:
            if previous is None and isinstance(event, Checkpoint):
                warn(f"the log starts at the checkpoint of seq {event.seq} (its older segments are gone)")
            elif previous is not None and event.seq != previous.seq + (0 if isinstance(event, Checkpoint) else 1):
                warn(_numbering_warning(previous.seq, event))
        previous = event
        yield event


def with_config(
    events: Iterable[Event], change: Callable[[Config], Config], since: float | None = None
) -> Iterator[Event]:
    """`events` as if every config in force from `since` on (None: the log's start) had been
    `change`d: the config in force at `since` is reloaded changed (a config_reloaded numbered as
    the event before it, so the decisions made on that seq see it), and each later run_started
    and config_reloaded carries its config changed. A checkpoint that follows the event before
    it is left out (the changed run's state goes on from its own); one that starts the log, or
    follows a gap, restores its state without the nodes the changed config lacks, then the
    changed config is reloaded: a node the change removes stays removed. The reducer folds them
    as it folded the recorded ones."""
    in_force: ConfigReloaded | None = None
    """The last config of the log, as a reload of it."""
    previous_seq: int | None = None
    started = since is None
    for event in events:
        if not started and event.at >= since:
            started = True
            if in_force is not None:
                yield _reload(in_force, change, seq=previous_seq or 0, at=since)
        follows = previous_seq is not None and event.seq == previous_seq
        previous_seq = event.seq
        if isinstance(event, (RunStarted, ConfigReloaded, Checkpoint)) and event.config is not None:
            in_force = ConfigReloaded(at=event.at, seq=event.seq, config_path=event.config_path, config=event.config)
            if started and isinstance(event, Checkpoint):
                if follows:
                    continue
                reload = _reload(in_force, change, seq=event.seq, at=event.at)
                kept = {node.ip for node in reload.config.nodes}
                yield msgspec.structs.replace(event, nodes=tuple(node for node in event.nodes if node.ip in kept))
                event = reload
            elif started:
                event = msgspec.structs.replace(event, config=change(event.config))
        yield event


def _reload(recorded: ConfigReloaded, change: Callable[[Config], Config], *, seq: int, at: float) -> ConfigReloaded:
    return ConfigReloaded(at=at, seq=seq, config_path=recorded.config_path, config=change(recorded.config))


def starting_seq(event: Event) -> int:
    """The seq of the state a log beginning with `event` starts from (a checkpoint carries the
    state after its seq; any other event follows the one before it)."""
    return event.seq if isinstance(event, Checkpoint) else event.seq - 1


def replay(
    paths: Iterable[str | os.PathLike],
    *,
    until_seq: int | None = None,
    until_at: float | None = None,
    warn: Callable[[str], None] | None = None,
    skip_invalid: Callable[[str], None] | None = None,
) -> ReplayResult:
    """The state after the last applied event and every transition on the way (`replay_steps`)."""
    state = INITIAL_STATE
    transitions: list[Transition] = []
    event_count = 0
    stopped = None
    configured_nodes: set[tuple[str, str]] = set()
    from_seq = 0
    steps = replay_steps(paths, until_seq=until_seq, until_at=until_at, warn=warn, skip_invalid=skip_invalid)
    for event, state, step in steps:
        if not event_count:
            from_seq = starting_seq(event)
        transitions.extend(step.transitions)
        event_count += 1
        stopped = step.transitions[-1] if isinstance(event, RunStopped) and step.transitions else None
        if isinstance(event, (RunStarted, ConfigReloaded, Checkpoint)) and event.config is not None:
            configured_nodes.update((node.ip, node.name) for node in event.config.nodes)
    return ReplayResult(
        state=state,
        transitions=tuple(transitions),
        event_count=event_count,
        last_at=state.at if event_count else None,
        stopped=stopped,
        configured_nodes=frozenset(configured_nodes),
        from_seq=from_seq,
    )


def _numbering_warning(previous: int, event: Event) -> str:
    seq = event.seq
    if isinstance(event, Checkpoint) and seq > previous:
        missing = f"event {seq} is" if seq == previous + 1 else f"events {previous + 1}-{seq} are"
        return f"{missing} missing from the log; the checkpoint at seq {seq} restores the state"
    if seq == previous + 2:
        return f"event {previous + 1} is missing from the log (seq {seq} follows {previous})"
    if seq > previous:
        return f"events {previous + 1}-{seq - 1} are missing from the log (seq {seq} follows {previous})"
    return f"seq {seq} follows {previous}: the log's segments are out of order or from different gateways"


# --- explain ---------------------------------------------------------------------------------


class Explanation(msgspec.Struct, frozen=True, kw_only=True):
    """Where a request for a model would have gone at one recorded moment, and why."""

    seq: int
    """The last event applied before the moment."""
    now: float
    plan: RoutePlan
    stopped: Transition | None = None
    """The gateway had stopped before the moment (`ReplayResult.stopped`): it routed nothing then."""

    @property
    def refusal(self) -> str:
        """The gateway's 503 text when no node could be picked, else ""."""
        if self.plan.pick_pool:
            return ""
        return NO_REACHABLE_NODE if self.plan.candidates else NO_HEALTHY_NODE


def explain(result: ReplayResult, model: str, now: float | None = None) -> Explanation:
    """Route `model` at `now` (default: the last applied event's time) on the replayed state."""
    now = result.moment(now)
    plan = plan_route(result.state, model, now)
    return Explanation(seq=result.state.seq, now=now, plan=plan, stopped=result.stopped)


# --- audit -----------------------------------------------------------------------------------


def node_ips(result: ReplayResult, node: str) -> set[str]:
    """The IPs of the nodes the log knows as `node`: an IP, or a name a config gave it."""
    return {ip for ip, name in result.configured_nodes if node in (ip, name)}


def audit(
    transitions: Iterable[Transition],
    *,
    nodes: Iterable[str] | None = None,
    since: float | None = None,
    until: float | None = None,
    kinds: Iterable[str] | None = None,
) -> list[Transition]:
    """The transitions about one of `nodes` (IPs), of one of `kinds`, within [since, until]
    (None: no filter)."""
    wanted_nodes = set(nodes) if nodes is not None else None
    wanted_kinds = set(kinds) if kinds is not None else None
    return [
        transition
        for transition in transitions
        if (wanted_nodes is None or transition.node in wanted_nodes)
        and (since is None or transition.at >= since)
        and (until is None or transition.at <= until)
        and (wanted_kinds is None or transition.kind in wanted_kinds)
    ]

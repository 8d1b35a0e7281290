"""Replay, explain and audit a recorded event log: the reason the control plane is event-sourced.

A log is self-contained (each run starts with its config), so folding `reduce` over its events
gives back every state the live gateway had and every transition line it printed. `explain` asks
routing (`plan_route`, the function the data plane uses) about one recorded moment; `audit`
filters the transitions. The `interlock` CLI is a thin layer over this module.
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec

from controlplane.logs import format_timestamp
from controlplane.reducer import INITIAL_STATE, reduce
from controlplane.routing import NO_HEALTHY_NODE, NO_REACHABLE_NODE, RoutePlan, plan_route
from controlplane.transitions import TRANSITION_KINDS, Transition
from events.log import read_events
from events.state import ClusterState, NodeState


class ReplayResult(msgspec.Struct, frozen=True, kw_only=True):
    state: ClusterState
    """The state after the last applied event."""
    transitions: tuple[Transition, ...]
    """Every transition of the applied events, in order: the live run's transition log."""
    event_count: int
    last_at: float | None
    """`at` of the last applied event; None when no event was applied."""

    def moment(self, at: float | None = None) -> float:
        """The time to judge the state at: `at` if given, else the last applied event's time."""
        if at is not None:
            return at
        return self.last_at if self.last_at is not None else 0.0


def replay(
    paths: Iterable[str | os.PathLike],
    *,
    until_seq: int | None = None,
    until_at: float | None = None,
    warn: Callable[[str], None] | None = None,
) -> ReplayResult:
    """Apply the events of the given segments (or logs) in order, as the live reducer did.

    Stops before the first event numbered above `until_seq` or observed after `until_at`. A
    torn last line, and a gap or a step back in the numbering (events the live run could not
    write: the state from there on may differ from the live one), are reported through `warn`;
    other bad lines raise EventLogError.
    """
    state = INITIAL_STATE
    transitions: list[Transition] = []
    event_count = 0
    last_at = None
    for event in read_events(paths, warn):
        if (until_seq is not None and event.seq > until_seq) or (until_at is not None and event.at > until_at):
            break
        if warn is not None and state.seq and event.seq != state.seq + 1:
            warn(_numbering_warning(state.seq, event.seq))
        state, step = reduce(state, event)
        transitions.extend(step.transitions)
        event_count += 1
        last_at = event.at
    return ReplayResult(state=state, transitions=tuple(transitions), event_count=event_count, last_at=last_at)


def _numbering_warning(previous: int, seq: int) -> str:
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

    @property
    def refusal(self) -> str:
        """The gateway's 503 text when no node could be picked, else ""."""
        if self.plan.pick_pool:
            return ""
        return NO_REACHABLE_NODE if self.plan.candidates else NO_HEALTHY_NODE


def explain(result: ReplayResult, model: str, now: float | None = None) -> Explanation:
    """Route `model` at `now` (default: the last applied event's time) on the replayed state."""
    now = result.moment(now)
    return Explanation(seq=result.state.seq, now=now, plan=plan_route(result.state, model, now))


# --- audit -----------------------------------------------------------------------------------


def audit(
    transitions: Iterable[Transition],
    *,
    node: str | None = None,
    since: float | None = None,
    until: float | None = None,
    kinds: Iterable[str] | None = None,
) -> list[Transition]:
    """The transitions about `node`, of one of `kinds`, within [since, until] (None: no filter)."""
    wanted_kinds = set(kinds) if kinds is not None else None
    return [
        transition
        for transition in transitions
        if (node is None or transition.node == node)
        and (since is None or transition.at >= since)
        and (until is None or transition.at <= until)
        and (wanted_kinds is None or transition.kind in wanted_kinds)
    ]


def parse_kinds(text: str) -> list[str]:
    """`health,models` → ["health", "models"]; raises ValueError naming an unknown kind."""
    kinds = [kind.strip() for kind in text.split(",") if kind.strip()]
    for kind in kinds:
        if kind not in TRANSITION_KINDS:
            raise ValueError(f"unknown kind {kind!r} (kinds: {', '.join(TRANSITION_KINDS)})")
    if not kinds:
        raise ValueError(f"no kind given (kinds: {', '.join(TRANSITION_KINDS)})")
    return kinds


# --- time arguments --------------------------------------------------------------------------

_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(\.\d+)?(?:([Zz])|([+-])(\d{2}):(\d{2}))"
)
_UNIX_SECONDS = re.compile(r"\d+(\.\d+)?")


def parse_time(text: str) -> float:
    """RFC 3339 (`2026-01-02T03:04:05Z`, `…05.25+02:00`) or UNIX seconds → UNIX seconds.

    Raises ValueError with a message saying what is accepted.
    """
    text = text.strip()
    if _UNIX_SECONDS.fullmatch(text):
        return float(text)
    match = _RFC3339.fullmatch(text)
    if match is not None:
        year, month, day, hour, minute, second = (int(part) for part in match.group(1, 2, 3, 4, 5, 6))
        offset = datetime.timedelta()
        if not match.group(8):
            offset = datetime.timedelta(hours=int(match.group(10)), minutes=int(match.group(11)))
            if match.group(9) == "-":
                offset = -offset
        try:
            moment = datetime.datetime(year, month, day, hour, minute, second, tzinfo=datetime.timezone(offset))
        except ValueError as err:
            raise ValueError(f"invalid time {text!r}: {err}") from None
        return moment.timestamp() + float(match.group(7) or 0)
    raise ValueError(f"invalid time {text!r}: expected RFC 3339 (2026-01-02T03:04:05Z) or UNIX seconds")


# --- rendering -------------------------------------------------------------------------------


def format_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """Columns aligned with two spaces between them, no trailing spaces."""
    table = [list(headers)] + [list(row) for row in rows]
    widths = [max(len(row[column]) for row in table) for column in range(len(headers))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in table]


def format_ring(ring: str) -> str:
    return ring or "standalone"


def format_age(seconds: float) -> str:
    """`4.5s`, `2m05s`, `1h02m`."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def _offline_text(node: NodeState, now: float) -> str:
    if not node.is_offline(now):
        return "-"
    return f"until {format_timestamp(node.offline_until)} ({format_age(node.offline_until - now)} left)"


def render_state(result: ReplayResult, now: float) -> str:
    """The state as a table for a terminal, with a heading naming the moment."""
    state = result.state
    if result.event_count == 0:
        return "no events in the log before this moment"
    heading = f"state after seq {state.seq} ({format_timestamp(state.at)}), {result.event_count} events"
    if now != state.at:
        heading += f", seen at {format_timestamp(now)}"
    if state.config is None:
        return heading + "\nno run_started event yet: no nodes"
    run = f"run: interlock {state.version or '?'}, config {state.config_path or '?'}"
    rows = []
    for node in state.nodes.values():
        models = node.models
        rows.append(
            [
                node.ip,
                node.name or "-",
                format_ring(node.ring),
                node.status,
                str(node.consecutive_failures),
                "never" if node.last_check is None else format_age(now - node.last_check) + " ago",
                models.state,
                ",".join(models.names) if models.names else "-",
                _offline_text(node, now),
            ]
        )
    headers = ["NODE", "NAME", "RING", "STATUS", "FAILURES", "CHECKED", "MODELS", "NAMES", "OFFLINE"]
    return "\n".join([heading, run, ""] + format_table(headers, rows))


def state_to_builtins(result: ReplayResult, now: float) -> dict[str, Any]:
    """The state as plain data, for `--json`."""
    state = result.state
    return {
        "seq": state.seq,
        "at": state.at,
        "now": now,
        "event_count": result.event_count,
        "version": state.version,
        "config_path": state.config_path,
        "config": msgspec.to_builtins(state.config) if state.config is not None else None,
        "nodes": [
            {**msgspec.to_builtins(node), "offline": node.is_offline(now)} for node in state.nodes.values()
        ],
    }


def render_explanation(explanation: Explanation) -> str:
    """The routing decision for a terminal: the pools, every node's verdict, the outcome."""
    plan = explanation.plan

    def ips(pool: Sequence[str]) -> str:
        return ", ".join(pool) if pool else "none"

    lines = format_table(
        ["moment", f"{format_timestamp(explanation.now)}, after event seq {explanation.seq}"],
        [
            ["model", plan.model],
            ["ring", format_ring(plan.ring)],
            ["ring pool", ips(plan.ring_pool)],
            ["serving", ips(plan.candidates)],
            ["pick pool", ips(plan.pick_pool)],
        ],
    )
    rows = [
        [
            verdict.ip,
            verdict.name or "-",
            format_ring(verdict.ring),
            verdict.status,
            verdict.model_state,
            "kept" if verdict.kept else f"excluded: {verdict.reason}",
        ]
        for verdict in plan.verdicts
    ]
    lines += [""] + format_table(["NODE", "NAME", "RING", "STATUS", "MODELS", "VERDICT"], rows) + [""]
    if explanation.refusal == NO_HEALTHY_NODE:
        lines.append(f'no node in the ring pool serves this model: the gateway answers 503 "{NO_HEALTHY_NODE}"')
    elif explanation.refusal == NO_REACHABLE_NODE:
        lines.append(
            f"every node serving this model is dead or offline: "
            f'the gateway answers 503 "{NO_REACHABLE_NODE}"'
        )
    else:
        lines.append(f"the balancer picks one of: {ips(plan.pick_pool)}")
    return "\n".join(lines)


def explanation_to_builtins(explanation: Explanation) -> dict[str, Any]:
    return {
        "seq": explanation.seq,
        "now": explanation.now,
        **msgspec.to_builtins(explanation.plan),
        "refusal": explanation.refusal,
    }

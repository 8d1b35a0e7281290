"""A recorded run replayed under another config: `whatif --health` and `check-config --against`.

The recorded events are folded twice through the same pure `reduce`: as recorded, and with
their configs changed (`controlplane.effects.replay.with_config`: a reload of the changed config;
for `check-config --against`, only the keys the new config changes, `ConfigChange`, so a run whose
policy was switched by reloads keeps each period's policy unless the change is to the policy). The
probe results and their times stay the recorded ones, so a setting that would change when or
how the nodes are probed cannot be replayed (HEALTH_UNREPLAYABLE). The report gives each node's
health intervals both ways, the ejections (turns to dead) gained and lost, and, with the
decision log, the recorded requests routed again on the changed states (`interlock.whatif`).
"""

from __future__ import annotations

import os
from bisect import bisect_right
from datetime import datetime, timezone
from collections.abc import Callable, Iterable, Iterator

import msgspec

from controlplane.effects.replay import replay_steps, with_config
from controlplane.infrastructure.config import fleet_wide
from events.config import Config
from events.decisions import Decision
from events.state import Health
from events.types import Event
from interlock.render import format_table
from interlock.whatif import CONFIGURED, WhatIfReport, first_pick, render_report, what_if

HEALTH_KEYS = {
    "health_fail_threshold": "consecutive failed probes before a node is dead (degraded from half of them; "
    "its model listing expires after as many failed listings)",
}
"""The `[gateway]` settings the health and discovery rules read, that a what-if can change."""
HEALTH_UNREPLAYABLE = {
    "health_interval": "the probes happened at their recorded times",
    "probe_timeout": "the probes' results are the recorded ones",
}
"""Health settings a replay cannot change, and why."""
NOT_RECORDED_NOTE = "probe times are the recorded ones: a change of health_interval cannot be replayed"
REMOVED = "removed"
"""A node's status once a config no longer has it."""
SHOWN = 20
"""Requests named per list in the report; the rest are counted."""


class HealthOverrideError(ValueError):
    """A `--health` argument that names no replayable setting or gives it a bad value."""


def parse_health_overrides(text: str) -> dict[str, int]:
    """`KEY=VALUE[,KEY=VALUE…]` of HEALTH_KEYS, validated as the config loader would."""
    overrides: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, equals, value = item.partition("=")
        key = key.strip()
        if not equals:
            raise HealthOverrideError(f"{item!r}: expected KEY=VALUE")
        if key in HEALTH_UNREPLAYABLE:
            raise HealthOverrideError(f"{key} cannot be replayed: {HEALTH_UNREPLAYABLE[key]}")
        if key not in HEALTH_KEYS:
            known = ", ".join(HEALTH_KEYS)
            raise HealthOverrideError(f"unknown health setting {key!r}; the health rules read: {known}")
        try:
            number = int(value)
        except ValueError:
            raise HealthOverrideError(f"{key}: {value!r} is not a whole number") from None
        if number < 1:
            raise HealthOverrideError(f"{key}: must be greater than zero, not {number}")
        overrides[key] = number
    if not overrides:
        raise HealthOverrideError("no KEY=VALUE given")
    return overrides


def with_gateway_settings(overrides: dict[str, int]) -> Callable[[Config], Config]:
    def change(config: Config) -> Config:
        return msgspec.structs.replace(config, gateway=msgspec.structs.replace(config.gateway, **overrides))

    return change


class Interval(msgspec.Struct, frozen=True):
    status: str
    since: float
    until: float | None
    """None: it lasted to the end of the log."""


class NodeHealth(msgspec.Struct, kw_only=True):
    node: str
    name: str
    before: list[Interval]
    after: list[Interval]


class Ejection(msgspec.Struct, frozen=True):
    node: str
    at: float
    until: float | None


class Request(msgspec.Struct, frozen=True):
    request_id: str
    recorded: str
    now: str | None
    """The node it is routed to again; None: refused (no routable node)."""


class ReconfiguredReport(msgspec.Struct, kw_only=True):
    change: str
    """What was changed, in words."""
    nodes: list[NodeHealth]
    ejections_gained: list[Ejection]
    ejections_lost: list[Ejection]
    decisions: WhatIfReport | None = None
    refused: int = 0
    refused_shown: list[Request] = []
    met_dead: int = 0
    """Requests routed again to a node the recorded run had as dead at their seq."""
    met_dead_shown: list[Request] = []
    changed_keys: list[str] | None = None
    """`check-config --against`: the keys the new config changes (`ConfigChange`)."""


class _StatusLog:
    """Each node's health changes in one replay, as (seq, at, status)."""

    def __init__(self, steps: Iterator) -> None:
        self.changes: dict[str, list[tuple[int, float, str]]] = {}
        self.names: dict[str, str] = {}
        self.end = 0.0
        current: dict[str, str] = {}
        for event, state, _ in steps:
            self.end = state.at
            ip = getattr(event, "node", None)
            nodes = [state.nodes[ip]] if ip in state.nodes else [] if ip is not None else state.nodes.values()
            for node in nodes:
                self.names[node.ip] = node.name or node.ip
                if current.get(node.ip) != node.status:
                    current[node.ip] = node.status
                    self.changes.setdefault(node.ip, []).append((state.seq, state.at, node.status))
            if ip is None:
                for gone in [known for known in current if known not in state.nodes]:
                    del current[gone]
                    self.changes[gone].append((state.seq, state.at, REMOVED))

    def intervals(self, ip: str) -> list[Interval]:
        changes = self.changes.get(ip, [])
        ends = [at for _, at, _ in changes[1:]] + [None]
        return [Interval(status, at, end) for (_, at, status), end in zip(changes, ends) if status != REMOVED]

    def status_at(self, ip: str, seq: int) -> str | None:
        changes = self.changes.get(ip, [])
        index = bisect_right(changes, seq, key=lambda change: change[0])
        return changes[index - 1][2] if index else None


def _ejections(log: _StatusLog, ip: str) -> list[Ejection]:
    return [Ejection(ip, i.since, i.until) for i in log.intervals(ip) if i.status == Health.DEAD]


def _overlap(first: Ejection, second: Ejection) -> bool:
    return first.at < (second.until if second.until is not None else float("inf")) and second.at < (
        first.until if first.until is not None else float("inf")
    )


def reconfigured(
    event_logs: list[str | os.PathLike],
    rewrite: Callable[[Iterator[Event]], Iterator[Event]],
    change: str,
    decisions: Iterable[Decision] | None = None,
    *,
    since: float | None = None,
    until: float | None = None,
    warn: Callable[[str], None] | None = None,
    skip_invalid: Callable[[str], None] | None = None,
) -> ReconfiguredReport:
    """The run of `event_logs` as recorded and with its events rewritten by `rewrite`, compared
    (module docstring); `decisions` are routed again under the policy the config in force names.
    The log's problems go to `warn` and `skip_invalid` once, as the first pass meets them."""
    recorded = _StatusLog(replay_steps(event_logs, warn=warn, skip_invalid=skip_invalid))
    skip_again = _ignore if skip_invalid is not None else None
    changed = _StatusLog(replay_steps(event_logs, skip_invalid=skip_again, rewrite=rewrite))
    report = ReconfiguredReport(change=change, nodes=[], ejections_gained=[], ejections_lost=[])
    for ip in sorted(recorded.changes.keys() | changed.changes.keys()):
        name = recorded.names.get(ip) or changed.names.get(ip, ip)
        report.nodes.append(NodeHealth(node=ip, name=name, before=recorded.intervals(ip), after=changed.intervals(ip)))
        before, after = _ejections(recorded, ip), _ejections(changed, ip)
        report.ejections_lost += [e for e in before if not any(_overlap(e, other) for other in after)]
        report.ejections_gained += [e for e in after if not any(_overlap(e, other) for other in before)]
    if decisions is None:
        return report

    def judge(decision: Decision, node: str | None) -> None:
        request = Request(decision.request_id, first_pick(decision) or "", node)
        if node is None:
            report.refused += 1
            if len(report.refused_shown) < SHOWN:
                report.refused_shown.append(request)
        elif recorded.status_at(node, decision.seq) == Health.DEAD:
            report.met_dead += 1
            if len(report.met_dead_shown) < SHOWN:
                report.met_dead_shown.append(request)

    report.decisions = what_if(
        event_logs, decisions, policy=CONFIGURED, since=since, until=until, skip_invalid=skip_again,
        rewrite=rewrite, each=judge,
    )  # fmt: skip
    return report


def _ignore(message: str) -> None:
    """Takes a problem of the log already reported."""


def health_what_if(
    event_logs: list[str | os.PathLike], overrides: dict[str, int], decisions: Iterable[Decision] | None, **options
) -> ReconfiguredReport:
    """The run with the health settings `overrides` in force from its start."""
    change = ", ".join(f"{key}={value}" for key, value in overrides.items())
    rewrite = _rewriter(with_gateway_settings(overrides), None)
    return reconfigured(event_logs, rewrite, f"health rules {change}", decisions, **options)


def config_dry_run(
    event_logs: list[str | os.PathLike],
    config: Config,
    path: str,
    decisions: Iterable[Decision] | None,
    since: float | None = None,
    **options,
) -> ReconfiguredReport:
    """The run with `config` reloaded at `since` (None: from its start) as a change
    (`ConfigChange`): the keys in which it differs from the config then in force, in force
    from then on; every other key (the policy among them) stays as each period recorded it."""
    change = ConfigChange(config)
    report = reconfigured(event_logs, _rewriter(change, since), f"config {path}", decisions, since=since, **options)
    report.changed_keys = change.keys or []
    return report


class ConfigChange:
    """A new config as a change of the recorded ones: its keys (each table's, `[[nodes]]` and
    `[[tenants]]` as wholes) that differ from the first config it is applied to (the one in
    force at the reload), put into every config it is applied to. A fleet's recorded config
    (it has a `[fleet]` table) is changed by the new config's fleet-wide part at the version
    in force, as the fleet's leader would apply the file (a replica's own keys are never the
    fleet's: `controlplane.infrastructure.config.fleet_wide`)."""

    def __init__(self, new: Config) -> None:
        self.new = new
        self.keys: list[str] | None = None
        """`table.key` (or `table`) of each key changed; None before the first config."""

    def __call__(self, recorded: Config) -> Config:
        new = self.new if recorded.fleet is None else fleet_wide(self.new, recorded.fleet.config_version)
        if self.keys is None:
            self.keys = changed_keys(recorded, new)
        changes: dict[str, object] = {}
        for key in self.keys:
            table, _, name = key.partition(".")
            if not name:
                changes[table] = getattr(new, table)
                continue
            current = changes.get(table, getattr(recorded, table))
            changes[table] = msgspec.structs.replace(current, **{name: getattr(getattr(new, table), name)})
        return msgspec.structs.replace(recorded, **changes)


def changed_keys(old: Config, new: Config) -> list[str]:
    """The keys in which `new` differs from `old`: `table.key` within a table both have,
    else the table."""
    keys = []
    for table in Config.__struct_fields__:
        before, after = getattr(old, table), getattr(new, table)
        if before == after:
            continue
        if isinstance(before, msgspec.Struct) and type(before) is type(after):
            keys += [
                f"{table}.{name}" for name in before.__struct_fields__ if getattr(before, name) != getattr(after, name)
            ]
        else:
            keys.append(table)
    return keys


def _rewriter(
    change: Callable[[Config], Config], since: float | None
) -> Callable[[Iterator[Event]], Iterator[Event]]:
    return lambda events: with_config(events, change, since)


# --- text ------------------------------------------------------------------------------------


def render_reconfigured(report: ReconfiguredReport) -> str:
    lines = [f"the recorded run replayed under {report.change} ({NOT_RECORDED_NOTE}; times UTC)"]
    if report.changed_keys is not None:
        changed = ", ".join(report.changed_keys) or "none"
        lines.append(f"keys changed: {changed} (the rest, the policy among them unless changed, as recorded)")
    lines.append("")
    rows = [
        [node.name, node.node, _intervals(node.before), _intervals(node.after)]
        for node in report.nodes
        if node.before != node.after
    ]
    unchanged = len(report.nodes) - len(rows)
    if rows:
        lines += format_table(["NODE", "IP", "RECORDED", "REPLAYED"], rows)
    lines.append(f"{unchanged} node{'' if unchanged == 1 else 's'} with the same health intervals")
    lines.append(
        f"ejections gained {len(report.ejections_gained)}, lost {len(report.ejections_lost)}"
    )
    for word, ejections in (("gained", report.ejections_gained), ("lost", report.ejections_lost)):
        lines += [f"  {word}: {e.node} dead {_span(e.at, e.until)}" for e in ejections]
    if report.decisions is not None:
        lines += [
            "",
            f"{report.refused} recorded requests would have been refused (no routable node), "
            f"{report.met_dead} would have gone to a node the recorded run had as dead",
        ]
        for word, requests in (("refused", report.refused_shown), ("met a dead node", report.met_dead_shown)):
            lines += [f"  {word}: {r.request_id} (recorded on {r.recorded}, now {r.now or '-'})" for r in requests]
        lines += ["", render_report(report.decisions)]
    return "\n".join(lines)


def _intervals(intervals: list[Interval]) -> str:
    return ", ".join(f"{i.status} {_span(i.since, i.until)}" for i in intervals) or "-"


def _span(since: float, until: float | None) -> str:
    return f"{_clock(since)}–{'end' if until is None else _clock(until)}"


def _clock(at: float) -> str:
    """`at` as a UTC time of day to the millisecond (the day is the log's)."""
    return datetime.fromtimestamp(at, timezone.utc).strftime("%H:%M:%S.%f")[:-3]

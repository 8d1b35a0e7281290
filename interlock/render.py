"""Terminal rendering and argument parsing for `interlock replay`, `explain` and `audit`.

The results come from `controlplane.effects.replay`; this module turns them into aligned tables or
plain data for `--json`, and parses the time and kind arguments.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from controlplane.rules.log_lines import format_timestamp
from controlplane.effects.replay import Explanation, ReplayResult
from controlplane.rules.routing import NO_HEALTHY_NODE, NO_REACHABLE_NODE
from controlplane.rules.transitions import Transition, TransitionKind
from events.state import NodeLoad, NodeState

# --- arguments -------------------------------------------------------------------------------

KINDS = ", ".join(TransitionKind)
"""The transition kinds `interlock audit --kind` takes, as its help and errors list them."""


def parse_kinds(text: str) -> list[str]:
    """`health,models` → ["health", "models"]; raises ValueError naming an unknown kind."""
    kinds = [kind.strip() for kind in text.split(",") if kind.strip()]
    for kind in kinds:
        if kind not in {kind.value for kind in TransitionKind}:
            raise ValueError(f"unknown kind {kind!r} (kinds: {KINDS})")
    if not kinds:
        raise ValueError(f"no kind given (kinds: {KINDS})")
    return kinds


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


LAST_MICROSECOND = 0.999999
"""From the start of a second to its last microsecond (event times are recorded to the millisecond)."""


def parse_time_through(text: str) -> float:
    """`parse_time` for the end of a span (`--until`, `--at`): a time given to the whole second
    (as log lines print it) stands for the last microsecond of that second, so the events
    logged within it are included."""
    moment = parse_time(text)
    return moment if "." in text else moment + LAST_MICROSECOND



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


def _load_text(load: NodeLoad) -> str:
    """Requests running+waiting at the last scrape (`3+2`), `unknown` after a failed one, `-`
    if never scraped."""
    if load.known:
        return f"{load.running:g}+{load.waiting:g}"
    return "unknown" if load.fails else "-"


def render_state(result: ReplayResult, now: float) -> str:
    """The state as a table for a terminal, with a heading naming the moment."""
    state = result.state
    if result.event_count == 0:
        return "no events in the log before this moment"
    heading = f"state after seq {state.seq} ({format_timestamp(state.at)}), {result.event_count} events"
    if result.from_seq:
        heading += f" replayed from seq {result.from_seq}"
    if now != state.at:
        heading += f", seen at {format_timestamp(now)}"
    if state.config is None:
        return heading + "\nno run_started event yet: no nodes"
    run = f"run: interlock {state.version or '?'}, config {state.config_path or '?'}"
    if result.stopped is not None:
        run += "\n" + _stopped_text(result.stopped) + "; the nodes as it last saw them:"
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
                _load_text(node.load),
                _offline_text(node, now),
            ]
        )
    headers = ["NODE", "NAME", "RING", "STATUS", "FAILURES", "CHECKED", "MODELS", "NAMES", "LOAD", "OFFLINE"]
    return "\n".join([heading, run, ""] + format_table(headers, rows))


def state_to_builtins(result: ReplayResult, now: float) -> dict[str, Any]:
    """The state as plain data, for `--json`."""
    state = result.state
    return {
        "seq": state.seq,
        "at": state.at,
        "now": now,
        "event_count": result.event_count,
        "from_seq": result.from_seq,
        "version": state.version,
        "config_path": state.config_path,
        "stopped": _stopped_to_builtins(result.stopped),
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
    if explanation.stopped is not None:
        lines.append(_stopped_text(explanation.stopped) + ": it routed nothing. Had it been running:")
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
        "stopped": _stopped_to_builtins(explanation.stopped),
    }


def _stopped_text(stopped: Transition) -> str:
    stop = f"it stopped at {format_timestamp(stopped.at)}, seq {stopped.seq}"
    return f"the gateway was not running at this moment ({stop})"


def _stopped_to_builtins(stopped: Transition | None) -> dict[str, Any] | None:
    """When the gateway had stopped, for `--json`: the time and seq of its `gateway stopped`."""
    return None if stopped is None else {"at": stopped.at, "seq": stopped.seq}

"""`interlock verify`: every recorded decision made again with this checkout's code, and compared.

Each decision record names the snapshot it was routed on (its seq); the event log is folded once,
in order (`whatif.States`), and each record is routed again on the state at its seq, through the
functions the data plane routes with: `routing.Route` (ring, ring pool, the model filter's
exclusions), `routing.pick_pool` at the request's arrival (dead and offline candidates passed
over, healthy before degraded), then the first pick under the record's policy with the record's
own inputs (`whatif.recorded_choice`: the round-robin counter, its process's in-flight counts,
request id, prompt prefix, remembered node). What a routing process keeps for itself (counter,
in-flight counts, prefix memory) is in each record, so records of several workers and replicas,
over several files, are verified alike; the report counts them per (replica, worker).

A record is compared field by field: ring, ring pool, exclusions and their reasons, whether a
node was picked at all, then the candidates (order, scores, notes, the load figures read from the
state), the margin, the remembered node and the pick. A record that lacks a policy input (written
before the field existed) has its routing compared and its pick counted as unverified, never
compared as if complete. Only first picks are made again: a retry's pick is not in the record. A
disaggregated request has two, its prefill leg's (`Decision.prefill_pick`; its differences are
named `prefill.…`) and its decode leg's, each made again from its leg's candidates.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterable

import msgspec

from controlplane.rules.balancer import Balancer
from controlplane.effects.replay import replay_steps
from controlplane.rules.routing import PREFILL, Route, pick_pool
from events.decisions import CandidateScore, Decision, Exclusion, missing_inputs
from events.state import ClusterState, NodeState
from interlock.render import format_table
from interlock.whatif import Leg, States, first_pick, in_span, legs_of, process_of, recorded_choice

DEFAULT_SHOWN = 20
"""Divergences (and records not verified) named in the report; the rest are counted."""


class Divergence(msgspec.Struct, frozen=True):
    request_id: str
    process: str
    """The routing process, `replica/worker`."""
    field: str
    recorded: str
    derived: str


class VerifyReport(msgspec.Struct, kw_only=True):
    decisions: int
    """Records in the span considered."""
    verified: int
    """Records compared in full (routing and pick)."""
    divergent: int
    """Records with at least one difference."""
    differences: int
    divergences: list[Divergence]
    """The first `shown` differences, in the order records were made again."""
    incomplete: int
    """Records lacking a policy input: routing compared, pick not."""
    missing: dict[str, int]
    """Records lacking each input."""
    incomplete_ids: list[str]
    beyond_log: int
    """Records whose seq the event log does not reach: not verified at all."""
    beyond_log_ids: list[str]
    processes: dict[str, int]
    """Records per routing process (`replica/worker`)."""

    @property
    def passed(self) -> bool:
        return not self.divergent and not self.beyond_log


def verify(
    event_logs: Iterable[str | os.PathLike],
    decisions: Iterable[tuple[Decision, tuple[str, ...]]],
    *,
    since: float | None = None,
    until: float | None = None,
    shown: int = DEFAULT_SHOWN,
    warn: Callable[[str], None] | None = None,
    skip_invalid: Callable[[str], None] | None = None,
) -> VerifyReport:
    """Make every record (with the policy inputs its line lacks: `read_decisions_with_gaps`)
    arriving in [since, until] again on the states of `event_logs`, and compare."""
    absent_by_record: dict[int, tuple[str, ...]] = {}
    """The inputs each record lacks, by the record's id() (`records` keeps every record alive)."""
    records = []
    for decision, absent in decisions:
        if absent:
            absent_by_record[id(decision)] = absent
        records.append(decision)
    chosen = in_span(records, since, until)
    states = States(replay_steps(event_logs, warn=warn, skip_invalid=skip_invalid))
    report = VerifyReport(
        decisions=len(chosen), verified=0, divergent=0, differences=0, divergences=[], incomplete=0, missing={},
        incomplete_ids=[], beyond_log=0, beyond_log_ids=[], processes={},
    )  # fmt: skip
    lacking_inputs = MissingInputs(shown)
    processes: Counter[str] = Counter()
    picker = Balancer()  # given each record's inputs, it keeps nothing between records
    for decision in chosen:
        process = "{}/{}".format(*process_of(decision))
        processes[process] += 1
        state = states.at(decision.seq)
        if state is None:
            report.beyond_log += 1
            _name(report.beyond_log_ids, decision.request_id, shown)
            continue
        lacking = missing_inputs(decision, absent_by_record.get(id(decision), ()))
        differences = _compare(decision, state, picker, lacking=lacking)
        if lacking:
            lacking_inputs.add(decision, lacking)
        else:
            report.verified += 1
        if differences:
            report.divergent += 1
            report.differences += len(differences)
            for field, recorded, derived in differences:
                if len(report.divergences) < shown:
                    report.divergences.append(Divergence(decision.request_id, process, field, recorded, derived))
    report.incomplete, report.missing, report.incomplete_ids = (
        lacking_inputs.records, lacking_inputs.by_input(), lacking_inputs.ids
    )
    report.processes = dict(sorted(processes.items()))
    return report


class MissingInputs:
    """Decision records that lack policy inputs (their picks cannot be made again as recorded),
    tallied: for `verify`'s report, and the warning of every command reading decision logs."""

    __slots__ = ("records", "inputs", "ids", "_shown")

    def __init__(self, shown: int = DEFAULT_SHOWN) -> None:
        self.records = 0
        self.inputs: Counter[str] = Counter()
        """Records lacking each input."""
        self.ids: list[str] = []
        """The first `shown` records' request ids."""
        self._shown = shown

    def add(self, decision: Decision, lacking: Iterable[str]) -> None:
        self.records += 1
        self.inputs.update(lacking)
        _name(self.ids, decision.request_id, self._shown)

    def by_input(self) -> dict[str, int]:
        return dict(sorted(self.inputs.items()))

    def warning(self, total: int) -> str:
        """The warning, `total` being the records read."""
        return incomplete_warning(self.records, total, self.by_input(), self.ids)


def _name(names: list[str], request_id: str, shown: int) -> None:
    if len(names) < shown:
        names.append(request_id)


Difference = tuple[str, str, str]
"""(field, recorded, derived)"""


def _compare(
    decision: Decision, state: ClusterState, picker: Balancer, *, lacking: tuple[str, ...]
) -> list[Difference]:
    """The differences between `decision` and its routing made again on `state`: the route,
    then each leg's pick (`whatif.legs_of`), a leg's only when the record holds every input it
    needs (`lacking` names those it lacks)."""
    differences: list[Difference] = []

    def differ(field: str, recorded: object, derived: object) -> None:
        if recorded != derived:
            differences.append((field, _text(recorded), _text(derived)))

    route = Route(state, decision.model)
    differ("ring", decision.ring, route.ring)
    differ("ring_pool", decision.ring_pool, route.ring_pool)
    passed: list[Exclusion] = []

    def passed_over(ip: str, reason: str) -> None:
        if not any(exclusion.node == ip for exclusion in passed):  # once each, as the data plane's ledger
            passed.append(Exclusion(ip, reason))

    legs = [(leg, pick_pool(leg.candidates, decision.at, passed_over=passed_over)) for leg in legs_of(decision, route)]
    differ("excluded", decision.excluded, route.excluded + tuple(passed))
    for leg, pool in legs:
        _compare_pick(leg, pool, state, picker, _leg_differ(leg.name, differ), complete=not lacking)
        if not pool:
            break  # a leg without a node ends the request
    return differences


def _leg_differ(leg: str, differ: Callable[[str, object, object], None]) -> Callable[[str, object, object], None]:
    """`differ` with the prefill leg's fields named so (`prefill.pick`); the decode leg's are the record's own."""
    if leg != PREFILL:
        return differ
    return lambda field, recorded, derived: differ(f"{PREFILL}.{field}", recorded, derived)


def _compare_pick(
    leg: Leg,
    pool: list[NodeState],
    state: ClusterState,
    picker: Balancer,
    differ: Callable[[str, object, object], None],
    *,
    complete: bool,
) -> None:
    """One leg's first pick (a whole request's, or the record as one leg's) made again from `pool`."""
    decision = leg.decision
    recorded = first_pick(decision)
    if not pool or recorded is None:  # a 503 for want of a node, recorded or derived
        differ("pick", recorded, "one of " + _text(tuple(node.ip for node in pool)) if pool else None)
        return
    if not complete:
        return
    choice = recorded_choice(picker, decision, pool, state, adapter=leg.adapter)
    _compare_candidates(decision.candidates, choice.candidates, differ)
    differ("margin", decision.margin, choice.margin)
    differ("remembered", decision.remembered, choice.remembered)
    differ("pick", recorded, choice.node.ip)


def _compare_candidates(
    recorded: tuple[CandidateScore, ...],
    derived: tuple[CandidateScore, ...],
    differ: Callable[[str, object, object], None],
) -> None:
    nodes = tuple(candidate.node for candidate in recorded)
    derived_nodes = tuple(candidate.node for candidate in derived)
    if nodes != derived_nodes:
        differ("candidates", nodes, derived_nodes)
        return
    for index, (mine, theirs) in enumerate(zip(recorded, derived)):
        if mine != theirs:
            for field in CandidateScore.__struct_fields__:
                differ(f"candidates[{index}].{field}", getattr(mine, field), getattr(theirs, field))


def _text(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return "[" + ", ".join(_text(item) for item in value) + "]"
    if isinstance(value, Exclusion):
        return f"{value.node} {value.reason}"
    return str(value)


# --- text ------------------------------------------------------------------------------------


def render_report(report: VerifyReport) -> str:
    lines = [
        f"{report.decisions} decision records from {len(report.processes)} routing process"
        f"{'es' if len(report.processes) != 1 else ''} ({_processes(report.processes)}): "
        f"{report.verified} verified in full, {report.incomplete} lacking policy inputs, "
        f"{report.beyond_log} beyond the event log",
    ]
    if report.beyond_log:
        lines.append(
            f"{report.beyond_log} records not verified: the event log does not hold their snapshot: "
            + _names(report.beyond_log_ids, report.beyond_log)
        )
    if not report.divergent:
        made_again = report.decisions - report.beyond_log
        lines.append(f"every decision made again matches ({made_again} of {report.decisions})")
        return "\n".join(lines)
    lines += [
        f"{report.divergent} records diverge ({report.differences} differences); the first {len(report.divergences)}:",
        "",
    ]
    rows = [[d.request_id, d.process, d.field, d.recorded, d.derived] for d in report.divergences]
    lines += format_table(["REQUEST ID", "REPLICA/WORKER", "FIELD", "RECORDED", "DERIVED"], rows)
    return "\n".join(lines)


def incomplete_warning(count: int, total: int, missing: dict[str, int], ids: list[str]) -> str:
    """The warning of `verify` and `whatif` for records lacking policy inputs."""
    fields = ", ".join(f"{name} ({records})" for name, records in missing.items())
    return (
        f"{count} of {total} decision records lack policy inputs, their picks cannot be made again as "
        f"recorded: missing {fields}: " + _names(ids, count)
    )


def _names(names: list[str], total: int) -> str:
    return ", ".join(names) + (f" and {total - len(names)} more" if total > len(names) else "")


def _processes(processes: dict[str, int]) -> str:
    return ", ".join(f"{name or '/'} {count}" for name, count in processes.items())

"""`interlock verify`: every recorded decision made again with this checkout's code, and compared.

Each decision record names the snapshot it was routed on (its seq); the event log is folded once,
in order (`whatif.States`), as the records are read (`verify` says how they are put in the order
of their seqs), and each record is routed again on the state at its seq, through the
functions the data plane routes with: `routing.Route` (ring, ring pool, the model filter's
exclusions), `routing.pick_pool` at the request's arrival (dead and offline candidates passed
over, healthy before degraded), then the first pick under the record's policy with the record's
own inputs (`whatif.recorded_choice`: the round-robin counter, its process's in-flight counts,
request id, prompt prefix, remembered node, and under `kv_aware` the prompt's blocks each
candidate held). A match is an input as load is: the scores are made again from it, so a
match changed in the record is named where it changes a score; the index's seq it names is
shown by `explain`, not checked (the nodes' KV events are not in the event log). What a routing process keeps for itself (counter,
in-flight counts, prefix memory) is in each record, so records of several workers and replicas,
over several files, are verified alike; the report counts them per (replica, worker).

A record is compared field by field: ring, ring pool, exclusions and their reasons, whether a
node was picked at all, then the candidates (order, scores, notes, the load figures read from the
state), the margin, the remembered node and the pick. A record that lacks a policy input (written
before the field existed) has its routing compared and its pick counted as unverified, never
compared as if complete. Only first picks are made again: a retry's scores are not in the record
(where it went is checked against the pool it was made from). A disaggregated request has two,
its prefill leg's (`Decision.prefill_pick`; its differences are named `prefill.…`) and its
decode leg's, each made again from its leg's candidates.

Then the rest of the record (`interlock.verify_record`): each leg's attempts (the first went to
the pick, each later one to a node the record's own rules allowed, and only after a retried
one), the status, the admission verdict, tenant and priority, and the times. And, in the order
the log holds them, each routing process's record numbers: a record missing, repeated or out of
order is named (`RecordNumbers`).

A record is verified when every field was checked; one lacking a policy input, or beyond the
event log, is not (the report says why); it passes only when every record was verified and none
differs, and no record is missing or repeated.
"""

from __future__ import annotations

import heapq
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator

import msgspec

from controlplane.effects.replay import replay_steps
from controlplane.rules.balancer import Balancer
from controlplane.rules.routing import DECODE, PREFILL, Route, pick_pool
from events.decisions import CandidateScore, Decision, Exclusion, missing_inputs
from events.state import ClusterState, NodeState
from interlock.render import format_table
from interlock.verify_record import (
    Differ,
    Numbering,
    RecordNumbers,
    compare_admission,
    compare_attempts,
    compare_status,
    compare_times,
    text,
)
from interlock.whatif import Leg, States, first_pick, legs_of, recorded_choice

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
    """Records every field of which was checked (routing, picks, attempts, status, admission, times)."""
    divergent: int
    """Records with at least one difference (verified or not)."""
    differences: int
    divergences: list[Divergence]
    """The first `shown` differences, in the order records were made again."""
    incomplete: int
    """Records lacking a policy input: not verified (their picks are not made again; the rest is checked)."""
    missing: dict[str, int]
    """Records lacking each input."""
    incomplete_ids: list[str]
    beyond_log: int
    """Records whose seq the event log does not reach: not verified at all."""
    beyond_log_ids: list[str]
    processes: dict[str, int]
    """Records per routing process (`replica/worker`)."""
    numbering: Numbering
    """Records missing, repeated or out of order, by their numbers (`Decision.number`)."""
    routed_elsewhere: dict[str, int] = {}
    """Records routed on other events than the log's, by partition ("" the fleet's): those of a
    replica's partition are verified against its event log with `--partition`, the others
    without. Only their numbers are followed here."""
    allow_unverified: bool = False
    """Records not verified do not fail the run (`--allow-unverified`)."""

    @property
    def not_verified(self) -> int:
        return self.incomplete + self.beyond_log

    @property
    def passed(self) -> bool:
        numbering = self.numbering
        return (
            not self.divergent
            and not numbering.missing
            and not numbering.repeated
            and (self.allow_unverified or not self.not_verified)
        )


REORDER_RECORDS = 16_384
"""Records held back to be made again in the order of their seq: a log holds them in the order
the requests ended, a little out of the order they were routed in. A record whose seq the fold
of the event log has passed when it comes out is made again in a second fold, with the others
so late (`verify`)."""


def verify(
    event_logs: Iterable[str | os.PathLike],
    decisions: Iterable[tuple[Decision, tuple[str, ...]]],
    *,
    since: float | None = None,
    until: float | None = None,
    shown: int = DEFAULT_SHOWN,
    warn: Callable[[str], None] | None = None,
    skip_invalid: Callable[[str], None] | None = None,
    allow_unverified: bool = False,
    window: int = REORDER_RECORDS,
    partition: str = "",
) -> VerifyReport:
    """Make every record (with the policy inputs its line lacks: `read_decisions_with_gaps`)
    arriving in [since, until] again on the states of `event_logs`, and compare; the numbers
    of every record read (in the span or not) are followed in the order read.

    The records are read as the event log is folded, in one pass, through a `window` of records
    that lets them out by seq, then arrival; those the fold has passed are made again in a
    second fold. So memory holds the window and the routing processes' numbering,
    not the log (and the records that came too late for the window, normally none).

    `event_logs` are the events of `partition` (a fleet replica's, `fleet.partition`; "" for
    the fleet's or a gateway's own): records routed elsewhere are numbered, not made again."""
    numbers = RecordNumbers(shown)
    elsewhere: Counter[str] = Counter()
    checker = _Checker(shown, allow_unverified)
    states = States(replay_steps(event_logs, warn=warn, skip_invalid=skip_invalid))
    late: list[tuple[Decision, tuple[str, ...], str]] = []
    for record in _by_seq(_routed_in(partition, decisions, numbers, elsewhere), numbers, since, until, window):
        if record[0].seq < states.state.seq:
            late.append(record)
        else:
            checker.check(*record, states)
    if late:
        late.sort(key=lambda record: (record[0].seq, record[0].at))
        states = States(replay_steps(event_logs, skip_invalid=_told if skip_invalid is not None else None))
        for record in late:
            checker.check(*record, states)
    report = checker.report(numbers.finish())
    report.routed_elsewhere = dict(sorted(elsewhere.items()))
    return report


def _routed_in(
    partition: str,
    decisions: Iterable[tuple[Decision, tuple[str, ...]]],
    numbers: RecordNumbers,
    elsewhere: Counter[str],
) -> Iterator[tuple[Decision, tuple[str, ...]]]:
    """The records routed on `partition`'s events; the others numbered and counted by where."""
    for decision, absent in decisions:
        if decision.partition == partition:
            yield decision, absent
        else:
            numbers.add(decision, f"{decision.replica}/{decision.worker}")
            elsewhere[decision.partition] += 1


def _by_seq(
    decisions: Iterable[tuple[Decision, tuple[str, ...]]],
    numbers: RecordNumbers,
    since: float | None,
    until: float | None,
    window_size: int,
) -> Iterator[tuple[Decision, tuple[str, ...], str]]:
    """The records arriving in [since, until], by seq then arrival as far as a window of
    `window_size` records sorts them, each with the inputs it lacks and its routing process;
    every record read told to `numbers` first, in the log's order."""
    window: list[tuple[int, float, int, Decision, tuple[str, ...], str]] = []
    for read, (decision, absent) in enumerate(decisions):
        process = f"{decision.replica}/{decision.worker}"
        numbers.add(decision, process)
        if (since is not None and decision.at < since) or (until is not None and decision.at > until):
            continue
        heapq.heappush(window, (decision.seq, decision.at, read, decision, absent, process))
        if len(window) > window_size:
            yield heapq.heappop(window)[3:]
    while window:
        yield heapq.heappop(window)[3:]


def _told(message: str) -> None:
    """Takes a problem of the log the first fold has reported."""


class _Checker:
    """The tally of `verify`: each record made again on its state and compared."""

    def __init__(self, shown: int, allow_unverified: bool) -> None:
        self._shown = shown
        self._report = VerifyReport(
            decisions=0, verified=0, divergent=0, differences=0, divergences=[], incomplete=0, missing={},
            incomplete_ids=[], beyond_log=0, beyond_log_ids=[], processes={}, numbering=Numbering(),
            allow_unverified=allow_unverified,
        )  # fmt: skip
        self._lacking_inputs = MissingInputs(shown)
        self._processes: Counter[str] = Counter()
        self._picker = Balancer()  # given each record's inputs, it keeps nothing between records

    def check(self, decision: Decision, absent: tuple[str, ...], process: str, states: States) -> None:
        report = self._report
        report.decisions += 1
        self._processes[process] += 1
        state = states.at(decision.seq)
        if state is None:
            report.beyond_log += 1
            _name(report.beyond_log_ids, decision.request_id, self._shown)
            return
        lacking = missing_inputs(decision, absent)
        differences = _compare(decision, state, states.following_at(), self._picker, lacking=lacking)
        if lacking:
            self._lacking_inputs.add(decision, lacking)
        else:
            report.verified += 1
        if differences:
            report.divergent += 1
            report.differences += len(differences)
            for field, recorded, derived in differences:
                if len(report.divergences) < self._shown:
                    report.divergences.append(Divergence(decision.request_id, process, field, recorded, derived))

    def report(self, numbering: Numbering) -> VerifyReport:
        report = self._report
        lacking = self._lacking_inputs
        report.incomplete, report.missing, report.incomplete_ids = lacking.records, lacking.by_input(), lacking.ids
        report.processes = dict(sorted(self._processes.items()))
        report.numbering = numbering
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
"""(field, recorded, derived), as the report shows them"""


def _compare(
    decision: Decision,
    state: ClusterState,
    following: float | None,
    picker: Balancer,
    *,
    lacking: tuple[str, ...],
) -> list[Difference]:
    """The differences between `decision` and its routing made again on `state`: the route,
    then each leg's pick (`whatif.legs_of`; a leg's only when the record holds every input it
    needs, `lacking` names those it lacks) and attempts, then the status, the admission and the
    times (`following`: the time of the event after `state`)."""
    differences: list[Difference] = []

    def differ(field: str, recorded: object, derived: object) -> None:
        if recorded != derived:
            differences.append((field, text(recorded), text(derived)))

    route = Route(state, decision.model)
    differ("ring", decision.ring, route.ring)
    differ("ring_pool", decision.ring_pool, route.ring_pool)
    passed: list[Exclusion] = []

    def passed_over(ip: str, reason: str) -> None:
        if not any(exclusion.node == ip for exclusion in passed):  # once each, as the data plane's ledger
            passed.append(Exclusion(ip, reason))

    legs = [(leg, pick_pool(leg.candidates, decision.at, passed_over=passed_over)) for leg in legs_of(decision, route)]
    differ("excluded", decision.excluded, route.excluded + tuple(passed))
    excluded = [exclusion.node for exclusion in decision.excluded]
    for leg, pool in legs:
        leg_differ = _leg_differ(leg.name, differ)
        _compare_pick(leg, pool, state, picker, leg_differ, complete=not lacking)
        scored = leg.decision.candidates
        pick = scored[0].node if scored else None
        compare_attempts(leg.decision.attempts, pick, pool, leg.candidates, excluded, leg_differ)
        if not pool:
            break  # a leg without a node ends the request
    _compare_leg_count(decision, [leg.name for leg, _ in legs], differ)
    compare_status(decision, differ)
    if decision.admission is not None:
        compare_admission(decision, decision.admission, state.config, differ)
    compare_times(decision, state, following, differ)
    return differences


def _compare_leg_count(decision: Decision, legs: list[str], differ: Differ) -> None:
    """A leg's attempts recorded where the request had no such leg: prefill attempts of a
    request served whole, decode attempts of one whose prefill leg did not answer."""
    if decision.prefill_attempts and PREFILL not in legs:
        differ("prefill_attempts", decision.prefill_attempts[0].node, "none: the request is served whole")
    if decision.attempts and legs and legs[0] == PREFILL and DECODE not in legs:
        differ("attempts", decision.attempts[0].node, "none: its prefill leg did not answer")


def _leg_differ(leg: str, differ: Differ) -> Differ:
    """`differ` with the prefill leg's fields named so (`prefill.pick`); the decode leg's are the record's own."""
    if leg != PREFILL:
        return differ
    return lambda field, recorded, derived: differ(f"{PREFILL}.{field}", recorded, derived)


def _compare_pick(
    leg: Leg,
    pool: list[NodeState],
    state: ClusterState,
    picker: Balancer,
    differ: Differ,
    *,
    complete: bool,
) -> None:
    """One leg's first pick (a whole request's, or the record as one leg's) made again from `pool`."""
    decision = leg.decision
    recorded = first_pick(decision)
    if not pool or recorded is None:  # a 503 for want of a node, recorded or derived
        differ("pick", recorded, "one of " + text(tuple(node.ip for node in pool)) if pool else None)
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
    differ: Differ,
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


# --- text ------------------------------------------------------------------------------------


def render_report(report: VerifyReport) -> str:
    lines = [_headline(report) + f" ({_processes(report.processes)})"]
    if report.beyond_log:
        lines.append(
            f"{report.beyond_log} records not verified: the event log does not hold their snapshot: "
            + _names(report.beyond_log_ids, report.beyond_log)
        )
    for partition, count in report.routed_elsewhere.items():
        where = f"in partition {partition} (verify with its events and --partition {partition})" if partition else (
            "on the fleet's events (verify without --partition)"
        )
        lines.append(f"{count} records routed {where}: only their numbers checked")
    lines += _numbering_lines(report.numbering)
    if report.divergent:
        shown = len(report.divergences)
        lines += [f"{report.divergent} records differ ({report.differences} differences); the first {shown}:", ""]
        rows = [[d.request_id, d.process, d.field, d.recorded, d.derived] for d in report.divergences]
        lines += format_table(["REQUEST ID", "REPLICA/WORKER", "FIELD", "RECORDED", "DERIVED"], rows)
    return "\n".join(lines)


def _headline(report: VerifyReport) -> str:
    """`N of M verified, K not verified (why), D differ`."""
    why = [
        f"{count} {reason}"
        for count, reason in ((report.incomplete, "lacking policy inputs"), (report.beyond_log, "beyond the event log"))
        if count
    ]
    not_verified = f"{report.not_verified} not verified" + (f" ({', '.join(why)})" if why else "")
    if report.not_verified and report.allow_unverified:
        not_verified += ", allowed"
    return (
        f"{report.verified} of {report.decisions} verified, {not_verified}, {report.divergent} "
        f"{'differs' if report.divergent == 1 else 'differ'}"
    )


def _numbering_lines(numbering: Numbering) -> list[str]:
    """What the records' numbers say: runs missing, records repeated or out of order, and where
    each process's records begin when not at its first."""
    lines = []
    for gap in numbering.gaps:
        what = f"record {gap.first} of {gap.process} is" if gap.first == gap.last else (
            f"records {gap.first}-{gap.last} of {gap.process} are"
        )
        lines.append(f"{what} missing")
    if numbering.gap_count > len(numbering.gaps):
        lines.append(f"{numbering.missing} records missing in all, in {numbering.gap_count} runs")
    for repeat in numbering.repeats:
        lines.append(f"record {repeat.number} of {repeat.process} is repeated (request {repeat.request_id})")
    if numbering.repeated > len(numbering.repeats):
        lines.append(f"{numbering.repeated} records repeated in all")
    for late in numbering.reorders:
        lines.append(f"record {late.number} of {late.process} comes after later ones (request {late.request_id})")
    if numbering.reordered > len(numbering.reorders):
        lines.append(f"{numbering.reordered} records out of order in all")
    for process, number in numbering.starts.items():
        lines.append(
            f"the log of {process} starts at its record {number} (the older ones removed by retention, or not given)"
        )
    for process, count in numbering.restarts.items():
        lines.append(f"{process} counts from 1 again {count} time{'s' if count > 1 else ''} (started again)")
    return lines


def unnumbered_warning(numbering: Numbering) -> str:
    """The warning of `verify` for records without numbers."""
    return (
        f"{numbering.unnumbered} of {numbering.read} decision records are not numbered (written before records "
        "were numbered): a record missing or repeated among them cannot be seen"
    )


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

"""What `interlock verify` checks of a decision record besides its picks: where each attempt
went (`compare_attempts`), what the client got (`compare_status`), the admission verdict
(`compare_admission`) and the record's times (`compare_times`); and whether records are missing,
repeated or out of order (`RecordNumbers`).

An attempt's node, its order and the status are checked against the record's own rules: the
first attempt of each leg went to the leg's pick; a later one to a node of the leg's candidates
not excluded (by the model filter, or passed over as dead or offline) and not tried before in
the leg; an attempt follows only a retried one. The admission verdict is checked against the
config at the record's seq (its tenant and priority, the limit that refused it) and against the
attempts (a refused request has none); the times against the event log (the snapshot it was
routed on was made before it ended) and each other (a wait within its deadline and its duration).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import msgspec

from events.config import DEFAULT_TENANT, GATEWAY_TENANT, Config
from events.decisions import Admission, AttemptOutcome, AttemptRecord, Decision, Exclusion, Verdict
from events.state import ClusterState, NodeState

Differ = Callable[[str, object, object], None]
"""Names a field whose recorded value differs from the derived one: (field, recorded, derived)."""

CLOCK_SLACK_SECONDS = 10.0
"""How far a record's time may lie past the snapshots around it: the wall clocks of replicas
differ, and a worker routes on the snapshot it has until the leader's next one reaches it."""

QUEUE_SLACK_MS = 1000.0
"""How far past its deadline a queued request's recorded wait may end (its wake-up is late on a
busy machine)."""

REFUSED_BY_QUEUE = {"queue_full": 429, "queue_deadline": 503}
"""The queue's refusals and the status each answers with."""
LIMITS = {"requests": "requests_per_minute", "tokens": "tokens_per_minute", "in_flight": "max_in_flight"}
"""The tenant limits a refusal names (answered with 429), with their key in `[[tenants]]`."""

RETRIED = AttemptOutcome.RETRIED


# --- attempts ------------------------------------------------------------------------------------


def compare_attempts(
    attempts: Sequence[AttemptRecord],
    pick: str | None,
    pool: Sequence[NodeState],
    candidates: Sequence[NodeState],
    excluded: Iterable[str],
    differ: Differ,
) -> None:
    """One leg's attempts: the first went to `pick` (the leg's recorded pick, its best
    candidate, which `verify` makes again; None when the record has no scores: then to a node
    of the leg's `pool`), each later one to a candidate neither `excluded` nor tried before in
    the leg, and only after an attempt that was retried."""
    tried: list[str] = []
    passed_over = set(excluded)
    allowed = [node.ip for node in candidates if node.ip not in passed_over]
    for index, attempt in enumerate(attempts):
        node = attempt.node
        if index and attempts[index - 1].outcome != RETRIED:
            differ(f"attempts[{index}]", node, f"none after {attempts[index - 1].outcome}")
        if index == 0:
            if pick is not None:
                if node != pick:
                    differ("attempts[0].node", node, pick)
            elif node not in (pool_ips := [candidate.ip for candidate in pool]):
                differ("attempts[0].node", node, "one of " + text(tuple(pool_ips)))
        elif node not in allowed or node in tried:
            differ(f"attempts[{index}].node", node, "one of " + text(tuple(ip for ip in allowed if ip not in tried)))
        tried.append(node)


def _statuses(decision: Decision) -> tuple[int | None, ...]:
    """The statuses the client may have got, given the record's attempts (those of its last
    leg) and its admission: None when the client went away first."""
    admission = decision.admission
    if admission is not None and admission.verdict == Verdict.REFUSED:
        return (REFUSED_BY_QUEUE.get(admission.refused_by, 429),)
    if decision.attempts:
        last = decision.attempts[-1]
        prefill = False
    elif decision.prefill_attempts:
        last = decision.prefill_attempts[-1]
        prefill = True
    else:  # no node (503), an unknown model (404), an adapter being loaded (503), or the client left queued
        return (404, 503, None)
    outcome = last.outcome
    if outcome == AttemptOutcome.COMPLETED:
        if prefill and last.status == 200:  # the decode leg found no node, or the client left
            return (503, None)
        return (last.status,)
    if outcome == AttemptOutcome.TRUNCATED:
        return (last.status,)
    if outcome == AttemptOutcome.CLIENT_GONE:
        return (None,) if prefill else (None, last.status)  # before or after the answer was committed
    if outcome == AttemptOutcome.FAILED:
        return (502, 504)  # 504: it did not answer in time
    return (502, 503, None) if prefill else (503, None)  # retried, and no node left (or the client left)


def compare_status(decision: Decision, differ: Differ) -> None:
    allowed = _statuses(decision)
    if decision.status not in allowed:
        differ("status", decision.status, allowed[0] if len(allowed) == 1 else "one of " + text(allowed))


# --- admission -----------------------------------------------------------------------------------


def compare_admission(decision: Decision, admission: Admission, config: Config | None, differ: Differ) -> None:
    """The verdict against the attempts; the tenant, priority and refusing limit against the
    config the record was routed on; the wait against the tenant's deadline."""
    if admission.verdict == Verdict.REFUSED:
        if decision.attempts or decision.prefill_attempts:
            differ("admission.verdict", admission.verdict, "admitted: it has attempts")
        if not admission.refused_by:
            differ("admission.refused_by", "", "the limit or queue that refused it")
    elif admission.refused_by:
        differ("admission.refused_by", admission.refused_by, "")
    if admission.verdict == Verdict.ADMITTED and admission.queued_ms:
        differ("admission.queued_ms", admission.queued_ms, 0)
    if config is None:
        return
    tenants = {tenant.name: tenant for tenant in config.tenants}
    tenant = tenants.get(admission.tenant)
    if tenant is None and admission.tenant not in (GATEWAY_TENANT, DEFAULT_TENANT):
        differ("admission.tenant", admission.tenant, "one of " + text((*tenants, GATEWAY_TENANT, DEFAULT_TENANT)))
        return
    top = tenant.priority if tenant is not None else 0
    priorities = (top, *sorted({value for value in config.admission.objectives.values() if value < top}))
    if admission.priority not in priorities:
        differ("admission.priority", admission.priority, top if len(priorities) == 1 else "one of " + text(priorities))
    limit_key = LIMITS.get(admission.refused_by)
    if limit_key is not None and (tenant is None or getattr(tenant, limit_key) is None):
        differ("admission.refused_by", admission.refused_by, f"a limit of {admission.tenant}")
    if admission.verdict == Verdict.QUEUED:
        deadline = tenant.max_queue_seconds if tenant is not None else None
        if deadline is None:
            deadline = config.admission.max_queue_seconds
        if admission.queued_ms > 1000 * deadline + QUEUE_SLACK_MS:
            differ("admission.queued_ms", admission.queued_ms, f"at most {1000 * deadline:g}")


# --- times ---------------------------------------------------------------------------------------


def compare_times(decision: Decision, state: ClusterState, following: float | None, differ: Differ) -> None:
    """The record's time against the snapshot it was routed on (made before the request ended)
    and the one after it (`following`, its time; made after the request arrived, else the
    request would have been routed on it), and its wait against its duration."""
    if decision.duration < 0:
        differ("duration", decision.duration, "at least 0")
    if decision.at + decision.duration + CLOCK_SLACK_SECONDS < state.at:
        differ("at", decision.at, f"after {state.at} (seq {state.seq}'s time) less its duration")
    elif following is not None and decision.at > following + CLOCK_SLACK_SECONDS:
        differ("at", decision.at, f"before {following} (the time of the event after seq {state.seq})")
    admission = decision.admission
    if admission is not None and admission.queued_ms > 1000 * decision.duration + QUEUE_SLACK_MS:
        differ("admission.queued_ms", admission.queued_ms, f"at most its duration ({1000 * decision.duration:.0f})")


def text(value: object) -> str:
    """A field's value as the report shows it."""
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return "[" + ", ".join(text(item) for item in value) + "]"
    if isinstance(value, Exclusion):
        return f"{value.node} {value.reason}"
    return str(value)


# --- numbering -----------------------------------------------------------------------------------


class RecordGap(msgspec.Struct, frozen=True):
    """Records `first` to `last` of a routing process (`replica/worker`), missing from the log."""

    process: str
    first: int
    last: int


class OutOfPlace(msgspec.Struct, frozen=True):
    """Record `number` of a routing process, met again (`repeated`) or after a later one (`reordered`)."""

    process: str
    number: int
    request_id: str


class Numbering(msgspec.Struct, kw_only=True):
    """What the records' numbers (`Decision.number`) say of the decision log."""

    read: int = 0
    """Records read (in the span verified or not)."""
    unnumbered: int = 0
    """Records without a number (written before records were numbered): a gap among them cannot be seen."""
    starts: dict[str, int] = {}
    """Each routing process whose records begin past its first, with the number they begin at
    (its older records removed by retention, or in segments not given)."""
    missing: int = 0
    """Records missing in the middle of a process's records."""
    gap_count: int = 0
    """Runs of missing records."""
    gaps: list[RecordGap] = []
    """The first `shown` runs of missing records."""
    repeated: int = 0
    repeats: list[OutOfPlace] = []
    reordered: int = 0
    reorders: list[OutOfPlace] = []
    restarts: dict[str, int] = {}
    """Each routing process that counts from 1 again in the log (started again), with how often."""


MISSING_RUNS_KEPT = 256
"""Runs of missing records kept per routing process, for a record met later to be told
reordered rather than repeated; beyond that the oldest is counted missing for good."""


class _Process:
    __slots__ = ("expected", "missing", "first_request")

    def __init__(self) -> None:
        self.expected = 0
        """The number the next record should have (0: none seen yet)."""
        self.missing: list[list[int]] = []
        """Runs [first, last] of numbers not seen yet, oldest first."""
        self.first_request: tuple[str, float] = ("", 0.0)
        """Record 1's request id and arrival in this run (to tell a repeated record 1 from a restart)."""


class RecordNumbers:
    """Follows each routing process's record numbers in the order the log holds them (memory
    bounded by the processes, and MISSING_RUNS_KEPT runs of missing records each)."""

    def __init__(self, shown: int) -> None:
        self.numbering = Numbering()
        self._shown = shown
        self._processes: dict[str, _Process] = {}

    def add(self, decision: Decision, process: str) -> None:
        number = decision.number
        numbering = self.numbering
        numbering.read += 1
        if not number:
            numbering.unnumbered += 1
            return
        known = self._processes.get(process)
        if known is None:
            known = self._processes[process] = _Process()
            if number > 1:
                numbering.starts[process] = number
        expected = known.expected
        if number == 1 and expected and (decision.request_id, decision.at) != known.first_request:
            self._close(process, known)  # started again: what its earlier run lacks stays missing
            numbering.restarts[process] = numbering.restarts.get(process, 0) + 1
            expected = 0
        if number == 1:
            known.first_request = (decision.request_id, decision.at)
        if not expected or number == expected:
            known.expected = number + 1
        elif number > expected:
            known.missing.append([expected, number - 1])
            if len(known.missing) > MISSING_RUNS_KEPT:
                self._gap(process, *known.missing.pop(0))
            known.expected = number + 1
        elif self._take(known, number):
            numbering.reordered += 1
            self._note(numbering.reorders, OutOfPlace(process, number, decision.request_id))
        else:
            numbering.repeated += 1
            self._note(numbering.repeats, OutOfPlace(process, number, decision.request_id))

    def finish(self) -> Numbering:
        """The numbering of every record added: what is still missing is a gap."""
        for process, known in self._processes.items():
            self._close(process, known)
        return self.numbering

    def _close(self, process: str, known: _Process) -> None:
        for first, last in known.missing:
            self._gap(process, first, last)
        known.missing = []
        known.expected = 0

    def _gap(self, process: str, first: int, last: int) -> None:
        self.numbering.missing += last - first + 1
        self.numbering.gap_count += 1
        self._note(self.numbering.gaps, RecordGap(process, first, last))

    def _note(self, shown: list, item: object) -> None:
        if len(shown) < self._shown:
            shown.append(item)

    @staticmethod
    def _take(known: _Process, number: int) -> bool:
        """Whether `number` was missing (then it no longer is)."""
        for index, (first, last) in enumerate(known.missing):
            if first <= number <= last:
                runs = [[first, number - 1]] if first < number else []
                if number < last:
                    runs.append([number + 1, last])
                known.missing[index : index + 1] = runs
                return True
        return False

"""`interlock explain --request-id`: one recorded request, told from its decision record.

With the event log as well, the exclusions are traced to their events: the log is replayed up
to the snapshot the request was routed on, and for each excluded node the transition that last
changed the part of its state behind the exclusion is shown (its health for `dead`, the offline
skip-set for `offline`, model discovery for the model filter's `missing`, `empty`, `expired`); for
a LoRA adapter the gateway loads, each load of it (requested, loaded, failed: why a node has it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from controlplane.rules.log_lines import format_timestamp
from controlplane.effects.replay import ReplayResult, audit
from controlplane.rules.routing import EXCLUDED_DEAD, EXCLUDED_OFFLINE, NO_HEALTHY_NODE, NO_REACHABLE_NODE, Route, pick_pool
from controlplane.rules.saturation import scraped_reason, under_fair_share
from controlplane.rules.transitions import HEALTH, MODELS, OFFLINE, Transition
from dataplane.admission.queue import QUEUE_DEADLINE, QUEUE_FULL
from dataplane.errors import model_not_found
from events.decisions import Admission, AttemptOutcome, AttemptRecord, CandidateScore, Decision, Verdict
from events.state import NodeState
from interlock.render import format_ring, format_table

_KIND_BEHIND = {EXCLUDED_DEAD: HEALTH, EXCLUDED_OFFLINE: OFFLINE}
"""The transition kind behind each exclusion reason that is not the model filter's (MODELS)."""


class Cause(msgspec.Struct, frozen=True, kw_only=True):
    """One exclusion of a request, traced in the replayed event log."""

    node: str
    reason: str
    state: NodeState | None
    """The node in the replayed state (None: the log does not know it)."""
    last_change: Transition | None
    """The last transition of the kind behind `reason` (None: there is none in the log)."""


def trace_exclusions(decision: Decision, result: ReplayResult) -> list[Cause]:
    """Each exclusion of `decision`, with the node's replayed state and the transition behind it.
    `result` is the event log replayed up to the decision's seq."""
    causes = []
    for exclusion in decision.excluded:
        kind = _KIND_BEHIND.get(exclusion.reason, MODELS)
        changes = audit(result.transitions, nodes=[exclusion.node], kinds=[kind])
        causes.append(
            Cause(
                node=exclusion.node,
                reason=exclusion.reason,
                state=result.state.nodes.get(exclusion.node),
                last_change=changes[-1] if changes else None,
            )
        )
    return causes


def adapter_loads(decision: Decision, result: ReplayResult) -> list[Transition]:
    """The transitions of the gateway's loads of the request's model onto nodes, when it is a
    configured LoRA adapter (`controlplane.rules.adapters`): why a node has it, or lacks it."""
    return [
        transition
        for transition in audit(result.transitions, kinds=[MODELS])
        if transition.msg.startswith("adapter ") and ("adapter", decision.model) in transition.fields
    ]


def final_status(decision: Decision) -> str:
    """The status the client got, with the gateway's own 503 or 404 text when no node answered."""
    if decision.status is None:
        return "none: the client went away"
    if decision.status == 404 and not decision.attempts:
        return f'404 "{model_not_found(decision.model).message}"'
    if decision.status == 503 and all(attempt.outcome == AttemptOutcome.RETRIED for attempt in decision.attempts):
        # plinth's two refusals: no candidate at all after the model filter, or none usable.
        filtered = {exclusion.node for exclusion in decision.excluded if exclusion.reason not in _KIND_BEHIND}
        candidates = [ip for ip in decision.ring_pool if ip not in filtered]
        return f'503 "{NO_REACHABLE_NODE if candidates else NO_HEALTHY_NODE}"'
    return str(decision.status)


# --- text ------------------------------------------------------------------------------------


def routed_by(decision: Decision) -> str:
    """The replica, and the worker when the gateway ran workers (`serve --workers`)."""
    replica = decision.replica or "unnamed replica"
    return f"{replica}, worker {decision.worker}" if decision.worker else replica


def render_request(decision: Decision, earlier: Sequence[Decision] = ()) -> str:
    """The record for a terminal: the request, its exclusions, its attempts. `earlier` are
    older records with the same request id, mentioned at the end."""
    lines = format_table(
        ["request", decision.request_id],
        [
            ["time", format_timestamp(decision.at)],
            ["path", decision.path],
            ["model", f"{decision.model} (asked for as {decision.alias})" if decision.alias else decision.model],
            ["stream", "yes" if decision.stream else "no"],
            ["snapshot", f"seq {decision.seq}"],
            ["routed by", routed_by(decision)],
            ["policy", _policy(decision)],
            ["ring", format_ring(decision.ring)],
            ["ring pool", ", ".join(decision.ring_pool) or "none"],
            ["status", final_status(decision)],
            ["duration", f"{decision.duration * 1000:.1f} ms"],
            *_admission_rows(decision.admission),
        ],
    )
    lines.append("")
    if decision.excluded:
        rows = [[exclusion.node, exclusion.reason] for exclusion in decision.excluded]
        lines += format_table(["EXCLUDED", "REASON"], rows)
    else:
        lines.append("no node excluded")
    lines.append("")
    if decision.prefill_pick is not None and decision.prefill_pick.candidates:
        lines += _candidates_table(decision.prefill_pick.candidates, "PREFILL CANDIDATE") + [""]
    if decision.prefill_attempts:  # disaggregated: the prefill leg, then the decode leg
        lines += _attempts_table("PREFILL", decision.prefill_attempts) + [""]
    if decision.candidates:
        heading = "DECODE CANDIDATE" if decision.prefill_attempts else "CANDIDATE"
        lines += _candidates_table(decision.candidates, heading) + [""]
    if decision.attempts:
        lines += _attempts_table("DECODE" if decision.prefill_attempts else "ATTEMPT", decision.attempts)
    elif decision.prefill_attempts:
        lines.append("no decode attempt: the prefill leg did not succeed")
    else:
        lines.append("no attempt: no node could be picked")
    if earlier:
        times = ", ".join(f"{format_timestamp(record.at)} (status {_or_dash(record.status)})" for record in earlier)
        lines += ["", f"{len(earlier)} earlier request(s) with this id, not shown: {times}"]
    return "\n".join(lines)


def _admission_rows(admission: Admission | None) -> list[list[str]]:
    """Who the request was for and what admission made of it (nothing for older records)."""
    if admission is None:
        return []
    tenant = admission.tenant + (f" (fairness id {admission.fairness_id})" if admission.fairness_id else "")
    if admission.refused_by in (QUEUE_FULL, QUEUE_DEADLINE):
        waited = f" after {admission.queued_ms:.1f} ms" if admission.queued_ms else ""
        verdict = f"refused by the queue ({admission.refused_by.replace('_', ' ')}){waited}"
    elif admission.verdict == Verdict.REFUSED:
        verdict = (
            f"refused by {admission.refused_by.replace('_', ' ')}: limit {_or_dash(admission.limit)}, "
            f"{_or_dash(admission.remaining)} left"
        )
        if admission.reset:  # a per-minute limit (in-flight slots come back as requests end)
            verdict += f", whole again in {admission.reset:g} s"
    elif admission.verdict == Verdict.QUEUED:
        verdict = f"queued {admission.queued_ms:.1f} ms"
    else:
        verdict = "admitted at once"
    if admission.saturated_seq:
        verdict += f", pool saturated at seq {admission.saturated_seq}"
    if admission.headroom:
        verdict += f", {admission.headroom} in-flight places per node left to higher priorities (priority_headroom)"
    share = admission.fair_share
    if share is not None:
        standing = "under its fair share, ahead of" if under_fair_share(share) else "not under its fair share, with"
        verdict += (
            f", {standing} its priority's others (its tenant had {share.tenant_in_flight} of the"
            f" {share.priority_in_flight} requests"
            f" of its priority in flight, of {share.tenants} tenants)"
        )
    if admission.preemptible:
        verdict += (
            f", {admission.preemptible} lower-ranked request{'s' if admission.preemptible != 1 else ''} in flight"
            " on priority-scheduled nodes held it no place (they are preempted for it)"
        )
    rows = [["tenant", tenant], ["priority", str(admission.priority)], ["admission", verdict]]
    if admission.tokens_reserved:
        used = "not reported" if admission.tokens_used is None else str(admission.tokens_used)
        rows.append(["tokens", f"{admission.tokens_reserved} reserved, {used} used"])
    return rows


def render_saturation(decision: Decision, result: ReplayResult) -> str:
    """Why the request's pool was saturated: each node a pick would have chosen from, in the
    state at the record's `saturated_seq` (`result`: the event log replayed up to it), with
    `controlplane.rules.saturation`'s reason. This process's in-flight counts are not in the log: a
    node saturated only by its `max_in_flight` shows that bound (less the places the request's
    priority left free, `Admission.headroom`)."""
    state = result.state
    seq = decision.admission.saturated_seq
    lines = [f"pool saturated at seq {seq} ({format_timestamp(state.at)}), replayed from the event log"]
    admission = state.config.admission if state.config is not None else None
    if admission is None or not admission.queue:
        return "\n".join(lines + ["the config in force then has the admission queue off"])
    limits = {node.ip: node.max_in_flight for node in state.config.nodes}
    rows = []
    for node in pick_pool(Route(state, decision.model).candidates, decision.at):
        load = node.load
        reason = scraped_reason(node, admission)
        if not reason:
            limit = limits.get(node.ip)
            headroom = decision.admission.headroom
            threshold = f"max_in_flight {limit}" + (f" less priority_headroom {headroom}" if headroom else "")
            reason = (
                f"not by its scrape: by {threshold}, if this process had as many in flight (not in the log)"
                if limit
                else "no"
            )
        waiting = _number(load.waiting) if load.known else "-"
        usage = _number(load.kv_cache_usage) if load.known else "-"
        rows.append([node.ip, node.name or "-", waiting, usage, reason])
    return "\n".join(lines + format_table(["NODE", "NAME", "WAITING", "KV CACHE", "SATURATED"], rows))


def _attempts_table(heading: str, attempts: tuple[AttemptRecord, ...]) -> list[str]:
    rows = [
        [str(number), attempt.node, attempt.outcome, _or_dash(attempt.status), attempt.error or "-"]
        for number, attempt in enumerate(attempts, start=1)
    ]
    return format_table([heading, "NODE", "OUTCOME", "STATUS", "ERROR"], rows)


def _policy(decision: Decision) -> str:
    """The policy, the first pick's margin when it was scored, the prompt prefix's hash, and the
    node the prefix last went to (prefix affinity tries it first)."""
    text = decision.policy
    if decision.margin is not None:
        text += f", margin {_number(decision.margin)}"
    if decision.prefix:
        text += f", prefix {decision.prefix}"
    return f"{text}, last sent to {decision.remembered}" if decision.remembered else text


def _candidates_table(candidates: tuple[CandidateScore, ...], heading: str) -> list[str]:
    """A first pick's candidates as the policy scored them, best first, the chosen one marked;
    for a LoRA adapter, what each node's scrape said of it (LORA); under `kv_aware`, the prompt's
    blocks each node held (KV BLOCKS: matched of total), its KV index's position (KV SEQ), and
    whether the policy fell back to prefix affinity's guess for it (NOTE: fallback)."""
    lora = any(candidate.lora for candidate in candidates)
    kv = any(candidate.kv is not None or candidate.fallback for candidate in candidates)
    rows = [
        [
            ("* " if number == 0 else "  ") + candidate.node,
            str(candidate.in_flight),
            _number(candidate.running),
            _number(candidate.waiting),
            _number(candidate.kv_cache_usage),
            "-" if candidate.seconds_per_token is None else f"{1000 * candidate.seconds_per_token:.1f}",
            *([candidate.lora or "-"] if lora else []),
            *(_kv_columns(candidate) if kv else []),
            _number(candidate.score),
            _note(candidate),
        ]
        for number, candidate in enumerate(candidates)
    ]
    headers = [heading, "IN FLIGHT", "RUNNING", "WAITING", "KV CACHE", "MS/TOKEN", *(["LORA"] if lora else [])]
    headers += [*(["KV BLOCKS", "KV SEQ"] if kv else []), "SCORE", "NOTE"]
    return format_table(headers, rows)


def _kv_columns(candidate: CandidateScore) -> list[str]:
    held = candidate.kv
    if held is None:
        return ["-", "-"]
    return [f"{held.matched}/{held.total}", str(held.seq) + ("" if held.flowing else " (not flowing)")]


def _note(candidate: CandidateScore) -> str:
    notes = [candidate.note or ("full" if candidate.full else "")]
    if candidate.fallback:
        notes.append("fallback: prefix affinity" + ("" if candidate.kv else " (no match)"))
    return ", ".join(note for note in notes if note) or "-"


def _number(value: float | None) -> str:
    """A score or a scraped figure: whole numbers as such, others to two places, None as a dash."""
    if value is None:
        return "-"
    return str(int(value)) if value == int(value) else f"{value:.2f}"


def render_causes(decision: Decision, result: ReplayResult) -> str:
    """The replayed control plane behind the exclusions: each excluded node's state, and the
    transition that put it there. `result` is the event log replayed up to the decision's seq."""
    causes = trace_exclusions(decision, result)
    state = result.state
    lines = [f"control plane at seq {state.seq} ({format_timestamp(state.at)}), replayed from the event log"]
    if state.seq != decision.seq:
        lines.append(f"warning: the event log ends at seq {state.seq}, before the request's seq {decision.seq}")
    loads = adapter_loads(decision, result)
    if loads:
        lines += [f"the gateway's loads of the adapter {decision.model}:"]
        lines += [f"  {transition.node}: {_describe(transition)}" for transition in loads]
    if not causes:
        return "\n".join(lines + ["no node excluded"])
    rows = []
    for cause in causes:
        node = cause.state
        rows.append(
            [
                cause.node,
                (node.name or "-") if node else "?",
                cause.reason,
                node.status if node else "?",
                node.models.state if node else "?",
                _describe(cause.last_change),
            ]
        )
    return "\n".join(lines + format_table(["NODE", "NAME", "EXCLUDED", "STATUS", "MODELS", "LAST CHANGE"], rows))


def _describe(transition: Transition | None) -> str:
    """`seq 7 2026-01-02T03:04:05Z model discovery expired (error=…)`."""
    if transition is None:
        return "none in the event log"
    fields = ", ".join(f"{key}={value}" for key, value in transition.fields if key != "node")
    text = f"seq {transition.seq} {format_timestamp(transition.at)} {transition.msg}"
    return f"{text} ({fields})" if fields else text


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


# --- JSON ------------------------------------------------------------------------------------


def request_to_builtins(decision: Decision, result: ReplayResult | None = None) -> dict[str, Any]:
    """The record as logged; with the replayed event log, each exclusion's last change too (as
    the JSON log line the gateway printed for it)."""
    data = msgspec.to_builtins(decision)
    if result is not None:
        data["causes"] = [
            {
                "node": cause.node,
                "reason": cause.reason,
                "last_change": msgspec.json.decode(cause.last_change.log_line()) if cause.last_change else None,
            }
            for cause in trace_exclusions(decision, result)
        ]
        data["adapter_loads"] = [msgspec.json.decode(t.log_line()) for t in adapter_loads(decision, result)]
    return data

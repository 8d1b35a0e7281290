"""`interlock whatif --tenants FILE`: a recorded run's requests admitted again under other
tenant limits, with the same buckets the gateway keeps (`dataplane.admission.quota.Buckets`), on the
records' own clock.

Open-loop: every request arrives when it was recorded, whatever the what-if world would have
answered it (a client refused there might have come back later; one refused in the recording
might not have come back at all), so it tells who would have been limited, not what they would
have done next. A request holds its in-flight slot for its recorded duration. Its tokens are
the usage its record holds; a request whose tenant's tokens were not counted when it was
recorded has none, and is reckoned at DEFAULT_MAX_TOKENS (counted as `tokens_estimated`).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

import msgspec

from dataplane.admission.quota import IN_FLIGHT, LIMITS, REQUESTS, TOKENS, Buckets
from events.config import DEFAULT_MAX_TOKENS, TenantConfig
from events.decisions import Decision, Verdict
from interlock.render import format_table

OPEN_LOOP_NOTE = (
    "open-loop: requests arrive as recorded, whatever the what-if limits answered them "
    "(a refused client's retries are not modelled)"
)


class TenantOutcome(msgspec.Struct):
    tenant: str
    requests: int = 0
    admitted: int = 0
    refused: dict[str, int] = {}
    """Refusals under the what-if limits, by limit."""
    recorded_refused: int = 0
    newly_refused: int = 0
    """Admitted when recorded, refused under the what-if limits."""
    newly_admitted: int = 0
    """Refused when recorded, admitted under the what-if limits."""
    tokens_estimated: int = 0


class TenantsWhatIf(msgspec.Struct):
    note: str
    tenants: list[TenantOutcome]
    without_admission: int
    """Records from before admission was recorded, left out."""


def tenants_what_if(decisions: Iterable[Decision], tenants: tuple[TenantConfig, ...]) -> TenantsWhatIf:
    limits = {
        (tenant.name, limit): value
        for tenant in tenants
        for limit, value in (
            (REQUESTS, tenant.requests_per_minute),
            (TOKENS, tenant.tokens_per_minute),
            (IN_FLIGHT, tenant.max_in_flight),
        )
        if value is not None
    }
    records = []
    without = 0
    for decision in decisions:
        if decision.admission is None:
            without += 1
        else:
            records.append(decision)
    records.sort(key=lambda record: record.at)
    buckets = Buckets()
    outcomes: dict[str, TenantOutcome] = {}
    ends: list[tuple[float, int, str, int, int]] = []
    """Admitted requests still in flight: (end, order, tenant, tokens reserved, tokens used)."""
    for order, record in enumerate(records):
        admission = record.admission
        assert admission is not None
        now = record.at
        if not order:
            buckets.configure(limits, now)
        while ends and ends[0][0] <= now:
            end, _, tenant, reserved, used = heapq.heappop(ends)
            buckets.give(tenant, IN_FLIGHT, 1, end)
            buckets.give(tenant, TOKENS, reserved - used, end)
        outcome = outcomes.get(admission.tenant)
        if outcome is None:
            outcome = outcomes[admission.tenant] = TenantOutcome(tenant=admission.tenant, refused={})
        outcome.requests += 1
        recorded_refused = admission.verdict == Verdict.REFUSED
        outcome.recorded_refused += recorded_refused
        used = admission.tokens_used if admission.tokens_used is not None else admission.tokens_reserved
        if not used:
            used = DEFAULT_MAX_TOKENS
            outcome.tokens_estimated += 1
        reserved = admission.tokens_reserved or used
        capacity = limits.get((admission.tenant, TOKENS))
        if capacity is not None:
            reserved = min(reserved, capacity)
        taken = []
        refused_by = ""
        for limit in LIMITS:
            amount = reserved if limit == TOKENS else 1
            if buckets.take(admission.tenant, limit, amount, now) is not None:
                refused_by = limit
                break
            taken.append((limit, amount))
        if refused_by:
            for limit, amount in taken:
                buckets.give(admission.tenant, limit, amount, now)
            outcome.refused[refused_by] = outcome.refused.get(refused_by, 0) + 1
            outcome.newly_refused += not recorded_refused
        else:
            outcome.admitted += 1
            outcome.newly_admitted += recorded_refused
            heapq.heappush(ends, (now + record.duration, order, admission.tenant, reserved, used))
    return TenantsWhatIf(
        note=OPEN_LOOP_NOTE, tenants=sorted(outcomes.values(), key=lambda item: item.tenant), without_admission=without
    )


def render_tenants_what_if(report: TenantsWhatIf) -> str:
    rows = [
        [
            outcome.tenant,
            str(outcome.requests),
            str(outcome.admitted),
            ", ".join(f"{count} by {limit.replace('_', ' ')}" for limit, count in sorted(outcome.refused.items()))
            or "0",
            str(outcome.recorded_refused),
            str(outcome.newly_refused),
            str(outcome.newly_admitted),
        ]
        for outcome in report.tenants
    ]
    lines = format_table(
        ["TENANT", "REQUESTS", "ADMITTED", "REFUSED", "REFUSED WHEN RECORDED", "NEWLY REFUSED", "NEWLY ADMITTED"],
        rows,
    )
    estimated = sum(outcome.tokens_estimated for outcome in report.tenants)
    if estimated:
        lines.append(f"{estimated} request(s) without recorded tokens reckoned at {DEFAULT_MAX_TOKENS} tokens each")
    if report.without_admission:
        lines.append(f"{report.without_admission} record(s) from before admission was recorded left out")
    lines.append(report.note)
    return "\n".join(lines)

"""A request's admission, from its tenant to its settlement: the `Ticket`.

It is made as the request arrives (`limits.Limits.ticket`), takes what its tenant's limits ask
(`Limits.take`), carries what the gateway's queue made of it (`queue`), and is settled when
the request ends (the ledger's `request_ended` or `client_left`): what it took (a request, a
token reservation, an in-flight slot) is given back or kept, tokens settled to the node's usage
(`admission.tokens`).
"""

from __future__ import annotations

from controlplane.rules.saturation import rank, under_fair_share
from dataplane.admission.bodies import with_priority
from dataplane.admission.queue import ADMITTED_AT_ONCE, QUEUED, QueueOutcome
from dataplane.admission.quota import IN_FLIGHT, TOKENS, LimitState, Quota
from dataplane.admission.tenants import TenantView
from dataplane.admission.tokens import UsageTap, usage_tokens
from dataplane.headers import Headers
from dataplane.metrics import RequestMetrics
from events.decisions import Admission as AdmissionRecord
from events.decisions import Verdict


class Ticket:
    """One request's admission: who, at which priority, what it took and how it ended."""

    __slots__ = (
        "tenant", "priority", "fairness_id", "verdict", "refused_by", "refused_state", "queue", "rank", "taken",
        "admitted", "tokens_reserved", "prompt_tokens", "tokens_used", "tap", "headers", "_quota", "_metrics",
        "_prioritized",
    )  # fmt: skip

    def __init__(self, tenant: TenantView, priority: int, fairness_id: str, quota: Quota, metrics: RequestMetrics):
        self.tenant = tenant
        self.priority = priority
        self.fairness_id = fairness_id
        self.verdict = Verdict.ADMITTED
        self.refused_by = ""
        self.refused_state: LimitState | None = None
        self.queue = ADMITTED_AT_ONCE
        """What the gateway's queue made of it (`queue.QueueOutcome`)."""
        self.rank = rank(priority, False)
        """Its place among the priorities (`saturation.rank`): its priority's, or ahead of it
        when the queue found its tenant under its fair share."""
        self.taken: list[tuple[str, int]] = []
        self.admitted = False
        self.tokens_reserved = 0
        self.prompt_tokens = 0
        """The prompt's estimate (`tokens.prompt_estimate`), part of the reservation."""
        self.tokens_used: int | None = None
        self.tap: UsageTap | None = None
        """A stream's usage reader, when the tenant's tokens are counted."""
        self.headers: Headers = []
        """OpenAI's `x-ratelimit-*` headers, for a limited tenant's every answer."""
        self._quota = quota
        self._metrics = metrics
        self._prioritized: tuple[bytes, bytes] | None = None
        """The last body given to `prioritized` and what it made of it."""

    def prioritized(self, body: bytes) -> bytes:
        """`body` for a node with priority scheduling (`with_priority`), rewritten once per body
        however many attempts go to such nodes."""
        done = self._prioritized
        if done is None or done[0] is not body:
            done = self._prioritized = (body, with_priority(body, self.rank))
        return done[1]

    def queued(self, outcome: QueueOutcome) -> None:
        """What the gateway's queue made of the request past its tenant's limits: queued for a
        while, or refused (what the limits took is then given back, as for a limit's refusal)."""
        self.queue = outcome
        if outcome.fair_share is not None:
            self.rank = rank(self.priority, under_fair_share(outcome.fair_share))
        if outcome.refused:
            self.verdict = Verdict.REFUSED
            self.refused_by = outcome.verdict
        elif outcome.verdict == QUEUED:
            self.verdict = Verdict.QUEUED

    def read_usage(self, body: bytes) -> None:
        """A complete answer's `usage` (a tenant whose tokens are counted)."""
        self.tokens_used = usage_tokens(body)

    def end(self, status: int | None) -> None:
        """The request ended (`status` None: the client left first): what it took is settled. A
        request that never got past admission (its limits, then the queue) gives everything back;
        an admitted one keeps its request, gives back its in-flight slot, and settles its tokens
        to the node's `usage`. Without one, a stream is charged what it relayed
        (`UsageTap.relayed`); any other answer's reservation stands for a 2xx and is given back
        otherwise."""
        tap = self.tap
        if tap is not None:
            if tap.tokens is not None:
                self.tokens_used = tap.tokens
            elif tap.events:
                self.tokens_used = tap.relayed(self.prompt_tokens)
        name = self.tenant.name
        for limit, amount in self.taken:
            if not self.admitted or limit == IN_FLIGHT:
                self._quota.give(name, limit, amount)
            elif limit == TOKENS:
                if self.tokens_used is not None:
                    self._quota.give(name, TOKENS, amount - self.tokens_used)
                elif status is None or not 200 <= status < 300:
                    self._quota.give(name, TOKENS, amount)
        self.taken = []
        if self.admitted and self.tenant.counts_tokens:
            used = self.tokens_used if self.tokens_used is not None else self.tokens_reserved
            if status is not None and 200 <= status < 300:
                self._metrics.admission_tokens(name, self.priority, used)

    def record(self) -> AdmissionRecord:
        state = self.refused_state
        queue = self.queue
        return AdmissionRecord(
            tenant=self.tenant.name,
            priority=self.priority,
            fairness_id=self.fairness_id,
            verdict=self.verdict,
            refused_by=self.refused_by,
            limit=state.limit if state else None,
            remaining=state.remaining if state else None,
            reset=round(state.reset, 3) if state else None,
            queued_ms=round(queue.queued_ms, 3),
            tokens_reserved=self.tokens_reserved,
            tokens_used=self.tokens_used,
            saturated_seq=queue.saturated_seq,
            headroom=queue.headroom,
            fair_share=queue.fair_share,
            preemptible=queue.preemptible,
        )

"""A tenant's limits at admission: whose a request is (its tenant, `dataplane.access`), at which
priority, and whether its tenant's limits let it through (`admission.quota` holds the quota).

A refusal is a 429 in OpenAI's shape (`rate_limit_exceeded`), and every answer of a limited
tenant carries OpenAI's `x-ratelimit-*` headers, so the SDKs' own back-off works.

Tokens are counted only for tenants with `tokens_per_minute` (`admission.tokens`): for a
stream the node is asked for usage (`stream_options.include_usage`) and the usage chunk reaches
only a client that asked for it (`UsageTap`), every other byte unchanged.
"""

from __future__ import annotations

import math

import msgspec

from controlplane.infrastructure.gocompat import format_go_seconds
from dataplane.admission.bodies import with_include_usage, with_max_tokens
from dataplane.admission.quota import IN_FLIGHT, REQUESTS, TOKENS, LimitState, Quota
from dataplane.admission.tenants import TenantView
from dataplane.admission.ticket import Ticket
from dataplane.admission.tokens import UsageTap, completion_bound, named_bound, prompt_estimate, reservation
from dataplane.disaggregation import GENERATION_PATHS
from dataplane.errors import Refusal, Reply
from dataplane.exchange import Exchange
from dataplane.headers import Headers, request_id_header
from dataplane.metrics import RequestMetrics
from events.config import DEFAULT_TENANT
from events.decisions import Verdict

OBJECTIVE_HEADER = b"x-gateway-inference-objective"
FAIRNESS_HEADER = b"x-gateway-inference-fairness-id"
MAX_FAIRNESS_ID_LENGTH = 128
"""A longer fairness id is clipped: it goes into decision records."""


class Limits:
    """A process's tenant limits: tickets for requests, their tenants' limits checked against `quota`."""

    def __init__(self, quota: Quota, metrics: RequestMetrics) -> None:
        self.quota = quota
        self._metrics = metrics

    def ticket(self, exchange: Exchange) -> Ticket:
        """The request's tenant, priority (its tenant's, lowered by a known objective header,
        never raised) and fairness id."""
        limits = exchange.view.config.tenant_limits
        tenant = limits.tenants.get(exchange.tenant) or limits.tenants[DEFAULT_TENANT]
        priority = tenant.priority
        fairness_id = ""
        for name, value in exchange.headers:
            if name == FAIRNESS_HEADER:
                fairness_id = value[:MAX_FAIRNESS_ID_LENGTH].decode("latin-1")
            elif name == OBJECTIVE_HEADER:
                objective = limits.objectives.get(value.decode("latin-1"))
                if objective is not None and objective < priority:
                    priority = objective
        return Ticket(tenant, priority, fairness_id, self.quota, self._metrics)

    async def take(self, ticket: Ticket, exchange: Exchange) -> Refusal | bytes:
        """Take what the request needs of its tenant's limits: the body to forward when they let
        it through (to the queue, then `counted`), else the 429. A token-counted generation that
        names no `max_tokens` gets one its remaining tokens allow, and a token-counted stream is
        set up to read its usage (`ticket.tap`)."""
        tenant = ticket.tenant
        quota = self.quota
        tenant_limits = exchange.view.config.tenant_limits
        quota.configure(tenant_limits.quota_limits)
        body = exchange.body
        if tenant.counts_tokens:
            completion = named_bound(body)
            generation = exchange.path in GENERATION_PATHS
            if completion is None and not generation:
                completion = tenant_limits.default_max_tokens
            elif completion is None:
                state = quota.state(tenant.name, TOKENS)
                remaining = state.remaining if state is not None else None
                completion = completion_bound(body, tenant_limits.default_max_tokens, remaining)
                body = with_max_tokens(body, completion)
            ticket.prompt_tokens = prompt_estimate(exchange.body)
            ticket.tokens_reserved = reservation(exchange.body, completion, tenant.tokens_per_minute or 0)
            if exchange.stream and generation:
                asked_body = with_include_usage(body)
                ticket.tap = UsageTap(strip=asked_body is not None)
                if asked_body is not None:
                    body = asked_body
        for limit, value in tenant.limits():
            if value is None:
                continue
            amount = ticket.tokens_reserved if limit == TOKENS else 1
            refused = await quota.take(tenant.name, limit, amount)
            if refused is not None:
                ticket.verdict = Verdict.REFUSED
                ticket.refused_by = limit
                ticket.refused_state = refused
                ticket.headers = self._rate_headers(tenant, refused_by=limit)
                self._metrics.admission_refused(tenant.name, ticket.priority, limit)
                return Refusal(_refusal(ticket, limit, refused, exchange.request_id))
            ticket.taken.append((limit, amount))
        ticket.headers = self._rate_headers(tenant)
        return body

    def counted(self, ticket: Ticket) -> None:
        """A request past its tenant's limits (an unlimited tenant's takes nothing) and the queue:
        admitted, it keeps what it took."""
        ticket.admitted = True
        self._metrics.admission_admitted(ticket.tenant.name, ticket.priority)

    def _rate_headers(self, tenant: TenantView, refused_by: str = "") -> Headers:
        """OpenAI's `x-ratelimit-*` headers of the tenant's request and token buckets; a refusal
        by the in-flight limit names that limit too (`-in-flight`, which has no reset), so that
        the answer does not describe only buckets that had room."""
        headers = []
        for limit in (REQUESTS, TOKENS):
            state = self.quota.state(tenant.name, limit)
            if state is None:
                continue
            suffix = limit.encode()
            headers += [
                (b"x-ratelimit-limit-" + suffix, b"%d" % state.limit),
                (b"x-ratelimit-remaining-" + suffix, b"%d" % state.remaining),
                (b"x-ratelimit-reset-" + suffix, _duration(state.reset)),
            ]
        if refused_by == IN_FLIGHT and tenant.max_in_flight is not None:
            headers += [
                (b"x-ratelimit-limit-in-flight", b"%d" % tenant.max_in_flight),
                (b"x-ratelimit-remaining-in-flight", b"0"),
            ]
        return headers


def _duration(seconds: float) -> bytes:
    """OpenAI's reset durations (`1s`, `6m0s`, `20ms`): Go's, to the millisecond."""
    return format_go_seconds(round(seconds, 3)).encode()


def _refusal(ticket: Ticket, limit: str, state: LimitState, request_id: str) -> Reply:
    """The 429, in OpenAI's shape, with when to try again: for a token limit, once the bucket
    holds the request's reservation (a request is admitted at the first token back, but an SDK
    retrying then would only put the tenant deeper in debt)."""
    retry = state.retry
    if limit == TOKENS and state.limit:
        retry = max(retry, (ticket.tokens_reserved - state.remaining) * 60 / state.limit)
    retry = max(retry, 0.001)
    used = state.limit - state.remaining
    message = (
        f"Rate limit reached for tenant {ticket.tenant.name} on {limit.replace('_', ' ')}: "
        f"limit {state.limit}, used {used}. Please try again in {_duration(retry).decode()}."
    )
    body = msgspec.json.encode(
        {"error": {"message": message, "type": "rate_limit_exceeded", "param": None, "code": "rate_limit_exceeded"}}
    )
    headers = [
        (b"content-type", b"application/json"),
        (b"x-content-type-options", b"nosniff"),
        (b"retry-after", b"%d" % math.ceil(retry)),
        (b"retry-after-ms", b"%d" % math.ceil(retry * 1000)),
        request_id_header(request_id),
    ]
    return Reply(429, headers, body)

"""Admission: whose a request is (its tenant, `dataplane.access`), at which priority, and
whether its tenant's limits let it through (`dataplane.quota` holds the quota).

A request's `Ticket` follows it from admission to its end (the ledger's `request_ended` or
`client_left`): what it took (a request, a token reservation, an in-flight slot) is settled
there, tokens to the `usage` the node reported. A refusal is a 429 in OpenAI's shape
(`rate_limit_exceeded`), and every answer of a limited tenant carries OpenAI's
`x-ratelimit-*` headers, so the SDKs' own back-off works.

Tokens are counted only for tenants with `tokens_per_minute`: the reservation is the body's
`max_completion_tokens` or `max_tokens` (else `admission.default_max_tokens`) plus the body's length over
PROMPT_BYTES_PER_TOKEN for the prompt. For a stream the node is asked for usage (`stream_options.include_usage`) and the
usage chunk reaches only a client that asked for it (`UsageTap`), every other byte unchanged.
"""

from __future__ import annotations

import math

import msgspec

from controlplane.infrastructure.gocompat import format_go_seconds
from controlplane.rules.saturation import rank, under_fair_share
from dataplane.admission_queue import QUEUED, QueueOutcome
from dataplane.disaggregation import GENERATION_PATHS
from dataplane.errors import Reply
from dataplane.exchange import Exchange
from dataplane.headers import Headers, request_id_header
from dataplane.metrics import RequestMetrics
from dataplane.quota import IN_FLIGHT, REQUESTS, TOKENS, LimitState, Quota
from dataplane.tenants import TenantView
from events.config import DEFAULT_TENANT
from events.decisions import Admission as AdmissionRecord
from events.decisions import FairShare, Verdict

OBJECTIVE_HEADER = b"x-gateway-inference-objective"
FAIRNESS_HEADER = b"x-gateway-inference-fairness-id"
PROMPT_BYTES_PER_TOKEN = 4
"""The prompt's estimate at admission: a token per this many bytes of body (English text and
JSON run near it; the settlement corrects it)."""
MAX_FAIRNESS_ID_LENGTH = 128
"""A longer fairness id is clipped: it goes into decision records."""


class Ticket:
    """One request's admission: who, at which priority, what it took and how it ended."""

    __slots__ = (
        "tenant", "priority", "fairness_id", "verdict", "refused_by", "refused_state", "queued_ms",
        "saturated_seq", "headroom", "fair_share", "rank", "preemptible", "taken", "admitted", "tokens_reserved",
        "tokens_used", "tap", "headers", "_quota", "_metrics", "_prioritized",
    )  # fmt: skip

    def __init__(self, tenant: TenantView, priority: int, fairness_id: str, quota: Quota, metrics: RequestMetrics):
        self.tenant = tenant
        self.priority = priority
        self.fairness_id = fairness_id
        self.verdict = Verdict.ADMITTED
        self.refused_by = ""
        self.refused_state: LimitState | None = None
        self.queued_ms = 0.0
        self.saturated_seq = 0
        self.headroom = 0
        self.fair_share: FairShare | None = None
        self.rank = rank(priority, False)
        """Its place among the priorities (`saturation.rank`): its priority's, or ahead of it
        when the queue found its tenant under its fair share."""
        self.preemptible = 0
        self.taken: list[tuple[str, int]] = []
        self.admitted = False
        self.tokens_reserved = 0
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

    def queue_outcome(self, outcome: QueueOutcome) -> None:
        """What the gateway's queue made of the request past its tenant's limits: queued for a
        while, or refused (what the limits took is then given back, as for a limit's refusal)."""
        self.queued_ms = round(outcome.queued_ms, 3)
        self.saturated_seq = outcome.saturated_seq
        self.headroom = outcome.headroom
        self.preemptible = outcome.preemptible
        share = self.fair_share = outcome.fair_share
        if share is not None:
            self.rank = rank(self.priority, under_fair_share(share))
        if outcome.refused:
            self.verdict = Verdict.REFUSED
            self.refused_by = outcome.verdict
        elif outcome.verdict == QUEUED:
            self.verdict = Verdict.QUEUED

    def read_usage(self, body: bytes) -> None:
        """A complete answer's `usage`, when the tenant's tokens are counted."""
        if self.tenant.counts_tokens:
            self.tokens_used = usage_tokens(body)

    def end(self, status: int | None) -> None:
        """The request ended (`status` None: the client left first): what it took is settled. A
        request that never got past admission (its limits, then the queue) gives everything back;
        an admitted one keeps its request, gives back its in-flight slot, and settles its tokens
        to the node's `usage`
        (without one: the reservation stands for a 2xx answer, and is given back otherwise)."""
        if self.tap is not None and self.tap.tokens is not None:
            self.tokens_used = self.tap.tokens
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
        return AdmissionRecord(
            tenant=self.tenant.name,
            priority=self.priority,
            fairness_id=self.fairness_id,
            verdict=self.verdict,
            refused_by=self.refused_by,
            limit=state.limit if state else None,
            remaining=state.remaining if state else None,
            reset=round(state.reset, 3) if state else None,
            queued_ms=self.queued_ms,
            tokens_reserved=self.tokens_reserved,
            tokens_used=self.tokens_used,
            saturated_seq=self.saturated_seq,
            headroom=self.headroom,
            fair_share=self.fair_share,
            preemptible=self.preemptible,
        )


class Admission:
    """A process's admission: tickets for requests, their tenants' limits checked against `quota`."""

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

    async def admit(self, ticket: Ticket, exchange: Exchange) -> Reply | None:
        """Take what the request needs of its tenant's limits: None when they let it through (to
        the queue, then `counted`), else the 429.
        A token-counted stream is set up to read its usage (`ticket.tap`)."""
        tenant = ticket.tenant
        quota = self.quota
        quota.configure(exchange.view.config.tenant_limits.quota_limits)
        if tenant.counts_tokens:
            tenant_limits = exchange.view.config.tenant_limits
            ticket.tokens_reserved = _reservation(
                exchange.body, tenant_limits.default_max_tokens, tenant.tokens_per_minute or 0
            )
            if exchange.stream and exchange.path in GENERATION_PATHS:
                asked_body = with_include_usage(exchange.body)
                ticket.tap = UsageTap(strip=asked_body is not None)
                if asked_body is not None:
                    exchange.body = asked_body
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
                return _refusal(ticket, limit, refused, exchange.request_id)
            ticket.taken.append((limit, amount))
        ticket.headers = self._rate_headers(tenant)
        return None

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


# --- tokens: the reservation, the node's usage


class _TokenFields(msgspec.Struct):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


_decode_token_fields = msgspec.json.Decoder(_TokenFields)


def _reservation(body: bytes, default: int, limit: int) -> int:
    """Tokens reserved at admission: the completion's bound (`default` when the body names
    none) and the prompt's estimate, at most the limit."""
    try:
        fields = _decode_token_fields.decode(body)
        completion = fields.max_completion_tokens or fields.max_tokens or default
    except (msgspec.DecodeError, RecursionError):
        completion = default
    return max(1, min(limit, completion + len(body) // PROMPT_BYTES_PER_TOKEN))


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int | None = None

    def tokens(self) -> int:
        return self.total_tokens if self.total_tokens is not None else self.prompt_tokens + self.completion_tokens


class _WithUsage(msgspec.Struct):
    usage: _Usage | None = None


class _UsageChunk(msgspec.Struct):
    choices: list[msgspec.Raw] | None = None
    usage: _Usage | None = None


_decode_with_usage = msgspec.json.Decoder(_WithUsage)
_decode_usage_chunk = msgspec.json.Decoder(_UsageChunk)


def usage_tokens(body: bytes) -> int | None:
    """The prompt plus completion tokens of a complete answer's `usage`, if it has one."""
    try:
        usage = _decode_with_usage.decode(body).usage
    except (msgspec.DecodeError, RecursionError):
        return None
    return None if usage is None else usage.tokens()


class _StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


_decode_members = msgspec.json.Decoder(dict[str, msgspec.Raw])
_decode_stream_options = msgspec.json.Decoder(_StreamOptions | None)
_encode = msgspec.json.Encoder().encode


def with_include_usage(body: bytes) -> bytes | None:
    """The body with `stream_options.include_usage` true (every other member's bytes kept), or
    None when the client asked for usage itself (or the body is not one to rewrite)."""
    try:
        members = _decode_members.decode(body)
        options_raw = members.get("stream_options")
        options = _decode_stream_options.decode(options_raw) if options_raw is not None else None
        if options is not None and options.include_usage:
            return None
        option_members = _decode_members.decode(options_raw) if options is not None else {}
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    option_members["include_usage"] = msgspec.Raw(b"true")
    members["stream_options"] = msgspec.Raw(_encode(option_members))
    return _encode(members)


def with_priority(body: bytes, request_rank: int) -> bytes:
    """The body with vLLM's `priority` member set to the negated `request_rank` (twice the
    admission priority, one more ahead of its priority: `saturation.rank`; vLLM handles lower
    values first), every other member's bytes kept. A client's own integer `priority` stays when
    it is not ahead of that: a client may lower its priority, never raise it. A body that is not a
    JSON object goes as it is (the node answers it)."""
    try:
        members = _decode_members.decode(body)
        asked = msgspec.json.decode(members["priority"]) if "priority" in members else None
    except (msgspec.DecodeError, RecursionError):
        return body
    node_priority = -request_rank
    if type(asked) is int and asked >= node_priority:
        return body
    members["priority"] = msgspec.Raw(_encode(node_priority))
    return _encode(members)


_EVENT_END = b"\n\n"


class UsageTap:
    """Reads a stream's usage chunk (`choices` empty, `usage` set) as the events go by; with
    `strip`, leaves it out of what the client gets (the gateway asked for it, not the client),
    and holds back only an event not yet complete. Every other byte goes on unchanged."""

    __slots__ = ("strip", "tokens", "_pending")

    def __init__(self, strip: bool) -> None:
        self.strip = strip
        self.tokens: int | None = None
        self._pending = b""

    def feed(self, piece: bytes) -> bytes:
        """What of `piece` goes to the client now."""
        data = self._pending + piece if self._pending else piece
        end = data.rfind(_EVENT_END)
        if end < 0:
            self._pending = data
            return piece if not self.strip else b""
        end += len(_EVENT_END)
        complete, self._pending = data[:end], data[end:]
        if b'"prompt_tokens"' not in complete:
            return piece if not self.strip else complete
        kept = []
        for event in complete.split(_EVENT_END)[:-1]:
            if self._is_usage(event) and self.strip:
                continue
            kept.append(event + _EVENT_END)
        return piece if not self.strip else b"".join(kept)

    def finish(self) -> bytes:
        """What is left held back when the stream ends (an unfinished event, unchanged)."""
        rest, self._pending = self._pending, b""
        return rest if self.strip else b""

    def _is_usage(self, event: bytes) -> bool:
        if b'"prompt_tokens"' not in event:
            return False
        data = event.partition(b"data:")[2].strip()
        try:
            chunk = _decode_usage_chunk.decode(data)
        except (msgspec.DecodeError, RecursionError):
            return False
        if chunk.usage is None:
            return False
        self.tokens = chunk.usage.tokens()
        return not chunk.choices

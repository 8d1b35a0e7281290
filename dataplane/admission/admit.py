"""The admission stage of the request path: a request's tenant's limits (`limits`), then the
gateway's queue while its model's pool has no room (`queue`, by the rule `occupancy` asks).
It returns the request `Admitted` (the snapshot to route it on, the body to forward) or its
`Refusal` (a 429, or the queue's 429 or 503).
"""

from __future__ import annotations

import trio

from controlplane.rules.saturation import priority_headroom
from dataplane.admission.limits import Limits
from dataplane.admission.queue import QUEUE_FULL, QUEUED, AdmissionQueue, QueueOutcome
from dataplane.admission.ticket import Ticket
from dataplane.errors import QUEUE_DEADLINE_PASSED, QUEUE_IS_FULL, RETRY_AFTER, RETRY_AFTER_MS, Refusal, refusal
from dataplane.exchange import Exchange
from dataplane.views import SnapshotView, SnapshotViews


class Admitted:
    """A request past admission: the snapshot it is routed on (its arrival's; after a wait in the
    queue, the one current when it left), and its body as forwarded (with what its tenant's
    token limit asked of it)."""

    __slots__ = ("view", "body")

    def __init__(self, view: SnapshotView, body: bytes) -> None:
        self.view = view
        self.body = body


class Admission:
    """The stage: tickets for requests, and their admission."""

    def __init__(self, limits: Limits, queue: AdmissionQueue, views: SnapshotViews) -> None:
        self._limits = limits
        self._queue = queue
        self._views = views
        self.ticket = limits.ticket
        """A request's `Ticket` as it arrives (`Limits.ticket`)."""

    async def admit(self, exchange: Exchange, ticket: Ticket, routable: bool) -> Admitted | Refusal:
        """Through the tenant's limits (a limited tenant's), then, when the model has nodes to
        pick from (`routable`) and the queue is on, through the queue."""
        body = exchange.body
        if ticket.tenant.limited:
            taken = await self._limits.take(ticket, exchange)
            if isinstance(taken, Refusal):
                return taken
            body = taken
        view = exchange.view
        if routable and view.config.admission.queue:
            waited = await self._wait(exchange, ticket)
            if isinstance(waited, Refusal):
                return waited
            view = waited
        self._limits.counted(ticket)
        return Admitted(view, body)

    async def _wait(self, exchange: Exchange, ticket: Ticket) -> SnapshotView | Refusal:
        """The gateway's queue: at once while the model's pool has room, else after waiting,
        until the tenant's `max_queue_seconds` (else `[admission]`'s); or its refusal. A request
        that waited is routed on the snapshot of now, as if it had just arrived."""
        tenant = ticket.tenant
        view = exchange.view
        deadline = tenant.max_queue_seconds
        if deadline is None:
            deadline = view.config.admission.max_queue_seconds
        arrived = trio.current_time()
        try:
            outcome = await self._queue.admit(
                view, exchange.model, tenant.name, ticket.priority, ticket.fairness_id, deadline
            )
        except trio.Cancelled:  # the client left the queue: the record says how long it waited
            waited_ms = 1000 * (trio.current_time() - arrived)
            headroom = priority_headroom(view.config.config, ticket.priority)
            ticket.queued(QueueOutcome(QUEUED, waited_ms, view.snapshot.seq, headroom))
            raise
        ticket.queued(outcome)
        if outcome.refused:
            error = QUEUE_IS_FULL if outcome.verdict == QUEUE_FULL else QUEUE_DEADLINE_PASSED
            return refusal(error, exchange.request_id, RETRY_AFTER, RETRY_AFTER_MS)
        if outcome.verdict == QUEUED:
            return self._views.current()
        return view

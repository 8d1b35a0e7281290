"""The admission queue: while every node that could serve a model is saturated
(`controlplane.rules.saturation`), its requests wait here, in the gateway, where they can be ordered,
bounded and cancelled, rather than in a node's own queue.

One queue per process (workers each have theirs, as they have their in-flight counts), one line
per model. A waiting request is released when its model's pool has room again: when an attempt
ends (`AdmissionQueue.freed`, from the ledger) or when the control plane's snapshot changes (a
new load scrape; a watcher task looks every SNAPSHOT_POLL_SECONDS while anything waits). The
next request released is the one of the highest rank (its priority, then its tenant's fair share:
below); within a rank, tenants take turns (round robin), so a tenant with many waiting requests
does not starve one with few; within a tenant, its fairness ids take turns; within one of those,
first come first served.

A request waits at most its `max_queue_seconds`, then is refused (503 with Retry-After); a full
queue (`queue_size` in all, `tenant_queue_size` per tenant) refuses at once (429); a client that
goes away leaves the queue at once (its request is cancelled). A released request counts
against its model's room until its first attempt begins (`pending`), so one free place releases
one request; a node without a `max_in_flight` bound whose scrape says it is not saturated
has room for any number, until the next scrape says otherwise. A node its scrape says is
saturated has room for as many requests as this process ended on it since that scrape
(`saturation.free_places`): the queue notes its in-flight count to a node when it first sees the
node's new scrape.

With `[admission] priority_headroom`, a request below the highest configured tenant priority
finds a node with a `max_in_flight` full that many places early (`saturation.priority_headroom`):
those places go only to the top priority, which the line releases first anyway, so a top-priority
request finds one at once instead of waiting for the next request to end.

The line orders requests by `saturation.rank`, not by priority alone: within a priority, a
request whose tenant holds less than its fair share of that priority's requests in flight
(`saturation.under_fair_share`, counted as it arrives) goes ahead of the others. On a node with
priority scheduling, this process's requests of a lower rank than the one asking hold no place
(the node preempts them for it, `saturation.free_places`). For both the queue counts the attempts
in flight, by node and rank and by priority and tenant (`attempt_started`, `attempt_ended`, from
the ledger).
"""

from __future__ import annotations

import math
from collections import deque

import trio

from controlplane.rules.routing import pick_pool
from controlplane.rules.saturation import priority_headroom, rank, under_fair_share
from dataplane.control import ControlPlaneView
from dataplane.metrics import RequestMetrics
from dataplane.admission.occupancy import Occupancy
from dataplane.views import SnapshotView, SnapshotViews
from events.decisions import FairShare

SNAPSHOT_POLL_SECONDS = 0.05
"""How often, while requests wait, the queue looks whether a new snapshot gives a pool room."""

ADMITTED, QUEUED, QUEUE_DEADLINE, QUEUE_FULL = "admitted", "queued", "queue_deadline", "queue_full"
"""A `QueueOutcome`'s verdict: admitted at once, admitted after waiting, or refused because the
wait reached its deadline or the queue was full."""


class QueueOutcome:
    """What the queue did with one request: its verdict, how long it waited, the seq of the
    snapshot on which its model's pool was saturated (0: it was not), the places per node its
    priority left free (`saturation.priority_headroom`), the in-flight counts that say whether
    its tenant was under its fair share, and the lower-ranked requests it may preempt."""

    __slots__ = ("verdict", "queued_ms", "saturated_seq", "headroom", "fair_share", "preemptible")

    def __init__(
        self,
        verdict: str,
        queued_ms: float = 0.0,
        saturated_seq: int = 0,
        headroom: int = 0,
        fair_share: FairShare | None = None,
        preemptible: int = 0,
    ) -> None:
        self.verdict = verdict
        self.queued_ms = queued_ms
        self.saturated_seq = saturated_seq
        self.headroom = headroom
        self.fair_share = fair_share
        """None when no other tenant of its priority had a request in flight."""
        self.preemptible = preemptible
        """The requests of lower ranks in flight on the pool's priority-scheduled nodes when it
        was admitted, which held it no place (the nodes preempt them for it)."""

    @property
    def refused(self) -> bool:
        return self.verdict in (QUEUE_DEADLINE, QUEUE_FULL)


ADMITTED_AT_ONCE = QueueOutcome(ADMITTED)


class _Waiter:
    __slots__ = ("model", "tenant", "fairness_id", "priority", "rank", "released", "preemptible")

    def __init__(self, model: str, tenant: str, fairness_id: str, priority: int, rank: int) -> None:
        self.model = model
        self.tenant = tenant
        self.fairness_id = fairness_id
        self.priority = priority
        self.rank = rank
        self.released = trio.Event()
        self.preemptible = 0


class _Band:
    """The requests of one rank for one model: tenants in turn, each tenant's fairness ids in
    turn, each fairness id's requests in order. A dict keeps the turn: whoever was just served
    goes to its end."""

    __slots__ = ("tenants",)

    def __init__(self) -> None:
        self.tenants: dict[str, dict[str, deque[_Waiter]]] = {}

    def push(self, waiter: _Waiter) -> None:
        flows = self.tenants.setdefault(waiter.tenant, {})
        flows.setdefault(waiter.fairness_id, deque()).append(waiter)

    def pop(self) -> _Waiter:
        tenant, flows = next(iter(self.tenants.items()))
        fairness_id, waiters = next(iter(flows.items()))
        waiter = waiters.popleft()
        del flows[fairness_id]
        if waiters:
            flows[fairness_id] = waiters
        del self.tenants[tenant]
        if flows:
            self.tenants[tenant] = flows
        return waiter

    def remove(self, waiter: _Waiter) -> None:
        flows = self.tenants[waiter.tenant]
        waiters = flows[waiter.fairness_id]
        waiters.remove(waiter)
        if not waiters:
            del flows[waiter.fairness_id]
            if not flows:
                del self.tenants[waiter.tenant]


class _Line:
    """One model's waiting requests, by rank."""

    __slots__ = ("bands", "count")

    def __init__(self) -> None:
        self.bands: dict[int, _Band] = {}
        self.count = 0

    def push(self, waiter: _Waiter) -> None:
        band = self.bands.get(waiter.rank)
        if band is None:
            band = self.bands[waiter.rank] = _Band()
        band.push(waiter)
        self.count += 1

    def pop(self) -> _Waiter:
        top = max(self.bands)
        band = self.bands[top]
        waiter = band.pop()
        self._counted_out(top, band)
        return waiter

    def remove(self, waiter: _Waiter) -> None:
        band = self.bands[waiter.rank]
        band.remove(waiter)
        self._counted_out(waiter.rank, band)

    def _counted_out(self, band_rank: int, band: _Band) -> None:
        self.count -= 1
        if not band.tenants:
            del self.bands[band_rank]


class AdmissionQueue:
    """The process's queue (see the module's docstring), admitting by the room `occupancy`
    finds (`Occupancy.free_places`)."""

    def __init__(
        self, control_plane: ControlPlaneView, views: SnapshotViews, occupancy: Occupancy, metrics: RequestMetrics
    ) -> None:
        self._control_plane = control_plane
        self._views = views
        self._occupancy = occupancy
        self._metrics = metrics
        self._lines: dict[str, _Line] = {}
        self._pending: dict[str, int] = {}
        """Requests released for each model whose first attempt has not begun yet."""
        self._tenants: dict[str, int] = {}
        """Requests waiting, by tenant."""
        self.waiting = 0
        """Requests waiting, in all: the ledger's cheap test before `freed`."""
        self._watching = False

    async def admit(
        self, view: SnapshotView, model: str, tenant: str, priority: int, fairness_id: str, max_queue_seconds: float
    ) -> QueueOutcome:
        """Admit a request for `model` (routed on `view`, whose config has the queue on) now,
        after waiting, or refuse it. A cancellation (the client gone) leaves the queue."""
        line = self._lines.get(model)
        headroom = priority_headroom(view.config.config, priority)
        share = self._occupancy.fair_share(tenant, priority)
        request_rank = rank(priority, share is not None and under_fair_share(share))
        if line is None or max(line.bands) < request_rank:
            places, preemptible = self._places(model, view, request_rank)
            if places > 0:
                if headroom or share or preemptible:
                    return QueueOutcome(ADMITTED, headroom=headroom, fair_share=share, preemptible=preemptible)
                return ADMITTED_AT_ONCE
        saturated_seq = view.snapshot.seq
        admission = view.config.admission
        if self.waiting >= admission.queue_size or self._tenants.get(tenant, 0) >= admission.tenant_queue_size:
            self._metrics.admission_refused(tenant, priority, QUEUE_FULL)
            return QueueOutcome(QUEUE_FULL, saturated_seq=saturated_seq, headroom=headroom, fair_share=share)
        waiter = _Waiter(model, tenant, fairness_id, priority, request_rank)
        if line is None:
            line = self._lines[model] = _Line()
        line.push(waiter)
        self.waiting += 1
        self._tenants[tenant] = self._tenants.get(tenant, 0) + 1
        self._metrics.admission_queued(tenant, priority, 1)
        self._release(model)
        if self.waiting and not self._watching:
            self._watching = True
            trio.lowlevel.spawn_system_task(self._watch_snapshots)
        started = trio.current_time()
        try:
            with trio.move_on_after(max_queue_seconds):
                await waiter.released.wait()
        except BaseException:  # the client went away
            self._metrics.admission_waited(tenant, priority, trio.current_time() - started)
            self._leave(waiter)
            raise
        waited = trio.current_time() - started
        self._metrics.admission_waited(tenant, priority, waited)
        if waiter.released.is_set():
            self._pending[model] -= 1
            return QueueOutcome(QUEUED, 1000 * waited, saturated_seq, headroom, share, waiter.preemptible)
        self._leave(waiter)
        self._metrics.admission_refused(tenant, priority, QUEUE_DEADLINE)
        return QueueOutcome(QUEUE_DEADLINE, 1000 * waited, saturated_seq, headroom, share)

    def freed(self) -> None:
        """An attempt ended, so a node may have a place again: release whom it lets in."""
        for model in list(self._lines):
            self._release(model)

    def _leave(self, waiter: _Waiter) -> None:
        """`waiter` goes without being served: out of its line, or, when it was released
        already, its place goes to the next one."""
        model = waiter.model
        if waiter.released.is_set():
            self._pending[model] -= 1
            self._release(model)
            return
        line = self._lines[model]
        line.remove(waiter)
        if not line.count:
            del self._lines[model]
        self._counted_out(waiter)

    def _counted_out(self, waiter: _Waiter) -> None:
        self.waiting -= 1
        left = self._tenants[waiter.tenant] - 1
        if left:
            self._tenants[waiter.tenant] = left
        else:
            del self._tenants[waiter.tenant]
        self._metrics.admission_queued(waiter.tenant, waiter.priority, -1)

    def _release(self, model: str) -> None:
        """Release the waiting requests for `model`, next first, while its pool has room for the
        next one's rank (the line gives the highest first: once the next one finds no room, no
        one after it, of its rank or lower, would)."""
        line = self._lines.get(model)
        if line is None:
            return
        view = self._views.current()
        while line.count:
            places, preemptible = self._places(model, view, max(line.bands))
            if places < 1:
                break
            waiter = line.pop()
            waiter.preemptible = preemptible
            self._counted_out(waiter)
            self._pending[model] = self._pending.get(model, 0) + 1
            waiter.released.set()
        if not line.count:
            del self._lines[model]

    def _places(self, model: str, view: SnapshotView, request_rank: int) -> tuple[float, int]:
        """The requests of rank `request_rank` that `model`'s pool takes now, less those released for it
        that have not begun (inf when nothing holds them back: the queue is off, a reload took it
        away, or no node to pick, routing answers the request at once); and the requests of lower
        ranks in flight on its priority-scheduled nodes, which hold them no place."""
        admission = view.config.admission
        if not admission.queue:
            return math.inf, 0
        pool = pick_pool(view.route(model).candidates, self._control_plane.now())
        if not pool:
            return math.inf, 0
        places, preemptible = self._occupancy.free_places(view, pool, request_rank)
        return places - self._pending.get(model, 0), preemptible

    async def _watch_snapshots(self) -> None:
        """While requests wait: look at the current snapshot every SNAPSHOT_POLL_SECONDS (a
        scrape may have given a pool room, or an offline mark ended)."""
        try:
            while self.waiting:
                await trio.sleep(SNAPSHOT_POLL_SECONDS)
                self.freed()
        finally:
            self._watching = False


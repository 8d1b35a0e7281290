"""What this process has in flight, and the room it leaves: the attempts in progress by node (what
the balancers weigh), by node and rank (what a priority-scheduled node would preempt), by
priority and tenant (fair share), and the in-flight count to each node when its scrape was
first seen here. From them, the one rule for a node's room (`controlplane.rules.saturation.room`)
answers both the admission queue (`free_places`: does the model's pool take one more?) and every
pick (`full`: which candidates have no place for this request?).

One per process (workers each have theirs); the data plane runs in one trio thread, so nothing
here needs a lock.
"""

from __future__ import annotations

from collections.abc import Sequence

from controlplane.rules.saturation import free_places, priority_headroom, room
from dataplane.views import SnapshotView, SnapshotViews
from events.decisions import FairShare
from events.state import NodeState


class Occupancy:
    """This process's attempts in flight and its notes of the nodes' scrapes (see the module)."""

    __slots__ = ("in_flight", "_views", "_by_rank", "_by_tenant", "_scraped_at", "_in_flight_at_scrape", "_config")

    def __init__(self, views: SnapshotViews) -> None:
        self.in_flight: dict[str, int] = {}
        """Attempts in progress by node: the balancers' counts."""
        self._views = views
        self._by_rank: dict[str, dict[int, int]] = {}
        self._by_tenant: dict[int, dict[str, int]] = {}
        self._scraped_at: dict[str, float | None] = {}
        self._in_flight_at_scrape: dict[str, int] = {}
        """Each node's last scrape seen here, and the in-flight count to the node when it was
        first seen (`saturation.room`); emptied when the config changes."""
        self._config: object = None

    def attempt_started(self, ip: str, request_rank: int, priority: int, tenant: str) -> None:
        self.in_flight[ip] = self.in_flight.get(ip, 0) + 1
        _count(self._by_rank, ip, request_rank, 1)
        _count(self._by_tenant, priority, tenant, 1)

    def note_scrape(self, ip: str) -> None:
        """An attempt on `ip` is ending: if the node's scrape is new here, note the in-flight
        count to it before the count drops (the place the attempt gives back is then counted
        against that scrape)."""
        view = self._views.current()
        node = view.snapshot.nodes.get(ip)
        if node is not None:
            self._note_scrapes(view, (node,))

    def attempt_ended(self, ip: str, request_rank: int, priority: int, tenant: str) -> None:
        left = self.in_flight[ip] - 1
        if left:
            self.in_flight[ip] = left
        else:
            del self.in_flight[ip]
        _count(self._by_rank, ip, request_rank, -1)
        _count(self._by_tenant, priority, tenant, -1)

    def free_places(self, view: SnapshotView, pool: Sequence[NodeState], request_rank: int) -> tuple[float, int]:
        """The requests of rank `request_rank` that `pool` takes now (`saturation.free_places`,
        the scrapes counted), and the requests of lower ranks in flight on its priority-scheduled
        nodes, which hold them no place."""
        self._note_scrapes(view, pool)
        preemptible = self._preemptible(view, pool, request_rank)
        places = free_places(
            pool,
            view.config.admission,
            view.config.max_in_flight,
            self.in_flight,
            self._in_flight_at_scrape,
            priority_headroom(view.config.config, request_rank // 2),
            preemptible,
        )
        return places, sum(preemptible.values())

    def full(self, view: SnapshotView, pool: Sequence[NodeState], request_rank: int) -> frozenset[str]:
        """The nodes of `pool` without a place for a request of rank `request_rank` now
        (`saturation.room`): a pick passes over them while another has one. The scrapes count
        while the gateway queues (`[admission] queue`); the caller asks only then or when a node
        has a `max_in_flight` (else none is ever full)."""
        config = view.config
        admission = config.admission
        scrape = admission if admission.queue else None
        if scrape is not None:
            self._note_scrapes(view, pool)
        preemptible = self._preemptible(view, pool, request_rank)
        headroom = priority_headroom(config.config, request_rank // 2)
        return frozenset(
            node.ip
            for node in pool
            if room(
                node, scrape, config.max_in_flight.get(node.ip), self.in_flight.get(node.ip, 0),
                self._in_flight_at_scrape.get(node.ip), headroom, preemptible.get(node.ip, 0),
            ) < 1  # fmt: skip
        )

    def fair_share(self, tenant: str, priority: int) -> FairShare | None:
        """The counts by which `tenant` holds less than its fair share of the requests of
        `priority` in flight or not; None when no other tenant has one in flight."""
        tenants = self._by_tenant.get(priority)
        if not tenants or (len(tenants) == 1 and tenant in tenants):
            return None
        return FairShare(tenants.get(tenant, 0), sum(tenants.values()), len(tenants) + (tenant not in tenants))

    def _preemptible(self, view: SnapshotView, pool: Sequence[NodeState], request_rank: int) -> dict[str, int]:
        """For each priority-scheduled node of `pool`: this process's attempts in flight there of
        a lower rank than `request_rank`."""
        preemptible = {}
        scheduled = view.config.priority_scheduled
        if not scheduled:
            return preemptible
        for node in pool:
            counts = self._by_rank.get(node.ip)
            if counts and node.ip in scheduled:
                lower = sum(count for their_rank, count in counts.items() if their_rank < request_rank)
                if lower:
                    preemptible[node.ip] = lower
        return preemptible

    def _note_scrapes(self, view: SnapshotView, pool: Sequence[NodeState]) -> None:
        """Note this process's in-flight count to each node of `pool` whose scrape is new here."""
        if view.config is not self._config:
            self._config = view.config
            self._scraped_at.clear()
            self._in_flight_at_scrape.clear()
        for node in pool:
            scraped_at = node.load.scraped_at
            if node.ip not in self._scraped_at or self._scraped_at[node.ip] != scraped_at:
                self._scraped_at[node.ip] = scraped_at
                self._in_flight_at_scrape[node.ip] = self.in_flight.get(node.ip, 0)


def _count(counts: dict, key: object, inner: object, change: int) -> None:
    """Add `change` to `counts[key][inner]`, leaving out what falls to zero."""
    counted = counts.get(key)
    if counted is None:
        counted = counts[key] = {}
    left = counted.get(inner, 0) + change
    if left:
        counted[inner] = left
    else:
        del counted[inner]
        if not counted:
            del counts[key]

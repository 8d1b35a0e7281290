"""Saturation: whether every node that could serve a model is too busy for another request, so
that admission holds the request in the gateway (`dataplane.admission.queue`) instead of in a node's
own queue, where the gateway can neither reorder nor cancel it.

A node is saturated when its last scrape says so (`[admission] saturation_waiting` requests
waiting, or `saturation_kv_cache` of its KV cache used), or when this gateway process has its
`[[nodes]] max_in_flight` requests in flight to it, less `[admission] priority_headroom` for a
request of a priority below the highest configured tenant's (`priority_headroom`): those places
are kept free for the higher priorities. `room` is the one rule for that, a pure function of a
node's state and the in-flight counts: the admission queue admits by it (`free_places`), every
policy's pick passes over the nodes it finds without a place (`policies.choose`), and the
decision record marks those (`CandidateScore.full`) for `verify` and `whatif` to pick again;
`interlock explain` asks the scrape's part again of the state at the seq a record names.

A node run with vLLM's priority scheduling (`[[nodes]] scheduling = "priority"`) preempts a
running request for one of a better rank: for a request, the requests of a lower `rank` this
process has in flight there hold no place, neither of its `max_in_flight` nor of those its scrape
shows taken. The top priority thus reaches a node full of lower ones at once, and the node,
not the gateway's queue, makes it room. Within one priority, a request whose tenant holds less
than its fair share of that priority's requests in flight ranks ahead of the others
(`under_fair_share`): a tenant that sends little is not held behind one that floods the nodes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from events.config import AdmissionConfig, Config
from events.decisions import FairShare
from events.state import NodeState


def scraped_reason(node: NodeState, admission: AdmissionConfig) -> str:
    """Why `node`'s last scrape says it is saturated, "" when it does not (or its load is unknown)."""
    load = node.load
    if not load.known:
        return ""
    if load.waiting >= admission.saturation_waiting:
        return f"{load.waiting:g} waiting >= saturation_waiting {admission.saturation_waiting}"
    usage = load.kv_cache_usage
    if usage is not None and usage >= admission.saturation_kv_cache:
        return f"KV cache {usage:.2f} >= saturation_kv_cache {admission.saturation_kv_cache:g}"
    return ""


def under_fair_share(share: FairShare) -> bool:
    """Whether a tenant with `share.tenant_in_flight` of the `share.priority_in_flight` requests of
    its priority in flight, of `share.tenants` tenants, would hold fewer than their average with
    one more: then its request goes ahead of the others of its priority. A tenant alone never does."""
    return (share.tenant_in_flight + 1) * share.tenants < share.priority_in_flight + 1


def rank(priority: int, ahead: bool) -> int:
    """A request's place in the gateway's queue and, negated, the `priority` a node with priority
    scheduling gets: twice its priority, one more when it goes ahead of the others of its
    priority (`under_fair_share`). Higher ranks go first."""
    return 2 * priority + ahead


def priority_headroom(config: Config, priority: int) -> int:
    """The in-flight places per node (of those with a `max_in_flight`) that a request of
    `priority` leaves free: `[admission] priority_headroom` below the highest priority of the
    configured tenants, 0 at it (or above)."""
    headroom = config.admission.priority_headroom
    if not headroom:
        return 0
    top = max((tenant.priority for tenant in config.tenants), default=0)
    return headroom if priority < top else 0


def room(
    node: NodeState,
    scrape: AdmissionConfig | None,
    limit: int | None,
    in_flight: int,
    in_flight_at_scrape: int | None = None,
    headroom: int = 0,
    preemptible: int = 0,
) -> float:
    """The one rule for a node's room: how many more requests of a given rank `node` takes now
    (inf: no bound holds them back). The queue admits by it (`free_places`) and every policy's
    pick passes over the nodes it finds without room (`policies.choose`).

    `limit` is the node's `max_in_flight` (None: none), of which a request below the top
    priority leaves `headroom` places free (`priority_headroom`); this process has `in_flight`
    requests there, of which `preemptible` are of a lower rank on a priority-scheduled node: the
    node preempts them for this one, so they free their places. `scrape` is `[admission]` when
    the node's scrape counts (the gateway queues: without the queue, a node's own queue is where
    requests wait), else None.

    A scrape is older than the requests that ended since: each request of this process that
    ended on the node after its scrape (its in-flight count then, `in_flight_at_scrape`, less the
    count now) gives back a place the scrape still shows taken, one waiting request or the KV
    cache of one. Without that, a node whose batch empties would stay saturated, and idle,
    until its next scrape."""
    places = math.inf if limit is None else limit - headroom - (in_flight - preemptible)
    if scrape is not None and scraped_reason(node, scrape):
        at_scrape = in_flight if in_flight_at_scrape is None else in_flight_at_scrape
        freed = max(0, at_scrape - in_flight) + preemptible
        places = min(places, freed)
        excess_waiting = node.load.waiting - freed - scrape.saturation_waiting
        if excess_waiting >= 0:
            places = 0
        elif node.load.waiting >= scrape.saturation_waiting:
            places = min(places, -excess_waiting)
    return max(0, places)


def free_places(
    nodes: Iterable[NodeState],
    admission: AdmissionConfig,
    max_in_flight: Mapping[str, int],
    in_flight: Mapping[str, int],
    in_flight_at_scrape: Mapping[str, int],
    headroom: int = 0,
    preemptible: Mapping[str, int] = {},
) -> float:
    """How many more requests `nodes` (a model's pick pool) take before every one is saturated
    (each node's `room`, its scrape counted): 0 when all are; inf when one is not and has no
    `max_in_flight`. `preemptible` counts, for each priority-scheduled node, the requests in
    flight there of a lower rank than the one asking."""
    places = 0.0
    for node in nodes:
        ip = node.ip
        places += room(
            node, admission, max_in_flight.get(ip), in_flight.get(ip, 0), in_flight_at_scrape.get(ip), headroom,
            preemptible.get(ip, 0),
        )  # fmt: skip
        if places == math.inf:
            return places
    return places

"""Saturation: whether every node that could serve a model is too busy for another request, so
that admission holds the request in the gateway (`dataplane.admission`) instead of in a node's
own queue, where the gateway can neither reorder nor cancel it.

A node is saturated when its last scrape says so (`[admission] saturation_waiting` requests
waiting, or `saturation_kv_cache` of its KV cache used), or when this gateway process has its
`[[nodes]] max_in_flight` requests in flight to it. A pure function of the snapshot and the
in-flight counts: the data plane asks it for every request, and `interlock explain` asks it
again of the state at the seq a record names (where the in-flight counts are not recorded).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from events.config import AdmissionConfig
from events.state import NodeState


def saturation_reason(
    node: NodeState, admission: AdmissionConfig, max_in_flight: int | None, in_flight: int | None
) -> str:
    """Why `node` is saturated, "" when it is not. `in_flight` None: this process's count is
    not known (`explain`), so only the scraped figures can say."""
    load = node.load
    if load.known:
        if load.waiting >= admission.saturation_waiting:
            return f"{load.waiting:g} waiting >= saturation_waiting {admission.saturation_waiting}"
        usage = load.kv_cache_usage
        if usage is not None and usage >= admission.saturation_kv_cache:
            return f"KV cache {usage:.2f} >= saturation_kv_cache {admission.saturation_kv_cache:g}"
    if max_in_flight is not None and in_flight is not None and in_flight >= max_in_flight:
        return f"{in_flight} in flight >= max_in_flight {max_in_flight}"
    return ""


def free_places(
    nodes: Iterable[NodeState],
    admission: AdmissionConfig,
    max_in_flight: Mapping[str, int],
    in_flight: Mapping[str, int],
) -> float:
    """How many more requests `nodes` (a model's pick pool) take before every one is saturated:
    0 when all are; a node that is not, without a `max_in_flight`, takes any number (inf)."""
    places = 0.0
    for node in nodes:
        limit = max_in_flight.get(node.ip)
        count = in_flight.get(node.ip, 0)
        if saturation_reason(node, admission, limit, count):
            continue
        if limit is None:
            return math.inf
        places += limit - count
    return places

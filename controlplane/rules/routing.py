"""Which nodes may serve a model, and why the others may not (plinth §4.3 steps 4-6).

The data plane, `interlock explain` and `interlock whatif` all decide through these functions
(`Route`, then `pick_pool`), so an explanation of a recorded moment is the decision the live
gateway made; a policy (`controlplane.rules.balancer`) then chooses within the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence

import msgspec

from events.decisions import Exclusion
from events.state import ClusterState, Discovery, Health, NodeState

NOT_IN_RING = "not in ring"
EXCLUDED_DEAD = "dead"
EXCLUDED_OFFLINE = "offline"
"""Exclusion reasons beyond the model filter's (`missing`, `empty`, `expired`)."""

# plinth's two 503 texts (§4.3), the client's answer when routing finds no node: no node in the
# ring pool serves the model, or none of those that do could be used (dead, offline, or failed).
NO_HEALTHY_NODE = "no healthy node available"
NO_REACHABLE_NODE = "no reachable node available"


def model_ring(state: ClusterState, model: str) -> str:
    """The ring `model` is routed to ("": the ring-less nodes); the one place that looks it up."""
    return state.config.model_ring(model) if state.config is not None else ""


def ring_members(state: ClusterState, ring: str) -> list[NodeState]:
    """The nodes of `ring` ("": every ring-less node), status not considered."""
    return [node for node in state.nodes.values() if node.ring == ring]


def ring_pool(state: ClusterState, model: str) -> list[NodeState]:
    """plinth's filterByRing: the model's ring, else every ring-less node (status not considered)."""
    return ring_members(state, model_ring(state, model))


def filter_by_model(pool: list[NodeState], model: str) -> tuple[list[NodeState], list[tuple[NodeState, str]]]:
    """GH-31's model filter: the nodes that may serve `model`, and each dropped node with its reason."""
    kept: list[NodeState] = []
    dropped: list[tuple[NodeState, str]] = []
    for node in pool:
        reason = node.models.exclusion_reason(model)
        if reason:
            dropped.append((node, reason))
        else:
            kept.append(node)
    return kept, dropped


def is_unknown_model(state: ClusterState, pool: list[NodeState], model: str) -> bool:
    """A model nothing here could serve: not configured, in no list a node of its ring pool
    gave (last lists included), and no node of the pool untried (which could still list it)."""
    if state.config is not None and any(entry.name == model for entry in state.config.models.available):
        return False
    return not any(node.models.state == Discovery.UNTRIED or model in node.models.listed for node in pool)


def rings_listing(state: ClusterState, model: str) -> tuple[str, ...]:
    """The rings whose nodes list `model`, in node order: where an unknown model could be served
    if the config routed it there (a model is routed to a ring only when configured so)."""
    return tuple(dict.fromkeys(node.ring for node in state.nodes.values() if node.ring and model in node.models.listed))


def unavailable_reason(node: NodeState, now: float) -> str:
    """Why a pick passes over a node the model filter kept (`dead` or `offline`), else ""."""
    if node.status == Health.DEAD:
        return EXCLUDED_DEAD
    if node.is_offline(now):
        return EXCLUDED_OFFLINE
    return ""


def pick_pool(
    candidates: Sequence[NodeState],
    now: float,
    tried: Container[str] = (),
    passed_over: Callable[[str, str], None] | None = None,
) -> list[NodeState]:
    """The nodes a pick chooses among (plinth's balancer pool), the one answer the data plane,
    `explain` and `whatif` share: of the candidates the model filter kept, those not `tried` yet
    and neither dead nor offline at `now`, the healthy ones, else the degraded ones. Each
    candidate passed over as dead or offline is told to `passed_over` with its reason."""
    healthy: list[NodeState] = []
    degraded: list[NodeState] = []
    for node in candidates:
        if node.ip in tried:
            continue
        reason = unavailable_reason(node, now)
        if reason:
            if passed_over is not None:
                passed_over(node.ip, reason)
        elif node.status == Health.HEALTHY:
            healthy.append(node)
        elif not healthy:  # degraded, wanted only while no candidate is healthy
            degraded.append(node)
    return healthy or degraded


class Route:
    """One model's routing on one state, before any pick: its ring, the ring pool, the candidates
    the model filter keeps and those it drops (with their reasons); when no candidate is left,
    whether the model is unknown (`is_unknown_model`). When a candidate has the role `prefill`
    or `decode` (`NodeConfig.role`), a generation is served in two legs: `legs` holds the
    candidates of each (prefill, then decode), else it is None. `adapter` names a LoRA adapter."""

    __slots__ = ("ring", "ring_pool", "candidates", "excluded", "exclusion_counts", "unknown", "legs", "adapter")

    def __init__(self, state: ClusterState, model: str) -> None:
        self.ring = model_ring(state, model)
        pool = ring_members(state, self.ring)
        candidates, dropped = filter_by_model(pool, model)
        self.ring_pool = tuple(node.ip for node in pool)
        self.candidates = candidates
        self.unknown = not candidates and is_unknown_model(state, pool, model)
        self.excluded = tuple(Exclusion(node.ip, reason) for node, reason in dropped)
        counts: dict[str, int] = {}
        for _, reason in dropped:
            counts[reason] = counts.get(reason, 0) + 1
        self.exclusion_counts = tuple(counts.items())
        self.legs = disaggregated_legs(state, candidates)
        self.adapter = model if is_adapter(state, model, candidates) else ""
        """The model when it is a LoRA adapter (a pick then prefers the nodes that run it), else ""."""


def is_adapter(state: ClusterState, model: str, candidates: list[NodeState]) -> bool:
    """Whether `model` is a LoRA adapter: configured with a `parent`, or listed with one by a candidate."""
    config = state.config
    if config is not None and any(entry.name == model and entry.parent for entry in config.models.available):
        return True
    return any(model in node.models.adapters for node in candidates)


def disaggregated_legs(
    state: ClusterState, candidates: list[NodeState]
) -> tuple[list[NodeState], list[NodeState]] | None:
    """The candidates of the prefill leg and of the decode leg (a `both` node may serve either),
    when some candidate has the role `prefill` or `decode`; else None (whole requests)."""
    roles = state.config.disaggregation_roles() if state.config is not None else {}
    if not roles or not any(node.ip in roles for node in candidates):
        return None
    prefill = [node for node in candidates if roles.get(node.ip, PREFILL) == PREFILL]
    decode = [node for node in candidates if roles.get(node.ip, DECODE) == DECODE]
    return prefill, decode


PREFILL, DECODE = "prefill", "decode"
"""The two legs of a disaggregated request, named as the node roles that serve them."""


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    ip: str
    name: str
    ring: str
    status: Health
    model_state: Discovery
    kept: bool
    reason: str = ""
    """Why the node is excluded: not in ring, missing, empty, expired, dead or offline."""


class RoutePlan(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    ring: str
    ring_pool: tuple[str, ...]
    """IPs in the model's ring pool."""
    candidates: tuple[str, ...]
    """IPs that pass the model filter: the pool the attempt loop starts from."""
    pick_pool: tuple[str, ...]
    """IPs the balancer would pick from right now (empty: the request gets a 503)."""
    verdicts: tuple[Verdict, ...]


def plan_route(state: ClusterState, model: str, now: float) -> RoutePlan:
    """Every node's verdict for `model` at time `now`, in plinth's order of filters."""
    route = Route(state, model)
    ring = route.ring
    model_reasons = {exclusion.node: exclusion.reason for exclusion in route.excluded}
    picks = {node.ip for node in pick_pool(route.candidates, now)}
    verdicts = []
    for node in state.nodes.values():
        if node.ring != ring:
            reason = NOT_IN_RING
        elif node.ip in model_reasons:
            reason = model_reasons[node.ip]
        elif unavailable := unavailable_reason(node, now):
            reason = unavailable
        elif node.ip not in picks:
            reason = "degraded (healthy nodes preferred)"
        else:
            reason = ""
        verdicts.append(
            Verdict(
                ip=node.ip,
                name=node.name,
                ring=node.ring,
                status=node.status,
                model_state=node.models.state,
                kept=not reason,
                reason=reason,
            )
        )
    return RoutePlan(
        model=model,
        ring=ring,
        ring_pool=route.ring_pool,
        candidates=tuple(node.ip for node in route.candidates),
        pick_pool=tuple(node.ip for node in state.nodes.values() if node.ip in picks),
        verdicts=tuple(verdicts),
    )

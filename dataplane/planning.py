"""The planning stage of the request path: a request's books on the snapshot it is routed on
(`open`: its `Ledger`, with the model's `Route`, cached per snapshot, the model's policy and the
prompt prefix when the policy or the decision log needs it), then its plan (`plan`): the legs
to attempt, each with the candidates it picks from and the balancer that picks (a whole request
one leg; a disaggregated generation its prefill leg, then its decode leg), or the gateway's
answer when no node may serve it (404 for a model nobody serves, 503 while none is healthy or
while the gateway loads the adapter asked for).
"""

from __future__ import annotations

import trio

from controlplane.infrastructure.logs import JsonLog, Throttle, clipped
from controlplane.rules.balancer import Balancer
from controlplane.rules.policies import PREFIX_AFFINITY
from controlplane.rules.prefix import prompt_prefix
from controlplane.rules.routing import DECODE, PREFILL, rings_listing
from dataplane.admission.ticket import Ticket
from dataplane.errors import (
    NO_HEALTHY_NODE,
    RETRY_AFTER,
    RETRY_AFTER_MS,
    Refusal,
    adapter_loading,
    adapter_not_listed,
    model_not_found,
    refusal,
)
from dataplane.exchange import Exchange
from dataplane.ledger import Books, Ledger
from dataplane.metrics import RequestMetrics
from dataplane.views import SnapshotView
from events.state import NodeState

UNSERVED_WARNING_INTERVAL = 1.0
"""Seconds between two `no node serves requested model` warnings; those in between are counted."""


class Leg:
    """One leg of a plan: its name (`routing.PREFILL`, `routing.DECODE`, or "" for a whole
    request), the candidates its picks are made from, and the balancer that makes them."""

    __slots__ = ("name", "candidates", "balancer")

    def __init__(self, name: str, candidates: list[NodeState], balancer: Balancer) -> None:
        self.name = name
        self.candidates = candidates
        self.balancer = balancer


class Plan:
    """What the attempts stage runs: the legs in order, and the body as admission left it."""

    __slots__ = ("legs", "body")

    def __init__(self, legs: tuple[Leg, ...], body: bytes) -> None:
        self.legs = legs
        self.body = body


class Planning:
    """The stage. `balancer` picks whole requests and decode legs; `prefill_balancer` prefill
    legs (its own counter and prefix memory: a prefix's KV cache is on the prefill node)."""

    def __init__(
        self, books: Books, balancer: Balancer, prefill_balancer: Balancer, metrics: RequestMetrics, log: JsonLog
    ) -> None:
        self._books = books
        self._balancer = balancer
        self._prefill_balancer = prefill_balancer
        self._metrics = metrics
        self._log = log
        self._unserved_warnings = Throttle(UNSERVED_WARNING_INTERVAL)

    def open(self, exchange: Exchange, view: SnapshotView, ticket: Ticket) -> Ledger:
        """The request's books on `view`: its route, policy and prompt prefix."""
        config = view.config
        route = view.route(exchange.model)
        policy = config.model_policies.get(exchange.model, config.cluster_policy)
        prefix = (
            prompt_prefix(exchange.path, exchange.body, messages=config.prefix_messages, limit=config.prefix_bytes)
            if policy == PREFIX_AFFINITY or config.decision_log
            else ""
        )
        return Ledger(self._books, exchange, view, route, policy, prefix, ticket)

    def plan(self, ledger: Ledger, body: bytes) -> Plan | Refusal:
        """The legs the request is attempted in, or the answer when no node may serve it."""
        route = ledger.route
        exchange = ledger.exchange
        for reason, count in route.exclusion_counts:
            self._metrics.excluded(ledger.metric_model, reason, count)
        if not route.candidates:
            if ledger.view.adapter_loading(exchange.model):
                return refusal(adapter_loading(exchange.model), exchange.request_id, RETRY_AFTER, RETRY_AFTER_MS)
            if (unlisted := ledger.view.adapter_unlisted(exchange.model)) is not None:
                return refusal(adapter_not_listed(exchange.model, unlisted.name, unlisted.ip), exchange.request_id)
            if route.ring_pool:
                self._warn_unserved(exchange)
            if route.unknown:
                rings = rings_listing(ledger.view.snapshot, exchange.model)
                return refusal(model_not_found(exchange.model, rings), exchange.request_id)
            return refusal(NO_HEALTHY_NODE, exchange.request_id)
        if not ledger.leg:
            return Plan((Leg("", route.candidates, self._balancer),), body)
        prefill_nodes, decode_nodes = route.legs
        if not prefill_nodes or not decode_nodes:
            return refusal(NO_HEALTHY_NODE, exchange.request_id)
        return Plan((Leg(PREFILL, prefill_nodes, self._prefill_balancer), Leg(DECODE, decode_nodes, self._balancer)), body)

    def _warn_unserved(self, exchange: Exchange) -> None:
        """plinth's warning, at most once per UNSERVED_WARNING_INTERVAL (a client can ask for
        any number of models), with the client's text clipped."""
        held_back = self._unserved_warnings.allow(trio.current_time())
        if held_back is None:
            return
        fields = {"model": clipped(exchange.model), "request_id": clipped(exchange.request_id)}
        if held_back:
            fields["suppressed"] = held_back
        self._log.warn("no node serves requested model", **fields)

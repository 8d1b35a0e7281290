"""The planning stage of the request path: a request's books on the snapshot it is routed on
(`open`: its `Ledger`, with the model's `Route`, cached per snapshot, the model's policy and the
prompt prefix when the policy or the decision log needs it), then its plan (`plan`): the legs
to attempt, each with the candidates it picks from and the balancer that picks (a whole request
one leg; a disaggregated generation its prefill leg, then its decode leg), or the gateway's
answer when no node may serve it (404 for a model nobody serves, 503 while none is healthy or
while the gateway loads the adapter asked for); and, for a request routed by `kv_aware`
(`match`), the prompt's blocks each candidate holds: its prompt tokenized with its model's
tokenizer (`kvcache.tokenizer`, in worker threads) and matched against each node's KV index
(`kvcache.index`), the picks' input the record keeps. A model without a tokenizer, a prompt
without tokens, or a process without KV events matches nothing: the policy falls back. Nothing
of it runs for another policy's request.
"""

from __future__ import annotations

import trio

from controlplane.infrastructure.logs import JsonLog, Throttle, clipped
from controlplane.rules.balancer import Balancer
from controlplane.rules.policies import KV_AWARE, PREFIX_AFFINITY
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
from events.decisions import KvBlocks
from events.state import NodeState
from kvcache.index import KvIndex

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
        self,
        books: Books,
        balancer: Balancer,
        prefill_balancer: Balancer,
        metrics: RequestMetrics,
        log: JsonLog,
        kv_index: KvIndex | None = None,
    ) -> None:
        self._books = books
        self._kv_index = kv_index
        """The process's KV index, when some node has `kv_events`."""
        self._prompt_tokens = None
        """The tokenizing (`kvcache.tokenizer.PromptTokens`), made at the first request that needs
        it: a gateway without `kv_aware` never loads `tokenizers`."""
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
            if policy == PREFIX_AFFINITY or policy == KV_AWARE or config.decision_log
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

    async def match(self, ledger: Ledger, plan: Plan) -> None:
        """`kv_aware`: the prompt's blocks each candidate of the plan holds, in `ledger.matches`."""
        exchange = ledger.exchange
        index = self._kv_index
        directory = ledger.view.config.tokenizers.get(exchange.model)
        if index is None or directory is None or not any(
            node.ip in index.nodes for leg in plan.legs for node in leg.candidates
        ):
            return  # no candidate's KV events followed: tokenizing would tell the policy nothing
        if self._prompt_tokens is None:
            from kvcache.tokenizer import PromptTokens

            self._prompt_tokens = PromptTokens(self._tokenizer_unusable)
        tokens = await self._prompt_tokens.tokens(directory, exchange.path, plan.body)
        if not tokens:
            return
        matches = ledger.matches
        for leg in plan.legs:
            for node in leg.candidates:
                found = index.match(node.ip, tokens)
                if found is not None:
                    matches[node.ip] = KvBlocks(found.matched, found.total, found.seq, found.flowing)

    def _tokenizer_unusable(self, error: str) -> None:
        self._log.warn("kv_aware: a model's tokenizer does not load; its prompts get no tokens", error=error)

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

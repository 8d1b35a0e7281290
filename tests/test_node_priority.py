"""Admission priority on the node (issue 22): a node run with vLLM's `--scheduling-policy
priority` (`[[nodes]] scheduling = "priority"`) gets each request's rank (twice its admission
priority, one more when its tenant is under its fair share) in the body's `priority` member,
negated (vLLM handles lower values first), and its scheduler admits and preempts by it. Through
the real gateway and simulated nodes."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import trio

from dataplane.admission.queue import ADMITTED
from events.decisions import FairShare
from fixtures.node import NodeSpec, SimulatedNode

from harness import (
    MODEL,
    Gateway,
    admission_toml,
    chat,
    completions_to,
    node_specs,
    nodes_and_gateway,
    tenants_toml,
)
from test_admission_queue import explain_request, record_of

LOW = {"name": "low", "api_keys": ["key-low"], "priority": 0}
HIGH = {"name": "high", "api_keys": ["key-high"], "priority": 10}
PEER = {"name": "peer", "api_keys": ["key-peer"], "priority": 0}
"""Of LOW's priority."""
LOW_QUEUE_LENGTH = 'interlock_admission_queue_length{priority="0",tenant="low"}'
HELD = {"tpot": 0.5, "tokens": 1000, "max_running": 1}
"""One place in the batch, and streams that last as long as a test holds them."""


@asynccontextmanager
async def priority_node_gateway(
    tmp_path: Path, node_keys: dict | None = None, extra: str = "", config: dict | None = None, **behaviour
) -> AsyncIterator[tuple[SimulatedNode, Gateway]]:
    """One node with priority scheduling (and `behaviour`), so configured (with `node_keys`),
    behind a gateway with the tenants LOW and HIGH (and `extra` tables, `config`'s keys)."""
    [spec] = node_specs(1, **behaviour)
    async with nodes_and_gateway(
        tmp_path,
        [dataclasses.replace(spec, scheduling_policy="priority")],
        node_settings={"n1": {"scheduling": "priority", **(node_keys or {})}},
        extra=tenants_toml(LOW, HIGH) + extra,
        **(config or {}),
    ) as ([node], gateway):
        await gateway.discovered()
        yield node, gateway


@asynccontextmanager
async def running_stream(gateway: Gateway, key: str) -> AsyncIterator[AsyncIterator[bytes]]:
    """A long stream of tenant `key` through the gateway, once its first token came (it runs on
    the node); its client leaves when the block ends."""
    headers = {"Authorization": f"Bearer {key}"}
    body = chat(stream=True, max_tokens=1000)
    async with gateway.http.stream("POST", gateway.url + "/v1/chat/completions", json=body, headers=headers) as stream:
        assert stream.status_code == 200
        pieces = stream.aiter_raw()  # kept: a collected iterator would close the stream
        await pieces.__anext__()
        yield pieces


async def post(gateway: Gateway, key: str, body: dict, request_id: str = "") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} | ({"X-Request-Id": request_id} if request_id else {})
    return await gateway.http.post(gateway.url + "/v1/chat/completions", json=body, headers=headers)


def last_body(node: SimulatedNode) -> dict:
    return json.loads(completions_to(node)[-1].body)


async def test_a_priority_node_gets_the_negated_rank_and_a_client_may_lower_it_but_not_raise_it(tmp_path):
    async with priority_node_gateway(tmp_path) as (node, gateway):
        sent = chat(max_tokens=2, temperature=0.5)
        cases = [
            ("key-high", {}, -20),  # the rank, twice the tenant's priority, negated
            ("key-low", {}, 0),
            ("key-high", {"priority": -50}, -20),  # ahead of the tenant's: clamped
            ("key-high", {"priority": 7}, 7),  # behind it: the client's own
            ("key-low", {"priority": -1}, 0),
            ("key-high", {"priority": "soon"}, -20),  # not an integer: the tenant's
        ]
        for key, own, expected in cases:
            response = await post(gateway, key, sent | own)
            assert response.status_code == 200, (key, own, response.text)
            received = last_body(node)
            assert received.pop("priority") == expected, (key, own)
            assert received == sent  # every other member as the client sent it


async def test_a_node_without_priority_scheduling_gets_the_body_as_it_was(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1), extra=tenants_toml(LOW, HIGH)) as (nodes, gateway):
        await gateway.discovered()
        response = await post(gateway, "key-high", chat(max_tokens=2))
        assert response.status_code == 200
        assert "priority" not in last_body(nodes[0])


async def test_on_a_full_priority_node_a_higher_priority_request_preempts_a_running_lower_one(tmp_path):
    # One place in the node's batch, held by a low-priority stream that lasts as long as the
    # test holds it: the high-priority request is answered while that stream still runs.
    async with priority_node_gateway(tmp_path, **HELD) as (node, gateway):
        async with running_stream(gateway, "key-low") as pieces:  # the batch is full
            with trio.fail_after(60):  # without preemption it would wait for the low stream's end
                high = await post(gateway, "key-high", chat(max_tokens=1))
            assert high.status_code == 200
            low_request, high_request = completions_to(node)
            assert high_request.ended.is_set() and not low_request.ended.is_set()
            await pieces.__anext__()  # the preempted stream goes on once the high one is done
        with trio.fail_after(60):
            await low_request.ended.wait()


async def test_a_priority_node_runs_waiting_requests_by_priority_then_arrival(tmp_path):
    async with priority_node_gateway(tmp_path, **HELD) as (node, gateway):
        served: list[str] = []

        async def request(name: str, key: str) -> None:
            response = await post(gateway, key, chat(max_tokens=1))
            assert response.status_code == 200
            served.append(name)

        async with trio.open_nursery() as nursery:
            async with running_stream(gateway, "key-high"):  # the only place: nothing preempts it
                for number, (name, key) in enumerate(
                    [("low-1", "key-low"), ("low-2", "key-low"), ("high-1", "key-high")], start=2
                ):
                    nursery.start_soon(request, name, key)
                    with trio.fail_after(60):
                        while len(completions_to(node)) < number:
                            await trio.sleep(0.01)
                assert not served
        assert served == ["high-1", "low-1", "low-2"]


async def test_a_saturated_priority_node_takes_a_higher_priority_request_at_once_and_explain_says_why(tmp_path):
    # The node's one place is taken by a low stream: its max_in_flight (1) is reached and its
    # scraped KV cache is full. A second low request waits in the gateway's queue; a high one
    # goes to the node at once, which preempts the low stream for it.
    decisions, events = tmp_path / "decisions.jsonl", tmp_path / "events.jsonl"
    config = {"routing": {"load_scrape_interval": "100ms"}, "decision_log": str(decisions), "event_log": str(events)}
    async with priority_node_gateway(
        tmp_path, {"max_in_flight": 1}, admission_toml(max_queue_seconds=30), config, **HELD
    ) as (node, gateway):
        async with running_stream(gateway, "key-low"), trio.open_nursery() as nursery:
            await gateway.wait_for(lambda: (gateway.node(node.host).load.kv_cache_usage or 0) >= 0.8)
            nursery.start_soon(post, gateway, "key-low", chat(max_tokens=1), "low-queued")
            with trio.fail_after(60):
                while await gateway.metric(LOW_QUEUE_LENGTH) != 1:
                    await trio.sleep(0.01)
            with trio.fail_after(60):  # held in the queue, it would wait for the low stream's end
                high = await post(gateway, "key-high", chat(max_tokens=1), "high")
            assert high.status_code == 200
            assert await gateway.metric(LOW_QUEUE_LENGTH) == 1  # the low one still waits
            assert len(completions_to(node)) == 2
            nursery.cancel_scope.cancel()
        record = await record_of(decisions, "high")
    assert record.admission.verdict == ADMITTED and record.admission.preemptible == 1
    explained = explain_request(events, decisions, "high")
    why = "admitted at once, 1 lower-ranked request in flight on priority-scheduled nodes held it no place"
    assert why in explained


async def test_a_tenant_under_its_fair_share_goes_ahead_of_its_priority_and_preempts_one_over_it(tmp_path):
    # LOW holds both places its max_in_flight gives it on the node (one running, one waiting in
    # the node). PEER, of the same priority, has nothing in flight: its request goes ahead of
    # LOW's, at once, and the node preempts LOW's running stream for it.
    decisions, events = tmp_path / "decisions.jsonl", tmp_path / "events.jsonl"
    config = {"decision_log": str(decisions), "event_log": str(events)}
    extra = admission_toml(max_queue_seconds=30) + tenants_toml(PEER)
    async with priority_node_gateway(tmp_path, {"max_in_flight": 2}, extra, config, **HELD) as (node, gateway):
        async with running_stream(gateway, "key-low"), trio.open_nursery() as nursery:
            nursery.start_soon(post, gateway, "key-low", chat(max_tokens=1000), "low-waiting")
            with trio.fail_after(60):
                while len(completions_to(node)) < 2:
                    await trio.sleep(0.01)
            with trio.fail_after(60):  # behind LOW's, it would wait for the held stream's end
                peer = await post(gateway, "key-peer", chat(max_tokens=1), "peer")
            assert peer.status_code == 200
            assert last_body(node)["priority"] == -1  # ahead of priority 0's others (0)
            nursery.cancel_scope.cancel()
        record = await record_of(decisions, "peer")
    assert record.admission.fair_share == FairShare(tenant_in_flight=0, priority_in_flight=2, tenants=2)
    assert (record.admission.verdict, record.admission.preemptible) == (ADMITTED, 2)
    explained = explain_request(events, decisions, "peer")
    why = (
        "under its fair share, ahead of its priority's others (its tenant had 0 of the 2 requests of its priority"
        " in flight, of 2 tenants), 2 lower-ranked requests in flight on priority-scheduled nodes held it no place"
    )
    assert why in explained


async def test_the_prefill_leg_of_a_disaggregated_request_carries_the_priority_too(tmp_path):
    specs = [
        NodeSpec(name="p1", host="127.0.0.2", models=[MODEL], role="prefill", scheduling_policy="priority"),
        NodeSpec(name="d1", host="127.0.0.3", models=[MODEL], role="decode", scheduling_policy="priority"),
    ]
    settings = {spec.name: {"role": spec.role, "scheduling": "priority"} for spec in specs}
    async with nodes_and_gateway(tmp_path, specs, node_settings=settings, extra=tenants_toml(LOW, HIGH)) as (
        [prefill, decode],
        gateway,
    ):
        await gateway.discovered()
        response = await post(gateway, "key-high", chat(max_tokens=2))
        assert response.status_code == 200, response.text
    assert last_body(prefill)["priority"] == -20
    assert last_body(decode)["priority"] == -20

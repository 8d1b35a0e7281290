"""Admission priority on the node (issue 22): a node run with vLLM's `--scheduling-policy
priority` (`[[nodes]] scheduling = "priority"`) gets each request's admission priority in the
body's `priority` member, negated (vLLM handles lower values first), and its scheduler admits
and preempts by it. Through the real gateway and simulated nodes."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import trio

from fixtures.node import SimulatedNode

from harness import Gateway, chat, completions_to, node_specs, nodes_and_gateway, tenants_toml

LOW = {"name": "low", "api_keys": ["key-low"], "priority": 0}
HIGH = {"name": "high", "api_keys": ["key-high"], "priority": 10}
HELD = {"tpot": 0.5, "tokens": 1000, "max_running": 1}
"""One place in the batch, and streams that last as long as a test holds them."""


@asynccontextmanager
async def priority_node_gateway(tmp_path: Path, **behaviour) -> AsyncIterator[tuple[SimulatedNode, Gateway]]:
    """One node with priority scheduling (and `behaviour`), so configured, behind a gateway
    with the tenants LOW and HIGH."""
    [spec] = node_specs(1, **behaviour)
    async with nodes_and_gateway(
        tmp_path,
        [dataclasses.replace(spec, scheduling_policy="priority")],
        node_settings={"n1": {"scheduling": "priority"}},
        extra=tenants_toml(LOW, HIGH),
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


async def post(gateway: Gateway, key: str, body: dict) -> httpx.Response:
    return await gateway.http.post(
        gateway.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    )


def last_body(node: SimulatedNode) -> dict:
    return json.loads(completions_to(node)[-1].body)


async def test_a_priority_node_gets_the_negated_tenant_priority_and_a_client_may_lower_it_but_not_raise_it(tmp_path):
    async with priority_node_gateway(tmp_path) as (node, gateway):
        sent = chat(max_tokens=2, temperature=0.5)
        cases = [
            ("key-high", {}, -10),  # the tenant's priority, negated
            ("key-low", {}, 0),
            ("key-high", {"priority": -50}, -10),  # ahead of the tenant's: clamped
            ("key-high", {"priority": 7}, 7),  # behind it: the client's own
            ("key-low", {"priority": -1}, 0),
            ("key-high", {"priority": "soon"}, -10),  # not an integer: the tenant's
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
            with trio.fail_after(10):  # without preemption it would wait for the low stream's end
                high = await post(gateway, "key-high", chat(max_tokens=1))
            assert high.status_code == 200
            low_request, high_request = completions_to(node)
            assert high_request.ended.is_set() and not low_request.ended.is_set()
            await pieces.__anext__()  # the preempted stream goes on once the high one is done
        with trio.fail_after(10):
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
                    with trio.fail_after(10):
                        while len(completions_to(node)) < number:
                            await trio.sleep(0.01)
                assert not served
        assert served == ["high-1", "low-1", "low-2"]

"""Admission priority on the node (issue 22): a node run with vLLM's `--scheduling-policy
priority` (`[[nodes]] scheduling = "priority"`) gets each request's admission priority in the
body's `priority` member, negated (vLLM handles lower values first), and its scheduler admits
and preempts by it. Through the real gateway and simulated nodes."""

from __future__ import annotations

import dataclasses
import json

import httpx
import trio

from fixtures.node import SimulatedNode

from harness import chat, completions_to, node_specs, nodes_and_gateway, tenants_toml

LOW = {"name": "low", "api_keys": ["key-low"], "priority": 0}
HIGH = {"name": "high", "api_keys": ["key-high"], "priority": 10}


def priority_nodes(count: int, **behaviour):
    return [dataclasses.replace(spec, scheduling_policy="priority") for spec in node_specs(count, **behaviour)]


async def post(gateway, key: str, body: dict) -> httpx.Response:
    return await gateway.http.post(
        gateway.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    )


def last_body(node: SimulatedNode) -> dict:
    return json.loads(completions_to(node)[-1].body)


async def test_a_priority_node_gets_the_negated_tenant_priority_and_a_client_may_lower_it_but_not_raise_it(tmp_path):
    async with nodes_and_gateway(
        tmp_path,
        priority_nodes(1),
        node_settings={"n1": {"scheduling": "priority"}},
        extra=tenants_toml(LOW, HIGH),
    ) as (nodes, gateway):
        await gateway.discovered()
        [node] = nodes
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
    async with nodes_and_gateway(
        tmp_path,
        priority_nodes(1, tpot=0.5, tokens=1000, max_running=1),
        node_settings={"n1": {"scheduling": "priority"}},
        extra=tenants_toml(LOW, HIGH),
    ) as (nodes, gateway):
        await gateway.discovered()
        [node] = nodes
        headers = {"Authorization": "Bearer key-low"}
        body = chat(stream=True, max_tokens=1000)
        async with gateway.http.stream("POST", gateway.url + "/v1/chat/completions", json=body, headers=headers) as low:
            assert low.status_code == 200
            pieces = low.aiter_raw()
            await pieces.__anext__()  # the first token: the low stream runs, the batch is full
            with trio.fail_after(10):  # without preemption it would wait for the low stream's end
                high = await post(gateway, "key-high", chat(max_tokens=1))
            assert high.status_code == 200
            low_request, high_request = completions_to(node)
            assert high_request.ended.is_set() and not low_request.ended.is_set()
            await pieces.__anext__()  # the preempted stream goes on once the high one is done
        with trio.fail_after(10):
            await low_request.ended.wait()


async def test_a_priority_node_runs_waiting_requests_by_priority_then_arrival(tmp_path):
    async with nodes_and_gateway(
        tmp_path,
        priority_nodes(1, tpot=0.5, tokens=1000, max_running=1),
        node_settings={"n1": {"scheduling": "priority"}},
        extra=tenants_toml(LOW, HIGH),
    ) as (nodes, gateway):
        await gateway.discovered()
        [node] = nodes
        served: list[str] = []

        async def request(name: str, key: str) -> None:
            response = await post(gateway, key, chat(max_tokens=1))
            assert response.status_code == 200
            served.append(name)

        headers = {"Authorization": "Bearer key-high"}
        body = chat(stream=True, max_tokens=1000)
        async with trio.open_nursery() as nursery:
            async with gateway.http.stream("POST", gateway.url + "/v1/chat/completions", json=body, headers=headers) as held:
                pieces = held.aiter_raw()
                await pieces.__anext__()  # a high stream holds the only place: nothing preempts it
                for number, (name, key) in enumerate(
                    [("low-1", "key-low"), ("low-2", "key-low"), ("high-1", "key-high")], start=2
                ):
                    nursery.start_soon(request, name, key)
                    with trio.fail_after(10):
                        while len(completions_to(node)) < number:
                            await trio.sleep(0.01)
                assert not served
        assert served == ["high-1", "low-1", "low-2"]

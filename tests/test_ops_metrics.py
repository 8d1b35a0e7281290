"""The metrics an operator watches a fleet with: per-node request metrics (one process, and
`serve --workers N`), and each node's health and discovery state and each model's nodes."""

from __future__ import annotations

import os
import signal

import httpx
import trio
from prometheus_client import CollectorRegistry, Counter, generate_latest

from interlock.workers import WorkerSamples

from harness import Gateway, chat, completions_to, node_specs, nodes_and_gateway

CHAT = "/v1/chat/completions"
FAST = {"health_interval": "0.1s"}


def in_flight(ip: str) -> str:
    return f'interlock_node_requests_in_flight{{node="{ip}"}}'


async def metric_becomes(gateway: Gateway, sample: str, *values: float | None, timeout: float = 60.0) -> None:
    """Poll until the sample has one of `values` (None: no such series)."""
    with trio.fail_after(timeout):
        while await gateway.metric(sample) not in values:
            await trio.sleep(0.02)


async def stream_in_flight(gateway: Gateway, nursery: trio.Nursery) -> trio.CancelScope:
    """Start a streaming request (to a node that takes long to its first token); cancelling the
    returned scope makes the client leave. The gateway may drop it (a killed worker)."""
    scope = trio.CancelScope()

    async def request() -> None:
        with scope:
            async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
                try:
                    await http.post(gateway.url + CHAT, json=chat(stream=True))
                except httpx.RemoteProtocolError:
                    pass

    nursery.start_soon(request)
    return scope


async def test_attempts_are_counted_and_timed_by_node_and_status(tmp_path):
    specs = node_specs(2)
    specs[1].behaviour.completion = "http_error"
    specs[1].behaviour.error_status = 503
    async with nodes_and_gateway(tmp_path, specs, **FAST) as (nodes, gateway):
        await gateway.discovered()
        for _ in range(6):
            await gateway.http.post(gateway.url + CHAT, json=chat())
        ok, failing = nodes[0].host, nodes[1].host
        served = len(completions_to(nodes[0]))
        refused = len(completions_to(nodes[1]))
        assert served and refused and served + refused == 6
        assert await gateway.metric(f'interlock_node_requests_total{{node="{ok}",status="200"}}') == served
        assert await gateway.metric(f'interlock_node_requests_total{{node="{failing}",status="503"}}') == refused
        assert await gateway.metric(f'interlock_node_requests_total{{node="{ok}",status="503"}}') is None
        assert await gateway.metric(f'interlock_node_request_duration_seconds_count{{node="{ok}"}}') == served
        assert await gateway.metric(f'interlock_node_request_duration_seconds_count{{node="{failing}"}}') == refused
        assert await gateway.metric(in_flight(ok)) == 0


async def test_an_attempt_on_a_node_that_refuses_is_counted_as_a_retry_of_that_node(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(2)) as (nodes, gateway):
        await gateway.discovered()
        refusing = nodes[1].host
        nodes[1].behaviour.refuse = True  # seen by the next request sent to it (probes are 30 s apart)
        for _ in range(4):
            assert (await gateway.http.post(gateway.url + CHAT, json=chat())).status_code == 200
        assert len(gateway.logged("retrying after connection failure")) == 1
        assert await gateway.metric(f'interlock_node_retries_total{{node="{refusing}"}}') == 1
        assert await gateway.metric(f'interlock_node_requests_total{{node="{refusing}",status="502"}}') == 1
        assert await gateway.metric(f'interlock_node_retries_total{{node="{nodes[0].host}"}}') is None


async def test_a_stream_is_in_flight_on_its_node_until_the_client_leaves(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1, ttft=60.0), **FAST) as (nodes, gateway):
        await gateway.discovered()
        async with trio.open_nursery() as nursery:
            client = await stream_in_flight(gateway, nursery)
            await metric_becomes(gateway, in_flight(nodes[0].host), 1)
            client.cancel()
        await metric_becomes(gateway, in_flight(nodes[0].host), 0)


async def test_with_workers_in_flight_streams_are_summed_and_a_killed_worker_leaves_none(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1, ttft=60.0), workers=2, **FAST) as (nodes, gateway):
        await gateway.discovered()
        ip = nodes[0].host
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                await stream_in_flight(gateway, nursery)
            # One series for the node, whichever workers serve the streams (no pid label).
            await metric_becomes(gateway, in_flight(ip), 3)
            for line in gateway.logged("worker started"):
                os.kill(int(line["pid"]), signal.SIGKILL)
            await metric_becomes(gateway, in_flight(ip), 0, None)  # no worker has the node in flight
            nursery.cancel_scope.cancel()
        nodes[0].behaviour.ttft = 0.0
        assert (await gateway.http.post(gateway.url + CHAT, json=chat())).status_code == 200
        assert await gateway.metric(f'interlock_node_requests_total{{node="{ip}",status="200"}}') == 1


async def test_node_health_discovery_and_each_models_nodes_follow_the_state(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(2), **FAST) as (nodes, gateway):
        await gateway.discovered()
        first, second = nodes[0].host, nodes[1].host
        model_nodes = 'interlock_model_nodes{{model="test-model",status="{}"}}'
        assert await gateway.metric(model_nodes.format("healthy")) == 2
        assert await gateway.metric(f'interlock_node_health{{node="{second}",status="healthy"}}') == 1
        assert await gateway.metric(f'interlock_node_discovery{{node="{first}",state="known"}}') == 1
        nodes[0].behaviour.models = "empty"
        nodes[1].behaviour.health = "fail"
        await gateway.wait_for(
            lambda: gateway.node(first).models.state == "known_empty" and gateway.node(second).status == "dead"
        )
        assert await gateway.metric(f'interlock_node_discovery{{node="{first}",state="known_empty"}}') == 1
        assert await gateway.metric(f'interlock_node_discovery{{node="{first}",state="known"}}') == 0
        assert await gateway.metric(f'interlock_node_health{{node="{second}",status="dead"}}') == 1
        assert await gateway.metric(f'interlock_node_health{{node="{second}",status="healthy"}}') == 0
        assert await gateway.metric(model_nodes.format("healthy")) == 0
        assert await gateway.metric(model_nodes.format("dead")) == 1


def test_a_sample_file_a_worker_is_still_creating_does_not_fail_the_scrape(tmp_path):
    # The state a worker leaves when it dies between creating its file and sizing it.
    (tmp_path / "counter_4242.db").touch()
    registry = CollectorRegistry()
    WorkerSamples(registry, path=str(tmp_path))
    Counter("interlock_test_total", "A leader's own counter", registry=registry).inc()
    assert "interlock_test_total 1.0" in generate_latest(registry).decode()

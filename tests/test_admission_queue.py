"""Admission under saturation (issue 22, item 3): while every node of a model is saturated,
requests wait in the gateway's queue, in order of priority, tenants in turn, until a place frees
up, their deadline passes (503), their client leaves, or the queue is full (429).

The order is tested through the real gateway with two tenants, and on the queue itself
(`dataplane.admission.queue`, real trio tasks and a real control plane) for the finer cases
(several priorities, fairness ids); the rest through the real gateway and simulated nodes."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import trio
from prometheus_client import CollectorRegistry

from controlplane.rules.policies import AT_MAX_IN_FLIGHT
from controlplane.rules.routing import pick_pool
from controlplane.effects.control_plane import open_control_plane
from controlplane.rules.saturation import free_places, priority_headroom, rank, under_fair_share
from dataplane.admission.queue import ADMITTED, QUEUED, AdmissionQueue
from dataplane.metrics import RequestMetrics
from dataplane.admission.occupancy import Occupancy
from dataplane.views import SnapshotViews
from events.config import AdmissionConfig, Config, TenantConfig
from events.decisions import FairShare
from events.state import NodeLoad, NodeState
from fixtures.node import SimulatedNode, serve_nodes
from journal.segments import list_segments

from harness import (
    MODEL,
    PROJECT_ROOT,
    CapturedLog,
    Gateway,
    admission_toml,
    chat,
    completions_to,
    decision_records,
    node_specs,
    nodes_and_gateway,
    tenants_toml,
    write_config,
)
from test_verify import verify

QUEUE_LENGTH = 'interlock_admission_queue_length{priority="0",tenant="default"}'
HELD = {"tpot": 0.5, "tokens": 1000}
"""A node whose streams last as long as a test holds them (a token every half second)."""


# --- the order in which the queue releases requests ---------------------------------------------


@asynccontextmanager
async def full_node_queue(tmp_path: Path) -> AsyncIterator[tuple[AdmissionQueue, SnapshotViews, dict[str, int], str]]:
    """A queue over one node with `max_in_flight = 1` and a real control plane, and the node's
    in-flight count (the balancer's, here in the test's hands) at 1: the pool is saturated."""
    async with serve_nodes(node_specs(1)) as nodes:
        config_path = write_config(
            tmp_path, nodes, node_settings={"n1": {"max_in_flight": 1}}, extra=admission_toml(max_queue_seconds=30)
        )
        async with open_control_plane(config_path, version="test", log=CapturedLog()) as control_plane:
            views = SnapshotViews(control_plane.view)
            with trio.fail_after(60):
                while not pick_pool(views.current().route(MODEL).candidates, control_plane.view.now()):
                    await trio.sleep(0.01)
            ip = nodes[0].host
            occupancy = Occupancy(views)
            occupancy.in_flight[ip] = 1
            queue = AdmissionQueue(control_plane.view, views, occupancy, RequestMetrics(CollectorRegistry()))
            yield queue, views, occupancy.in_flight, ip


async def release_order(tmp_path: Path, arrivals: list[tuple[str, str, int, str]]) -> list[str]:
    """The names of `arrivals` (name, tenant, priority, fairness id), queued in that order, in
    the order the queue releases them as one place frees up at a time."""
    released: list[str] = []
    async with full_node_queue(tmp_path) as (queue, views, in_flight, ip), trio.open_nursery() as nursery:

        async def request(name: str, tenant: str, priority: int, fairness_id: str) -> None:
            outcome = await queue.admit(views.current(), MODEL, tenant, priority, fairness_id, 30)
            assert outcome.verdict == QUEUED
            in_flight[ip] += 1  # its attempt begins, as the ledger counts it
            released.append(name)

        for number, arrival in enumerate(arrivals, start=1):
            nursery.start_soon(request, *arrival)
            with trio.fail_after(60):
                while queue.waiting < number:
                    await trio.sleep(0)
        for number in range(1, len(arrivals) + 1):
            in_flight[ip] -= 1  # an attempt ends
            queue.freed()
            with trio.fail_after(60):
                while len(released) < number:
                    await trio.sleep(0)
            assert queue.waiting == len(arrivals) - number  # one place, one request released
    return released


async def test_the_queue_serves_higher_priorities_first(tmp_path):
    arrivals = [
        ("low-1", "t", 0, ""),
        ("high-1", "t", 10, ""),
        ("low-2", "t", 0, ""),
        ("middle", "t", 5, ""),
        ("high-2", "t", 10, ""),
    ]
    assert await release_order(tmp_path, arrivals) == ["high-1", "high-2", "middle", "low-1", "low-2"]


async def test_tenants_of_one_priority_take_turns_and_so_do_fairness_ids_within_a_tenant(tmp_path):
    # Tenant a queued four requests before b and c queued one each: b and c need not wait for
    # all of a's. Within a, the fairness id y's one request goes before x's second.
    arrivals = [
        ("a-x-1", "a", 0, "x"),
        ("a-x-2", "a", 0, "x"),
        ("a-x-3", "a", 0, "x"),
        ("a-y-1", "a", 0, "y"),
        ("b-1", "b", 0, ""),
        ("c-1", "c", 0, ""),
    ]
    order = await release_order(tmp_path, arrivals)
    assert order == ["a-x-1", "b-1", "c-1", "a-y-1", "a-x-2", "a-x-3"]


async def test_a_pool_with_room_admits_at_once(tmp_path):
    async with full_node_queue(tmp_path) as (queue, views, in_flight, ip):
        in_flight[ip] = 0
        outcome = await queue.admit(views.current(), MODEL, "t", 0, "", 30)
        assert (outcome.verdict, outcome.saturated_seq, queue.waiting) == (ADMITTED, 0, 0)


# --- through the gateway ------------------------------------------------------------------------


@asynccontextmanager
async def held_node_gateway(
    tmp_path: Path, *tenants: dict[str, object], **admission: object
) -> AsyncIterator[tuple[Gateway, list]]:
    """One node that takes one request at a time from this gateway (`max_in_flight = 1`), with
    `[admission]` set as given, `[[tenants]]` tables, and the decision and event logs on."""
    settings = {"max_queue_seconds": 30} | admission
    async with nodes_and_gateway(
        tmp_path,
        node_specs(1, **HELD),
        node_settings={"n1": {"max_in_flight": 1}},
        extra=admission_toml(**settings) + tenants_toml(*tenants),
        decision_log=str(tmp_path / "decisions.jsonl"),
        event_log=str(tmp_path / "events.jsonl"),
    ) as (nodes, gateway):
        await gateway.discovered()
        yield gateway, nodes


@asynccontextmanager
async def holding_the_node(gateway: Gateway | SimulatedNode, key: str = "") -> AsyncIterator[None]:
    """A stream in flight to the node, through the gateway (with client key `key`, if given) or
    straight to the node, until the block ends (its client then goes away)."""
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        body = chat(stream=True, max_tokens=1000)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with http.stream("POST", gateway.url + "/v1/chat/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            pieces = response.aiter_raw()  # kept: a collected iterator would close the stream
            await pieces.__anext__()  # the first token: committed, in flight
            yield


async def post_chat(gateway: Gateway, request_id: str = "", key: str = "") -> httpx.Response:
    """A short chat completion through the gateway, with `request_id` as its X-Request-Id and
    `key` as its client key, if given."""
    headers = {"X-Request-Id": request_id} if request_id else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return await gateway.http.post(gateway.url + "/v1/chat/completions", json=chat(max_tokens=1), headers=headers)


async def queue_length(gateway: Gateway) -> float:
    return await gateway.metric(QUEUE_LENGTH) or 0.0


async def wait_for_queue_length(gateway: Gateway, length: int) -> None:
    with trio.fail_after(60):
        while await queue_length(gateway) != length:
            await trio.sleep(0.01)


async def record_of(path: Path, request_id: str):
    """The decision record of `request_id`, once the decision log has it."""
    with trio.fail_after(60):
        while True:
            records = [record for record in decision_records(path) if record.request_id == request_id]
            if records:
                return records[-1]
            await trio.sleep(0.02)


def explain_request(events: Path, decisions: Path, request_id: str) -> str:
    """What `interlock explain --request-id` prints for `request_id` (it must succeed)."""
    explained = subprocess.run(
        [sys.executable, "-m", "interlock.cli", "explain", str(events), "--request-id", request_id,
         "--decisions", str(decisions)],  # fmt: skip
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert explained.returncode == 0, explained.stderr
    return explained.stdout


async def test_a_request_waits_in_the_gateway_until_an_attempt_ends(tmp_path):
    async with held_node_gateway(tmp_path) as (gateway, nodes):
        answers = []

        async def queued_request() -> None:
            response = await post_chat(gateway, "waiter")
            answers.append(response)

        async with trio.open_nursery() as nursery:
            async with holding_the_node(gateway):
                nursery.start_soon(queued_request)
                await wait_for_queue_length(gateway, 1)
                assert len(completions_to(nodes[0])) == 1  # the waiting request is in the gateway, not the node
            # The held stream's client left: its attempt ended, and the waiting request went in.
        [answer] = answers
        assert answer.status_code == 200
        assert await queue_length(gateway) == 0
        record = await record_of(tmp_path / "decisions.jsonl", "waiter")
        assert record.admission.verdict == QUEUED and record.admission.queued_ms > 0
        assert 0 < record.admission.saturated_seq <= record.seq
        assert await gateway.metric('interlock_admission_queue_seconds_count{priority="0",tenant="default"}') == 1


LOW = {"name": "low", "api_keys": ["key-low"], "priority": 0}
HIGH = {"name": "high", "api_keys": ["key-high"], "priority": 10}


async def served_order(gateway: Gateway, arrivals: list[tuple[str, str]], holder_key: str) -> list[str]:
    """The request ids of `arrivals` (request id, client key), queued in that order behind a
    stream of `holder_key` that holds the node, in the order the gateway served them once the
    stream ends (the node takes one at a time, so they end in the order they were released)."""
    served: list[str] = []

    async def request(request_id: str, key: str) -> None:
        response = await post_chat(gateway, request_id, key)
        assert response.status_code == 200
        served.append(request_id)

    async with trio.open_nursery() as nursery:
        async with holding_the_node(gateway, holder_key):
            for number, (request_id, key) in enumerate(arrivals, start=1):
                nursery.start_soon(request, request_id, key)
                await wait_for_total_queue_length(gateway, number)
    return served


async def total_queue_length(gateway: Gateway) -> float:
    samples = [
        line for line in (await gateway.metrics()).splitlines() if line.startswith("interlock_admission_queue_length{")
    ]
    return sum(float(line.rpartition(" ")[2]) for line in samples)


async def wait_for_total_queue_length(gateway: Gateway, length: int) -> None:
    with trio.fail_after(60):
        while await total_queue_length(gateway) != length:
            await trio.sleep(0.01)


async def test_through_the_gateway_a_higher_priority_tenant_goes_first(tmp_path):
    async with held_node_gateway(tmp_path, LOW, HIGH) as (gateway, nodes):
        arrivals = [("low-1", "key-low"), ("low-2", "key-low"), ("high-1", "key-high"), ("high-2", "key-high")]
        assert await served_order(gateway, arrivals, "key-low") == ["high-1", "high-2", "low-1", "low-2"]
        record = await record_of(tmp_path / "decisions.jsonl", "high-1")
        assert (record.admission.tenant, record.admission.priority, record.admission.verdict) == ("high", 10, QUEUED)
        length = 'interlock_admission_queue_length{priority="10",tenant="high"}'
        assert await gateway.metric(length) == 0
        assert await gateway.metric('interlock_admission_queue_seconds_count{priority="10",tenant="high"}') == 2


async def test_through_the_gateway_tenants_of_one_priority_take_turns(tmp_path):
    # Tenant a queued three requests before b queued one: b's goes second, not last.
    a = {"name": "a", "api_keys": ["key-a"]}
    b = {"name": "b", "api_keys": ["key-b"]}
    async with held_node_gateway(tmp_path, a, b) as (gateway, nodes):
        arrivals = [("a-1", "key-a"), ("a-2", "key-a"), ("a-3", "key-a"), ("b-1", "key-b")]
        assert await served_order(gateway, arrivals, "key-a") == ["a-1", "b-1", "a-2", "a-3"]


async def test_with_priority_headroom_a_lower_priority_queues_while_a_place_is_kept_for_the_top_one(tmp_path):
    # max_in_flight 2, one place kept for the top priority: with one low stream in flight, a
    # second low request waits in the gateway although the node has a place, and a high one
    # takes that place at once.
    decisions, events = tmp_path / "decisions.jsonl", tmp_path / "events.jsonl"
    async with nodes_and_gateway(
        tmp_path,
        node_specs(1, **HELD),
        node_settings={"n1": {"max_in_flight": 2}},
        extra=admission_toml(max_queue_seconds=30, priority_headroom=1) + tenants_toml(LOW, HIGH),
        decision_log=str(decisions),
        event_log=str(events),
    ) as (nodes, gateway):
        await gateway.discovered()
        low_answers = []

        async def low_request() -> None:
            low_answers.append(await post_chat(gateway, "low-waiting", "key-low"))

        async with trio.open_nursery() as nursery:
            async with holding_the_node(gateway, "key-low"):
                nursery.start_soon(low_request)
                await wait_for_total_queue_length(gateway, 1)
                assert len(completions_to(nodes[0])) == 1  # a place is free, but not for priority 0
                high = await post_chat(gateway, "high-at-once", "key-high")
                assert high.status_code == 200
                assert not low_answers  # the low request still waits
            # The held stream's client left: its place goes to the waiting low request.
        [low] = low_answers
        assert low.status_code == 200
        high_record = await record_of(decisions, "high-at-once")
        assert (high_record.admission.verdict, high_record.admission.headroom) == (ADMITTED, 0)
        low_record = await record_of(decisions, "low-waiting")
        assert (low_record.admission.verdict, low_record.admission.headroom) == (QUEUED, 1)
        assert low_record.admission.saturated_seq > 0
    explained = explain_request(events, decisions, "low-waiting")
    assert "1 in-flight places per node left to higher priorities (priority_headroom)" in explained
    assert "by max_in_flight 2 less priority_headroom 1" in explained


async def test_a_request_goes_to_the_node_with_room_not_to_a_full_one_and_verify_makes_the_same_pick(tmp_path):
    # Two nodes of one place each. The first request holds its node; the second goes to the
    # other and ends. Round robin's turn is then the full node again, but the third request goes
    # to the node with room (without that it would wait behind the held stream, in the node).
    decisions, events = tmp_path / "decisions.jsonl", tmp_path / "events.jsonl"
    async with nodes_and_gateway(
        tmp_path,
        node_specs(2, max_running=1, **HELD),
        node_settings={"n1": {"max_in_flight": 1}, "n2": {"max_in_flight": 1}},
        extra=admission_toml(max_queue_seconds=30),
        decision_log=str(decisions),
        event_log=str(events),
    ) as (nodes, gateway):
        await gateway.discovered()
        async with holding_the_node(gateway):
            [held] = [node for node in nodes if completions_to(node)]
            [free] = [node for node in nodes if node is not held]
            assert (await post_chat(gateway, "second")).headers["x-interlock-node"] == free.name
            with trio.fail_after(60):
                third = await post_chat(gateway, "third")
            assert third.status_code == 200 and third.headers["x-interlock-node"] == free.name
            record = await record_of(decisions, "third")
    assert [(c.node, c.note) for c in record.candidates] == [(free.host, ""), (held.host, AT_MAX_IN_FLIGHT)]
    verified = verify(events, decisions)
    assert verified.returncode == 0, verified.stdout + verified.stderr


@asynccontextmanager
async def held_stream(gateway: Gateway, request_id: str, key: str) -> AsyncIterator[str]:
    """A stream of client key `key` in flight through the gateway until the block ends (its
    client then goes away); yields the name of the node that serves it."""
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        headers = {"Authorization": f"Bearer {key}", "X-Request-Id": request_id}
        body = chat(stream=True, max_tokens=1000)
        async with http.stream("POST", gateway.url + "/v1/chat/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            pieces = response.aiter_raw()
            await pieces.__anext__()
            yield response.headers["x-interlock-node"]


async def wait_for_nothing_in_flight(gateway: Gateway, nodes: list) -> None:
    with trio.fail_after(60):
        for node in nodes:
            while await gateway.metric(f'interlock_node_requests_in_flight{{node="{node.host}"}}'):
                await trio.sleep(0.01)


async def test_with_priority_headroom_and_round_robin_no_node_holds_more_lower_requests_than_it_keeps_room_for(tmp_path):
    # Two nodes of max_in_flight 2, one place of each kept for the top priority: each takes one
    # low request. Short requests between two held low streams move round robin's turn, so that
    # in one round it points at the node the first stream holds: the second must still go to the
    # other node (the queue let it through for that node's place), never into the place kept on
    # the first. A third low request then waits, and a high one goes through at once.
    decisions, events = tmp_path / "decisions.jsonl", tmp_path / "events.jsonl"
    async with nodes_and_gateway(
        tmp_path,
        node_specs(2, **HELD),
        node_settings={"n1": {"max_in_flight": 2}, "n2": {"max_in_flight": 2}},
        extra=admission_toml(max_queue_seconds=30, priority_headroom=1) + tenants_toml(LOW, HIGH),
        decision_log=str(decisions),
        event_log=str(events),
    ) as (nodes, gateway):
        await gateway.discovered()
        for shorts in range(3):
            async with trio.open_nursery() as nursery:
                async with held_stream(gateway, f"first-{shorts}", "key-low") as first:
                    for number in range(shorts):
                        short = await post_chat(gateway, f"short-{shorts}-{number}", "key-low")
                        assert short.status_code == 200 and short.headers["x-interlock-node"] != first
                    async with held_stream(gateway, f"second-{shorts}", "key-low") as second:
                        assert second != first
                        waiting: list[httpx.Response] = []

                        async def third_low() -> None:
                            waiting.append(await post_chat(gateway, f"third-{shorts}", "key-low"))

                        nursery.start_soon(third_low)
                        await wait_for_total_queue_length(gateway, 1)
                        high = await post_chat(gateway, f"high-{shorts}", "key-high")
                        assert high.status_code == 200
                        assert not waiting
                # Both low streams' clients left: the waiting one went in.
            [third] = waiting
            assert third.status_code == 200
            record = await record_of(decisions, f"second-{shorts}")  # the first node was full for it
            assert sorted((c.node, c.full) for c in record.candidates) == sorted(
                (node.host, node.name == first) for node in nodes
            )
            await wait_for_nothing_in_flight(gateway, nodes)
    verified = verify(events, decisions)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    # verify makes the rule's answer again where the log holds its inputs: a record that says the
    # node holding a low stream had room for the second is caught.
    lines = [line for segment in list_segments(decisions) for line in segment.read_text().splitlines()]
    [index] = [number for number, line in enumerate(lines) if '"request_id":"second-1"' in line]
    record = msgspec.json.decode(lines[index])
    for candidate in record["candidates"]:
        candidate.pop("full", None)
    lines[index] = msgspec.json.encode(record).decode()
    edited = tmp_path / "edited.jsonl"
    edited.write_text("\n".join(lines) + "\n")
    tampered = verify(events, edited)
    assert tampered.returncode != 0 and ".full" in tampered.stdout, tampered.stdout


async def test_a_tenants_max_queue_seconds_is_its_deadline_and_the_refusal_gives_back_what_its_limits_took(tmp_path):
    # [admission] lets requests wait 30 s; the tenant's own bound is 0.2 s. Its two requests a
    # minute: the held stream takes one, the late request takes the other and gives it back
    # when the queue refuses it, so one more request goes through, and then no more.
    tenant = {"name": "brief", "api_keys": ["key-brief"], "max_queue_seconds": 0.2, "requests_per_minute": 2}
    async with held_node_gateway(tmp_path, tenant) as (gateway, nodes):
        async with holding_the_node(gateway, "key-brief"):
            response = await post_chat(gateway, "late", "key-brief")
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "queue_timeout"
            assert response.headers["x-ratelimit-limit-requests"] == "2"
        record = await record_of(tmp_path / "decisions.jsonl", "late")
        assert (record.admission.tenant, record.admission.verdict, record.admission.refused_by) == (
            "brief",
            "refused",
            "queue_deadline",
        )
        assert 200 <= record.admission.queued_ms < 30_000
        refused = 'interlock_admission_refusals_total{limit="queue_deadline",priority="0",tenant="brief"}'
        assert await gateway.metric(refused) == 1
        assert (await post_chat(gateway, "again", "key-brief")).status_code == 200
        over = await post_chat(gateway, "over", "key-brief")
        assert (over.status_code, over.json()["error"]["code"]) == (429, "rate_limit_exceeded")


async def test_a_request_that_waits_past_its_deadline_gets_a_503_with_retry_after(tmp_path):
    async with held_node_gateway(tmp_path, max_queue_seconds=0.2) as (gateway, nodes), holding_the_node(gateway):
        response = await post_chat(gateway, "late")
        assert response.status_code == 503
        assert (response.headers["retry-after"], response.headers["retry-after-ms"]) == ("1", "1000")
        assert response.json()["error"]["code"] == "queue_timeout"
        assert len(completions_to(nodes[0])) == 1
        refused = 'interlock_admission_refusals_total{limit="queue_deadline",priority="0",tenant="default"}'
        assert await gateway.metric(refused) == 1
        record = await record_of(tmp_path / "decisions.jsonl", "late")
        assert (record.status, record.attempts) == (503, ())
        assert (record.admission.verdict, record.admission.refused_by) == ("refused", "queue_deadline")
        assert record.admission.queued_ms >= 200


async def test_a_client_that_goes_away_leaves_the_queue_at_once(tmp_path):
    async with held_node_gateway(tmp_path) as (gateway, nodes):
        async with holding_the_node(gateway):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(post_chat, gateway, "gone")
                await wait_for_queue_length(gateway, 1)
                nursery.cancel_scope.cancel()  # the client closes its connection
            await wait_for_queue_length(gateway, 0)
            record = await record_of(tmp_path / "decisions.jsonl", "gone")
            assert (record.status, record.admission.verdict) == (None, QUEUED)
        # The place the held stream frees is not given to the request that left.
        response = await post_chat(gateway)
        assert response.status_code == 200
        assert len(completions_to(nodes[0])) == 2


async def test_a_full_queue_answers_429_that_the_sdk_raises_as_a_rate_limit(tmp_path):
    async with held_node_gateway(tmp_path, queue_size=1, tenant_queue_size=1) as (gateway, nodes):
        async with holding_the_node(gateway), trio.open_nursery() as nursery:
            nursery.start_soon(post_chat, gateway)
            await wait_for_queue_length(gateway, 1)
            http_client = openai.DefaultAsyncHttpxClient(trust_env=False)
            async with openai.AsyncOpenAI(
                base_url=gateway.url + "/v1", api_key="x", max_retries=0, http_client=http_client
            ) as client:
                with pytest.raises(openai.RateLimitError) as raised:
                    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
            assert raised.value.code == "rate_limit_exceeded"
            assert raised.value.response.headers["retry-after"] == "1"
            refused = 'interlock_admission_refusals_total{limit="queue_full",priority="0",tenant="default"}'
            assert await gateway.metric(refused) == 1
            nursery.cancel_scope.cancel()
        assert len(completions_to(nodes[0])) == 1


async def test_a_scrape_that_shows_the_node_freed_releases_the_queue_and_explain_tells_why_it_waited(tmp_path):
    # No max_in_flight: the node's scraped KV cache saturates it, used by a stream another
    # client sends it straight (not through this gateway). The gateway's request waits until a
    # scrape shows the node's batch free again.
    decisions, events = tmp_path / "decisions.jsonl", tmp_path / "events.jsonl"
    async with nodes_and_gateway(
        tmp_path,
        node_specs(1, max_running=1, **HELD),
        extra=admission_toml(max_queue_seconds=30),
        routing={"load_scrape_interval": "100ms"},
        decision_log=str(decisions),
        event_log=str(events),
    ) as (nodes, gateway):
        await gateway.discovered()
        node = nodes[0]
        async with trio.open_nursery() as nursery:
            async with holding_the_node(node):
                await gateway.wait_for(lambda: (gateway.node(node.host).load.kv_cache_usage or 0) >= 0.8)
                nursery.start_soon(post_chat, gateway, "waited")
                await wait_for_queue_length(gateway, 1)
                assert len(completions_to(node)) == 1
            # The direct stream's client has left; the gateway's request goes in after a scrape.
        record = await record_of(decisions, "waited")
        assert record.status == 200
        assert record.admission.verdict == QUEUED and record.admission.saturated_seq > 0
        assert len(completions_to(node)) == 2
    explained = explain_request(events, decisions, "waited")
    seq = record.admission.saturated_seq
    assert f"queued {record.admission.queued_ms:.1f} ms, pool saturated at seq {seq}" in explained
    assert f"pool saturated at seq {seq}" in explained
    assert "KV cache 1.00 >= saturation_kv_cache 0.8" in explained


# --- saturation, the pure function ----------------------------------------------------------------


def loaded(ip: str, *, waiting: float = 0, kv: float | None = None, known: bool = True) -> NodeState:
    return NodeState(ip=ip, load=NodeLoad(known=known, waiting=waiting, kv_cache_usage=kv, scraped_at=1.0))


def test_a_pool_is_saturated_when_every_node_is_over_a_threshold():
    admission = AdmissionConfig(saturation_waiting=5, saturation_kv_cache=0.8)
    full = [loaded("a", waiting=5), loaded("b", kv=0.9)]
    assert free_places(full, admission, {}, {}, {}) == 0
    # A node under both thresholds, without a max_in_flight, takes any number; with one, the rest of it.
    assert free_places([*full, loaded("c", waiting=4, kv=0.7)], admission, {}, {}, {}) == math.inf
    assert free_places([*full, loaded("c")], admission, {"c": 3}, {"c": 1}, {}) == 2
    assert free_places([loaded("c")], admission, {"c": 3}, {"c": 3}, {}) == 0
    # An unknown load (a failed scrape) saturates nothing.
    assert free_places([loaded("c", waiting=50, known=False)], admission, {}, {}, {}) == math.inf


def test_requests_that_ended_since_a_scrape_give_back_the_places_it_shows_taken():
    admission = AdmissionConfig(saturation_waiting=5, saturation_kv_cache=0.8)
    # Two of this process's requests ended since the KV-cache scrape: two places.
    assert free_places([loaded("b", kv=1.0)], admission, {}, {"b": 2}, {"b": 4}) == 2
    assert free_places([loaded("b", kv=1.0)], admission, {"b": 3}, {"b": 2}, {"b": 4}) == 1  # its bound first
    # Six waiting at the scrape, two ended since: four waiting, one place under the threshold.
    assert free_places([loaded("a", waiting=6)], admission, {}, {"a": 1}, {"a": 3}) == 1
    assert free_places([loaded("a", waiting=9)], admission, {}, {"a": 1}, {"a": 3}) == 0


def test_priority_headroom_fills_a_node_early_below_the_top_tenant_priority():
    admission = AdmissionConfig(priority_headroom=1)
    tenants = (TenantConfig(name="low", priority=0), TenantConfig(name="high", priority=10))
    config = Config(tenants=tenants, admission=admission)
    assert [priority_headroom(config, priority) for priority in (0, 9, 10, 11)] == [1, 1, 0, 0]
    assert priority_headroom(Config(tenants=tenants), 0) == 0  # no headroom configured
    # One of three places in flight: two left at the top priority, one below it.
    assert free_places([loaded("c")], admission, {"c": 3}, {"c": 1}, {}, headroom=0) == 2
    assert free_places([loaded("c")], admission, {"c": 3}, {"c": 1}, {}, headroom=1) == 1
    assert free_places([loaded("c")], admission, {"c": 3}, {"c": 2}, {}, headroom=1) == 0
    # A node without a max_in_flight has no places to keep.
    assert free_places([loaded("d")], admission, {}, {"d": 9}, {}, headroom=1) == math.inf


def test_on_a_priority_scheduled_node_lower_priority_requests_hold_no_place():
    admission = AdmissionConfig(saturation_waiting=5, saturation_kv_cache=0.8)
    # Five in flight of a max_in_flight of five, its KV cache full: saturated, unless three of
    # them are of lower priorities (the node preempts them): then three places.
    assert free_places([loaded("p", kv=1.0)], admission, {"p": 5}, {"p": 5}, {"p": 5}) == 0
    assert free_places([loaded("p", kv=1.0)], admission, {"p": 5}, {"p": 5}, {"p": 5}, preemptible={"p": 3}) == 3
    # Of equal or higher priorities, the other two still count against max_in_flight.
    assert free_places([loaded("p")], admission, {"p": 2}, {"p": 5}, {}, preemptible={"p": 3}) == 0
    # Nodes the lower ones wait on count too: six waiting, of which four could be preempted.
    assert free_places([loaded("p", waiting=6)], admission, {}, {"p": 4}, {"p": 4}, preemptible={"p": 4}) == 3


def test_a_tenant_goes_ahead_of_its_priority_while_it_holds_less_than_its_fair_share():
    # With one more request, fewer than the average of the tenants with requests in flight.
    assert under_fair_share(FairShare(tenant_in_flight=0, priority_in_flight=2, tenants=2))
    assert under_fair_share(FairShare(tenant_in_flight=3, priority_in_flight=10, tenants=2))
    assert not under_fair_share(FairShare(tenant_in_flight=0, priority_in_flight=1, tenants=2))  # then one each
    assert not under_fair_share(FairShare(tenant_in_flight=5, priority_in_flight=10, tenants=2))
    assert not under_fair_share(FairShare(tenant_in_flight=4, priority_in_flight=4, tenants=1))  # alone
    # Its rank: twice its priority, one more ahead of it; the next priority stays above.
    assert [rank(0, False), rank(0, True), rank(1, False), rank(-1, True)] == [0, 1, 2, -1]

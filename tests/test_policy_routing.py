"""Routing policies in the live gateway: the node each policy chooses, the in-flight counts it
reads, and the reasons every decision record carries (`interlock explain` shows them).

Real sockets throughout: simulated nodes, the real gateway. A node is made busy by requests sent
straight to it that it holds (a long time to first token); the gateway learns of them from its
load scrape, as it would of any other client's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import httpx
import pytest
import trio

from controlplane.rules.policies import OVER_LOAD_BOUND
from controlplane.rules.prefix import prompt_prefix
from fixtures.node import SimulatedNode
from interlock.cli import main

from test_workers import health_by_worker
from harness import MODEL, Gateway, chat, completions_to, decision_records, node_specs, nodes_and_gateway, table

CHAT = "/v1/chat/completions"
SCRAPED = {"load_scrape_interval": "50ms"}


@asynccontextmanager
async def held_requests(node: SimulatedNode, count: int) -> AsyncIterator[None]:
    """`count` requests sent straight to `node`, running there (unanswered) until the block ends."""
    ttft = node.behaviour.ttft
    node.behaviour.ttft = 600.0
    arrived = len(completions_to(node)) + count
    async with httpx.AsyncClient(timeout=None, trust_env=False) as http, trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(partial(http.post, node.url + CHAT, json=chat()))
        while len(completions_to(node)) < arrived:
            await trio.sleep(0.01)
        node.behaviour.ttft = ttft  # the requests held already keep waiting; new ones do not
        yield
        nursery.cancel_scope.cancel()


async def seen_busy(gateway: Gateway, node: SimulatedNode, queued: int) -> None:
    await gateway.wait_for(lambda: gateway.node(node.host).load.queued == queued)


async def scraped_idle(gateway: Gateway) -> None:
    """Until every node's last scrape, taken from now on, says it runs nothing: the next decision
    sees idle nodes, not a scrape taken while the last request ran."""
    moment = gateway.control_plane.view.now()
    await gateway.wait_for(
        lambda: all(node.load.scraped_at > moment and node.load.queued == 0 for node in gateway.nodes())
    )


async def served_by(gateway: Gateway, body: dict, request_id: str | None = None, model: str = MODEL) -> str:
    headers = {"X-Request-Id": request_id} if request_id else {}
    response = await gateway.http.post(gateway.url + CHAT, json=body | {"model": model}, headers=headers)
    assert response.status_code == 200
    return response.headers["x-interlock-node"]


def recorded(gateway: Gateway, decisions, request_id: str):
    [record] = [record for record in decision_records(decisions) if record.request_id == request_id]
    return record


async def test_least_load_avoids_the_node_that_runs_requests(tmp_path):
    decisions = tmp_path / "decisions.jsonl"
    routing = {"policy": "least_load", **SCRAPED}
    async with nodes_and_gateway(tmp_path, node_specs(3), routing=routing, decision_log=str(decisions)) as (
        nodes,
        gateway,
    ):
        busy, n2, n3 = nodes
        await gateway.discovered()
        async with held_requests(busy, 3):
            await seen_busy(gateway, busy, 3)
            picks = [await served_by(gateway, chat(), f"r{i}") for i in range(6)]
            await gateway.wait_for(lambda: len(decision_records(decisions)) >= 6)
        first = recorded(gateway, decisions, "r0")
        picks_metric = await gateway.metric('interlock_routing_picks_total{policy="least_load"}')
    assert sorted(set(picks)) == ["n2", "n3"]  # ties between the idle ones go by the round-robin order
    assert (first.policy, first.margin) == ("least_load", 0.0)
    chosen, tied, avoided = first.candidates
    assert (chosen.node, tied.node, avoided.node) == (n2.host, n3.host, busy.host)
    assert (avoided.running or 0) + (avoided.waiting or 0) == avoided.score == 3
    assert chosen.score == tied.score == 0 and chosen.in_flight == 0
    assert picks_metric == 6


async def test_round_robin_picks_as_plinth_and_records_its_turns(tmp_path):
    decisions = tmp_path / "decisions.jsonl"
    async with nodes_and_gateway(tmp_path, node_specs(2), decision_log=str(decisions)) as (nodes, gateway):
        await gateway.discovered()
        picks = [await served_by(gateway, chat(), f"r{i}") for i in range(4)]
        await gateway.wait_for(lambda: len(decision_records(decisions)) == 4)
        picks_metric = await gateway.metric('interlock_routing_picks_total{policy="round_robin"}')
    records = [recorded(gateway, decisions, f"r{i}") for i in range(4)]
    assert picks == ["n1", "n2", "n1", "n2"]
    assert [record.rotation for record in records] == [0, 1, 2, 3]
    assert [[candidate.node for candidate in record.candidates] for record in records[:2]] == [
        [nodes[0].host, nodes[1].host],
        [nodes[1].host, nodes[0].host],
    ]
    assert {record.policy for record in records} == {"round_robin"} and {record.margin for record in records} == {1.0}
    assert len({record.prefix for record in records}) == 1 and len(records[0].prefix) == 16  # the same prompt
    assert picks_metric == 4


async def test_power_of_two_repeats_its_draw_for_the_same_request_id(tmp_path):
    routing = {"policy": "power_of_two", **SCRAPED}
    async with nodes_and_gateway(tmp_path, node_specs(3), routing=routing) as (nodes, gateway):
        await gateway.discovered()
        await gateway.wait_for(lambda: all(node.load.known for node in gateway.nodes()))
        first, again = [], []
        for picks in (first, again):
            for i in range(12):
                picks.append(await served_by(gateway, chat(), f"id-{i}"))
                await scraped_idle(gateway)
    assert first == again  # loads equal: the first drawn wins, and the draw follows the id
    assert len(set(first)) > 1


def system_prompt(topic: str) -> dict:
    return chat(messages=[{"role": "system", "content": f"You answer questions about {topic}."}])


async def test_prefix_affinity_keeps_a_prefix_on_one_node_until_it_is_over_the_load_bound_then_on_the_next(
    tmp_path, capsys
):
    decisions = tmp_path / "decisions.jsonl"
    routing = {"policy": "prefix_affinity", "load_bound": 1.25, **SCRAPED}
    async with nodes_and_gateway(tmp_path, node_specs(3), routing=routing, decision_log=str(decisions)) as (
        nodes,
        gateway,
    ):
        await gateway.discovered()
        await gateway.wait_for(lambda: all(node.load.known for node in gateway.nodes()))
        topics = [f"topic {i}" for i in range(12)]
        homes, repeated = {}, {}
        for served in (homes, repeated):
            for topic in topics:
                served[topic] = await served_by(gateway, system_prompt(topic))
                await scraped_idle(gateway)
        home = next(node for node in nodes if node.name == homes["topic 0"])
        async with held_requests(home, 3):
            await seen_busy(gateway, home, 3)
            moved = await served_by(gateway, system_prompt("topic 0"), "moved")
        await scraped_idle(gateway)
        stayed = await served_by(gateway, system_prompt("topic 0"), "stayed")
        await gateway.wait_for(lambda: len(decision_records(decisions)) == 26)
    assert repeated == homes and len(set(homes.values())) > 1  # prefixes spread, each keeps its node
    assert moved != home.name
    record = recorded(gateway, decisions, "moved")
    assert record.candidates[-1].node == home.host and record.candidates[-1].note == OVER_LOAD_BOUND
    assert record.remembered == home.host
    assert record.prefix == prompt_prefix(CHAT, _encoded(system_prompt("topic 0")), messages=0, limit=512)
    # Its first node has room again, but the prefix stays where it went (whose cache now has it).
    assert stayed == moved
    moved_host = next(node.host for node in nodes if node.name == moved)
    assert recorded(gateway, decisions, "stayed").remembered == moved_host
    assert main(["explain", "--request-id", "stayed", "--decisions", str(decisions)]) == 0
    policy_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("policy "))
    assert policy_line.endswith(f", last sent to {moved_host}")


def _encoded(body: dict) -> bytes:
    return httpx.Request("POST", "http://x", json=body | {"model": MODEL}).content


async def test_a_models_own_policy_overrides_the_clusters(tmp_path):
    models = [(MODEL, ""), ("loaded-model", "", "least_load")]
    specs = node_specs(2, serving=(MODEL, "loaded-model"))
    async with nodes_and_gateway(tmp_path, specs, models=models, routing=SCRAPED) as (nodes, gateway):
        busy, idle = nodes
        await gateway.discovered()
        async with held_requests(busy, 2):
            await seen_busy(gateway, busy, 2)
            round_robin = [await served_by(gateway, chat()) for _ in range(4)]
            least_load = [await served_by(gateway, chat(), model="loaded-model") for _ in range(4)]
    assert sorted(round_robin) == ["n1", "n1", "n2", "n2"]
    assert least_load == [idle.name] * 4


async def test_in_flight_counts_follow_streams_and_return_to_zero_after_clients_leave_and_nodes_refuse(tmp_path):
    decisions = tmp_path / "decisions.jsonl"
    routing = {"policy": "least_load", "load_scrape_interval": "0s"}  # load unknown: in flight decides
    async with nodes_and_gateway(tmp_path, node_specs(2), routing=routing, decision_log=str(decisions)) as (
        nodes,
        gateway,
    ):
        first, second = nodes
        await gateway.discovered()
        first.behaviour.ttft = 600.0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(gateway.http.post, gateway.url + CHAT, json=chat(stream=True)))
            await gateway.wait_for(lambda: len(completions_to(first)) == 1)
            beside = await served_by(gateway, chat(), "beside-a-stream")
            nursery.cancel_scope.cancel()  # the streaming client leaves
        first.behaviour.ttft = 0.0
        afterwards = await served_by(gateway, chat(), "after-the-client-left")
        first.behaviour.refuse = True
        for number in range(2):  # one of them tries n1 (it refuses: the request is retried on n2)
            assert await served_by(gateway, chat(), f"refused-{number}") == second.name
        in_flight_to_first = await gateway.metric(f'interlock_node_requests_in_flight{{node="{first.host}"}}')
        await gateway.wait_for(lambda: len(decision_records(decisions)) == 5)
    assert beside == second.name
    busy = {candidate.node: candidate.in_flight for candidate in recorded(gateway, decisions, "beside-a-stream").candidates}
    assert busy == {first.host: 1, second.host: 0}
    after = recorded(gateway, decisions, "after-the-client-left")
    assert {candidate.in_flight for candidate in after.candidates} == {0} and afterwards in ("n1", "n2")
    refused = [recorded(gateway, decisions, f"refused-{number}") for number in range(2)]
    assert [attempt.outcome for record in refused for attempt in record.attempts].count("retried") == 1
    assert in_flight_to_first == 0


async def test_explain_shows_the_candidates_scores(tmp_path, capsys):
    decisions = tmp_path / "decisions.jsonl"
    routing = {"policy": "least_load", **SCRAPED}
    async with nodes_and_gateway(tmp_path, node_specs(2), routing=routing, decision_log=str(decisions)) as (
        nodes,
        gateway,
    ):
        busy, idle = nodes
        await gateway.discovered()
        async with held_requests(busy, 2):
            await seen_busy(gateway, busy, 2)
            await served_by(gateway, chat(), "explained")
            await gateway.wait_for(lambda: len(decision_records(decisions)) == 1)
    assert main(["explain", "--request-id", "explained", "--decisions", str(decisions)]) == 0
    out = capsys.readouterr().out
    policy_line = next(line for line in out.splitlines() if line.startswith("policy "))
    assert policy_line.split(None, 1)[1].startswith("least_load, margin 2, prefix ")
    chosen, other = table(out, "CANDIDATE")
    assert chosen["CANDIDATE"] == f"* {idle.host}" and chosen["SCORE"] == "0" and chosen["RUNNING"] == "0"
    assert other["CANDIDATE"] == busy.host and other["SCORE"] == "2" and other["NOTE"] == "-"
    assert int(other["RUNNING"]) + int(other["WAITING"]) == 2 and other["IN FLIGHT"] == "0"


@pytest.mark.parametrize(
    ("path", "body", "same_as", "messages"),
    [
        # The first message decides when prefix_messages = 1; later turns do not.
        (CHAT, {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "B"}]}, "S", 1),
        # Content given as parts: their text, in order.
        (CHAT, {"messages": [{"role": "system", "content": [{"type": "text", "text": "S"}]}]}, "S", 0),
        # A completion's batch: its first prompt.
        ("/v1/completions", {"prompt": ["P", "Q"]}, "P", 0),
    ],
)
def test_prompt_prefixes(path, body, same_as, messages):
    single = (
        {"messages": [{"role": "system", "content": same_as}]} if path == CHAT else {"prompt": same_as}
    )
    encode = lambda payload: httpx.Request("POST", "http://x", json=payload).content  # noqa: E731
    assert prompt_prefix(path, encode(body), messages=messages, limit=512) == prompt_prefix(
        path, encode(single), messages=messages, limit=512
    )


def test_prompt_prefixes_are_cut_and_a_prompt_of_another_shape_has_none():
    long_a, long_b = ("x" * 600 + "a").encode(), ("x" * 600 + "b").encode()
    completion = lambda prompt: b'{"prompt": "' + prompt + b'"}'  # noqa: E731
    assert prompt_prefix("/v1/completions", completion(long_a), messages=0, limit=512) == prompt_prefix(
        "/v1/completions", completion(long_b), messages=0, limit=512
    )
    assert prompt_prefix("/v1/completions", completion(long_a), messages=0, limit=1024) != prompt_prefix(
        "/v1/completions", completion(long_b), messages=0, limit=1024
    )
    assert prompt_prefix("/v1/completions", b'{"prompt": [1, 2, 3]}', messages=0, limit=512) != ""
    for odd in (b'{"messages": "hi"}', b'{"messages": []}', b"[1]", b'{"model": "m"}'):
        assert prompt_prefix(CHAT, odd, messages=0, limit=512) == ""


async def test_workers_route_by_policy_and_record_which_worker_chose(tmp_path):
    decisions = tmp_path / "decisions.jsonl"
    routing = {"policy": "least_load", **SCRAPED}
    async with nodes_and_gateway(
        tmp_path, node_specs(2), workers=2, routing=routing, decision_log=str(decisions), health_interval="0.1s"
    ) as (nodes, gateway):
        busy, idle = nodes
        await gateway.discovered()
        async with held_requests(busy, 2), httpx.AsyncClient(timeout=60, trust_env=False) as http:
            await seen_busy(gateway, busy, 2)
            seq = gateway.control_plane.view.snapshot.seq
            while min(int(answer.headers["x-interlock-seq"]) for answer in (await health_by_worker(gateway.url, (1, 2))).values()) < seq:
                await trio.sleep(0.01)
            workers: Counter[int] = Counter()
            for attempt in range(200):
                response = await http.post(gateway.url + CHAT, json=chat(), headers={"Connection": "close"})
                assert response.headers["x-interlock-node"] == idle.name
                await trio.sleep(0.01)
                workers = Counter(record.worker for record in decision_records(decisions))
                if len(workers) == 2:
                    break
    assert set(workers) == {1, 2}
    records = decision_records(decisions)
    assert {record.policy for record in records} == {"least_load"}
    assert all(record.candidates[0].node == idle.host for record in records)

"""Load as events: the control plane scrapes each node's vLLM `/metrics` (requests running and
waiting, KV-cache usage) into LoadScraped events, at the config's interval, and shows the result
in the state, /health, `interlock replay` and its own metrics. Real sockets throughout: simulated
nodes, raw servers for hostile answers, the real control plane and gateway.

Control-plane tests run under `fast_clock` (ten virtual seconds a real one); they count what
happened, never how fast.
"""

from __future__ import annotations

from functools import partial

import httpx
import pytest
import trio

from controlplane.effects.probes import (
    LOAD_METRICS_MISSING,
    MAX_BODY_BYTES,
    ProbeClient,
    ProbeError,
    VllmLoad,
    parse_vllm_load,
    scrape_load,
)
from controlplane.effects.replay import replay
from controlplane.effects.control_plane import open_control_plane
from events.config import NodeConfig
from events.state import Health
from events.types import LoadScraped
from fixtures.node import serve_nodes
from interlock.cli import main
from transport.readiness import drive
from harness import MODEL, chat, node_specs, running_gateway
from raw_http import ServerConnection, answer_each, raw_node, raw_server
from test_runtime import control_plane_options, eventually, requests_to, sample

CHAT = "/v1/chat/completions"
EVERY_SECOND = {"load_scrape_interval": "1s"}


def prometheus_answer(body: bytes, status: bytes = b"200 OK") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body)


def load_lines(json_log, ip: str) -> list[str]:
    """The load transitions logged for a node."""
    return [message for message in json_log.messages(node=ip) if message.startswith("node load")]


# --- the parser ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        # vLLM before the V1 engine: the KV-cache gauge's older name, one model's labels.
        (
            b"# HELP vllm:num_requests_running Number of requests currently running on GPU.\n"
            b"# TYPE vllm:num_requests_running gauge\n"
            b'vllm:num_requests_running{model_name="m"} 3.0\n'
            b"# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            b"# TYPE vllm:num_requests_waiting gauge\n"
            b'vllm:num_requests_waiting{model_name="m"} 2.0\n'
            b'vllm:gpu_cache_usage_perc{model_name="m"} 0.42\n',
            (3.0, 2.0, 0.42),
        ),
        # The V1 engine: the newer name, an engine label per data-parallel engine (summed; the
        # fullest cache counts).
        (
            b'vllm:num_requests_running{engine="0",model_name="m"} 4\n'
            b'vllm:num_requests_running{engine="1",model_name="m"} 1\n'
            b'vllm:num_requests_waiting{engine="0",model_name="m"} 0\n'
            b'vllm:num_requests_waiting{engine="1",model_name="m"} 7\n'
            b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.1\n'
            b'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.9\n',
            (5.0, 7.0, 0.9),
        ),
        # Both names during vLLM's deprecation period; no labels at all; CRLF line ends.
        (
            b"vllm:num_requests_running 1\r\nvllm:num_requests_waiting 0\r\n"
            b"vllm:gpu_cache_usage_perc 0.25\r\nvllm:kv_cache_usage_perc 0.25\r\n",
            (1.0, 0.0, 0.25),
        ),
        # Exposition-format details: a timestamp after the value, tabs, an empty label set,
        # label values holding escaped quotes, braces, spaces and newlines.
        (
            b'vllm:num_requests_running{model_name="a \\"b\\" {c} d\\\\",x="\\n"} 2 1700000000000\n'
            b"vllm:num_requests_running{}\t3\n"
            b"vllm:num_requests_waiting {model_name=\"m\"} 1e1\n",
            (5.0, 10.0, None),
        ),
        # Samples that are not load: NaN, infinities, negatives, junk, longer names, other
        # metrics whose labels mention the gauges, comments naming them, a torn last line.
        (
            b"vllm:num_requests_running NaN\n"
            b"vllm:num_requests_running +Inf\n"
            b"vllm:num_requests_running -1\n"
            b"vllm:num_requests_running many\n"
            b"vllm:num_requests_running_max 100\n"
            b'other{of="vllm:num_requests_running"} 50\n'
            b"# vllm:num_requests_waiting 60\n"
            b"  vllm:num_requests_waiting 70\n"
            b"vllm:num_requests_running 6\n"
            b"vllm:kv_cache_usage_perc NaN\n"
            b'vllm:num_requests_waiting{model_name="m',
            (6.0, 0.0, None),
        ),
        # Only one of the two gauges: the other counts 0.
        (b"vllm:num_requests_waiting 3\n", (0.0, 3.0, None)),
        # Not UTF-8 elsewhere in the body.
        (b"\xff\xfe junk\nvllm:num_requests_running 2\n", (2.0, 0.0, None)),
        # The time-between-tokens histogram: sum and count, summed over engines; its buckets and
        # other histograms' sums are not read.
        (
            b"vllm:num_requests_running 1\n"
            b'vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf"} 400\n'
            b'vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 8.0\n'
            b'vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 400\n'
            b'vllm:inter_token_latency_seconds_sum{engine="1",model_name="m"} 2.0\n'
            b'vllm:inter_token_latency_seconds_count{engine="1",model_name="m"} 100\n'
            b"vllm:e2e_request_latency_seconds_sum 99\n",
            (1.0, 0.0, None, 10.0, 500.0),
        ),
        # Both histogram names during vLLM's deprecation period: the newer one is read; the older
        # name alone is read too; a sum without its count is not a mean.
        (
            b"vllm:num_requests_running 1\n"
            b"vllm:time_per_output_token_seconds_sum 5\nvllm:time_per_output_token_seconds_count 50\n"
            b"vllm:inter_token_latency_seconds_sum 4\nvllm:inter_token_latency_seconds_count 40\n",
            (1.0, 0.0, None, 4.0, 40.0),
        ),
        (
            b"vllm:num_requests_running 1\n"
            b"vllm:time_per_output_token_seconds_sum 5\nvllm:time_per_output_token_seconds_count 50\n",
            (1.0, 0.0, None, 5.0, 50.0),
        ),
        (b"vllm:num_requests_running 1\nvllm:inter_token_latency_seconds_sum 4\n", (1.0, 0.0, None)),
        # Numbers the text format does not allow, though Python's float() takes them: underscores,
        # digits other than ASCII's (as the GPU scrape reads them).
        (
            b"vllm:num_requests_running 1_000\nvllm:num_requests_waiting 2\n"
            b"vllm:num_requests_waiting \xd9\xa1\xd9\xa2\nvllm:kv_cache_usage_perc 0_1\n",
            (0.0, 2.0, None),
        ),
    ],
    ids=[
        *("older-vllm", "v1-engines", "both-cache-names", "exposition-details", "junk", "one-gauge", "not-utf8"),
        *("token-histogram", "both-histogram-names", "older-histogram-name", "sum-without-count"),
        "not-prometheus-numbers",
    ],
)
def test_parse_vllm_load(body, expected):
    assert parse_vllm_load(body) == VllmLoad(*expected)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"# HELP vllm:num_requests_running Number of requests currently running on GPU.\n",
        b"vllm:gpu_cache_usage_perc 0.5\n",  # cache usage alone says nothing of the requests
        b"vllm:inter_token_latency_seconds_sum 4\nvllm:inter_token_latency_seconds_count 40\n",  # nor speed
        b"vllm:num_requests_running NaN\nvllm:num_requests_waiting +Inf\n",
        b"gpu_utilization_percent{gpu=\"GPU-a\"} 42\n",  # a gpu-exporter's answer
        b'{"object": "list"}',
    ],
)
def test_a_body_without_the_request_gauges_is_missing_load(body):
    with pytest.raises(ProbeError, match=LOAD_METRICS_MISSING):
        parse_vllm_load(body)


# --- one scrape against a raw server ---------------------------------------------------------


async def scrape_raw(*answers: bytes, authorization: bytes = b"", timeout: float = 5.0) -> tuple[LoadScraped, list]:
    """Scrape a raw server answering `answers`; the event and the requests it received."""
    async with raw_server(answer_each(*answers)) as server, ProbeClient() as client:
        node = NodeConfig(ip="127.0.0.1", vllm_port=server.port, metrics_port=1)
        event = await drive_scrape(client, node, timeout, authorization)
    return event, [request for _, request in server.requests]


async def drive_scrape(client: ProbeClient, node: NodeConfig, timeout: float, authorization: bytes) -> LoadScraped:
    return await drive(scrape_load(client, node, timeout=timeout, now=lambda: 1.0, authorization=authorization))


async def test_a_scrape_gets_the_vllm_ports_metrics_with_the_nodes_key():
    body = b'vllm:num_requests_running{model_name="m"} 3\nvllm:num_requests_waiting{model_name="m"} 1\n'
    event, [request] = await scrape_raw(prometheus_answer(body), authorization=b"Bearer k-1")
    assert event == LoadScraped(at=1.0, node="127.0.0.1", running=3.0, waiting=1.0)
    head = request.lower()
    assert head.startswith(b"get /metrics http/1.1\r\n")
    assert b"\r\nauthorization: bearer k-1\r\n" in head


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (prometheus_answer(b"vllm:num_requests_running 1\n", b"500 Internal Server Error"), "returned status 500"),
        (prometheus_answer(b'{"detail":"Not Found"}', b"404 Not Found"), "returned status 404"),
        (prometheus_answer(b"# nothing\n"), LOAD_METRICS_MISSING),
        (b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1), "exceeds"),
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "malformed status line"),
    ],
    ids=["500", "404", "no-gauges", "oversized", "not-http"],
)
async def test_a_scrape_without_usable_load_is_an_error_event(answer, error):
    event, _ = await scrape_raw(answer)
    assert (event.running, event.waiting, event.kv_cache_usage) == (None, None, None)
    assert error in event.error


async def test_a_scrape_that_hangs_ends_at_the_probe_timeout(fast_clock):
    async def hang(connection: ServerConnection) -> None:
        await connection.request()
        await connection.wait_closed_by_client()

    async with raw_server(hang) as server, ProbeClient() as client:
        node = NodeConfig(ip="127.0.0.1", vllm_port=server.port)
        event = await drive_scrape(client, node, 7.0, b"")
    assert event.error == f'Get "http://127.0.0.1:{server.port}/metrics": timed out after 7s'


# --- scraping in the live control plane ------------------------------------------------------


async def test_the_scrape_sees_the_requests_a_node_is_running(fast_clock, gateway_config, json_log):
    async with serve_nodes(node_specs(1, ttft=600.0)) as nodes:
        node = nodes[0]
        path = gateway_config(nodes, health_interval="1s", routing=EVERY_SECOND)
        async with open_control_plane(path, **control_plane_options(json_log)) as control_plane:
            load = lambda: control_plane.view.snapshot.nodes[node.host].load  # noqa: E731
            await eventually(lambda: load().known)
            assert (load().running, load().waiting) == (0.0, 0.0)
            async with httpx.AsyncClient(timeout=None) as http, trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(partial(http.post, node.url + CHAT, json=chat()))
                await eventually(lambda: load().queued == 3)  # running, or waiting for a place in the batch
                assert 0 < load().kv_cache_usage <= 1  # the simulated node's cache fills with its batch
                nursery.cancel_scope.cancel()  # the clients leave: the node stops running them
            await eventually(lambda: load().queued == 0)
            assert load().known and load().fails == 0
    scrapes = [request for request in node.requests if request.path == "/metrics"]
    assert {request.listener for request in scrapes} == {"vllm", "metrics"}  # vLLM's and the GPU exporter's
    assert load_lines(json_log, node.host) == []  # a load known throughout logs nothing


@pytest.mark.parametrize(
    "routing",
    [None, {"policy": "round_robin"}, {"policy": "least_load", "load_scrape_interval": "0s"}],
    ids=["default", "round-robin", "interval-0"],
)
async def test_no_load_is_scraped_when_the_interval_is_zero(fast_clock, gateway_config, json_log, routing):
    async with serve_nodes(node_specs(2)) as nodes:
        path = gateway_config(nodes, health_interval="1s", routing=routing)
        async with open_control_plane(path, **control_plane_options(json_log)) as control_plane:
            assert control_plane.view.snapshot.config.load_scrape_interval() == 0
            await eventually(lambda: all(requests_to(node, "/health") >= 5 for node in nodes))
            loads = [node.load for node in control_plane.view.snapshot.node_list()]
    assert all(requests_to(node, "/metrics") == 0 for node in nodes)
    assert all(load.scraped_at is None and load.fails == 0 for load in loads)


async def test_a_reload_changes_the_interval_and_the_nodes_scraped(fast_clock, gateway_config, json_log):
    async with serve_nodes(node_specs(3)) as nodes:
        first, second, added = nodes
        scrapes = lambda node: requests_to(node, "/metrics")  # noqa: E731
        path = gateway_config([first, second], health_interval="1s", routing={"load_scrape_interval": "1h"})
        async with open_control_plane(path, **control_plane_options(json_log)) as control_plane:
            await eventually(lambda: scrapes(first) == 1 and scrapes(second) == 1)  # at once, then not for an hour
            await eventually(lambda: requests_to(first, "/health") >= 3)
            assert scrapes(first) == 1

            gateway_config([first, added], health_interval="1s", routing=EVERY_SECOND)
            assert await control_plane.reload()
            with trio.fail_after(300):  # virtual seconds: far less than the hour the old interval had left
                await eventually(lambda: scrapes(first) >= 4 and scrapes(added) >= 3)
            assert scrapes(second) == 1  # removed: no longer scraped
            assert sample(control_plane, "interlock_node_load_known", node=second.host) is None

            gateway_config([first, added], health_interval="1s", routing={"load_scrape_interval": "0s"})
            assert await control_plane.reload()
            stopped_at = scrapes(first)
            await eventually(lambda: requests_to(first, "/health") >= stopped_at + 5)
            assert scrapes(first) <= stopped_at + 1  # one may have been in flight

            gateway_config([first, added], health_interval="1s", routing={"policy": "power_of_two"})
            assert await control_plane.reload()  # unset under a load-aware policy: the default interval
            await eventually(lambda: scrapes(first) >= stopped_at + 3)
            assert control_plane.view.snapshot.config.model_policy(MODEL) == "power_of_two"


async def test_one_scrape_per_node_at_a_time_and_a_hung_one_makes_the_load_unknown(
    fast_clock, gateway_config, json_log
):
    asked = []

    async def never_answer(connection: ServerConnection) -> None:
        asked.append(trio.current_time())
        await connection.wait_closed_by_client()  # at the scrape's timeout

    async with raw_node(metrics=never_answer) as node:
        node.metrics_port = 1  # no GPU exporter: its /metrics scrapes are refused, never counted here
        path = gateway_config([node], health_interval="1s", probe_timeout="30s", routing=EVERY_SECOND)
        async with open_control_plane(path, **control_plane_options(json_log)) as control_plane:
            state = lambda: control_plane.view.snapshot.nodes[node.host]  # noqa: E731
            await eventually(lambda: state().load.fails >= 2, timeout=120)
            assert state().status == Health.HEALTHY  # unknown load is not ill health
            assert "timed out after 30s" in state().load.last_error
    # Ticks every second, each scrape hanging for 30 s: the ticks in between were skipped (a
    # scrape a tick would have asked about 60 times).
    assert 2 <= len(asked) <= 4
    assert load_lines(json_log, node.host) == ["node load unknown"]


async def test_the_load_gauges_follow_the_scrapes_and_go_with_the_node(fast_clock, gateway_config, json_log):
    async with serve_nodes(node_specs(2)) as nodes:
        kept, removed = nodes
        path = gateway_config(nodes, health_interval="1s", routing=EVERY_SECOND)
        async with open_control_plane(path, **control_plane_options(json_log)) as control_plane:
            await eventually(lambda: all(node.load.known for node in control_plane.view.snapshot.node_list()))
            for node in nodes:
                assert sample(control_plane, "interlock_node_load_known", node=node.host) == 1
                assert sample(control_plane, "interlock_node_requests_running", node=node.host) == 0
                assert sample(control_plane, "interlock_node_requests_waiting", node=node.host) == 0
                assert 0 <= sample(control_plane, "interlock_node_kv_cache_usage", node=node.host) <= 1
            kept.behaviour.refuse = True
            await eventually(lambda: not control_plane.view.snapshot.nodes[kept.host].load.known)
            assert sample(control_plane, "interlock_node_load_known", node=kept.host) == 0
            assert sample(control_plane, "interlock_node_requests_running", node=kept.host) == 0  # as last known
            gateway_config([kept], health_interval="1s", routing=EVERY_SECOND)
            assert await control_plane.reload()
            for name in ("load_known", "requests_running", "requests_waiting", "kv_cache_usage"):
                assert sample(control_plane, f"interlock_node_{name}", node=removed.host) is None


async def test_replaying_a_live_log_with_load_scrapes_reproduces_its_transition_log(
    fast_clock, gateway_config, json_log, tmp_path
):
    event_log = tmp_path / "events.jsonl"
    async with serve_nodes(node_specs(2)) as nodes:
        flaky, steady = nodes
        options = {"health_interval": "1s", "health_fail_threshold": 2, "event_log": str(event_log)}
        path = gateway_config(nodes, routing=EVERY_SECOND, **options)
        async with open_control_plane(path, **control_plane_options(json_log)) as control_plane:
            node = lambda ip: control_plane.view.snapshot.nodes[ip]  # noqa: E731
            await eventually(lambda: node(flaky.host).load.known and node(steady.host).load.known)
            flaky.behaviour.refuse = True
            await eventually(lambda: node(flaky.host).load.fails >= 2 and node(flaky.host).status == Health.DEAD)
            flaky.behaviour.refuse = False
            await eventually(lambda: node(flaky.host).load.known and node(flaky.host).status == Health.HEALTHY)
            gateway_config(nodes, routing={"load_scrape_interval": "2s", "policy": "least_load"}, **options)
            assert await control_plane.reload()
            seq = control_plane.view.snapshot.seq
            await eventually(lambda: control_plane.view.snapshot.seq > seq + 10)
    live = [line for line in json_log.lines() if '"seq":' in line]
    replayed = replay([event_log])
    assert [transition.log_line() for transition in replayed.transitions] == live
    assert replayed.state.nodes[flaky.host].load == node(flaky.host).load
    assert load_lines(json_log, flaky.host) == ["node load unknown", "node load known again"]


# --- what the gateway shows and does ---------------------------------------------------------


async def test_health_shows_each_nodes_load_only_when_load_is_scraped(tmp_path):
    refused = prometheus_answer(b"", b"503 Service Unavailable")
    async with serve_nodes(node_specs(1)) as nodes, raw_node(metrics=refused, host="127.0.0.3", name="raw") as raw:
        simulated = nodes[0]
        routing = {"load_scrape_interval": "50ms"}
        async with running_gateway(tmp_path, [simulated, raw], health_interval="50ms", routing=routing) as gateway:
            await gateway.wait_for(lambda: gateway.node(raw.host).load.fails >= 1)
            await gateway.wait_for(lambda: gateway.node(simulated.host).load.known)
            simulated_entry, raw_entry = (await gateway.http.get(gateway.url + "/health")).json()["details"]
        async with running_gateway(
            tmp_path, [simulated, raw], health_interval="50ms", routing=routing, health_hides_errors=True
        ) as gateway:
            await gateway.wait_for(lambda: gateway.node(raw.host).load.fails >= 1)
            hidden = (await gateway.http.get(gateway.url + "/health")).json()["details"][1]
        async with running_gateway(tmp_path, [simulated, raw], health_interval="50ms") as gateway:
            unscraped = (await gateway.http.get(gateway.url + "/health")).json()["details"]

    assert list(simulated_entry) == ["ip", "name", "status", "models", "load"]
    load = simulated_entry["load"]
    assert list(load) == [
        *("known", "running", "waiting", "kv_cache_usage", "seconds_per_token", "age_seconds", "fails", "last_error")
    ]
    assert load | {"age_seconds": 0, "kv_cache_usage": 0} == {
        "known": True,
        "running": 0.0,
        "waiting": 0.0,
        "kv_cache_usage": 0,
        "seconds_per_token": None,  # it has produced no tokens
        "age_seconds": 0,
        "fails": 0,
        "last_error": "",
    }
    assert 0 <= load["age_seconds"] < 5 and 0 <= load["kv_cache_usage"] <= 1
    assert raw_entry["status"] == "healthy"
    assert raw_entry["load"] | {"fails": 1} == {
        "known": False,
        "running": 0.0,
        "waiting": 0.0,
        "kv_cache_usage": None,
        "seconds_per_token": None,
        "age_seconds": None,
        "fails": 1,
        "last_error": "vLLM metrics endpoint returned status 503",
    }
    assert hidden["load"]["last_error"] == "(hidden: gateway.health_hides_errors)"
    assert all("load" not in entry for entry in unscraped)  # plinth's body, as it was


async def test_the_scrape_measures_each_nodes_time_between_tokens(tmp_path):
    specs = node_specs(2, tpot=0.002, tokens=6)
    specs[1].behaviour.slowness = 3.0
    async with serve_nodes(specs) as (fast, slow):
        routing = {"load_scrape_interval": "50ms"}
        async with running_gateway(tmp_path, [fast, slow], health_interval="50ms", routing=routing) as gateway:
            await gateway.wait_for(lambda: gateway.node(fast.host).load.known and gateway.node(slow.host).load.known)
            for _ in range(4):  # round robin: two to each node
                response = await gateway.http.post(gateway.url + CHAT, json=chat(stream=True))
                assert response.status_code == 200
            speed = lambda node: gateway.node(node.host).load.seconds_per_token  # noqa: E731
            await gateway.wait_for(lambda: speed(fast) is not None and speed(slow) is not None)
            health = (await gateway.http.get(gateway.url + "/health")).json()["details"]
            gauge = await gateway.metric(f'interlock_node_seconds_per_token{{node="{slow.host}"}}')
    assert speed(fast) == pytest.approx(0.002)  # the simulated node counts the gaps it waits
    assert speed(slow) == pytest.approx(0.006)
    assert [entry["load"]["seconds_per_token"] for entry in health] == pytest.approx([0.002, 0.006])
    assert gauge == pytest.approx(0.006)


async def test_a_node_whose_scrape_fails_keeps_serving_completions(tmp_path):
    completion = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 12\r\n\r\n{"ok": true}'
    garbage = prometheus_answer(b"<html>metrics moved</html>")
    async with raw_node(completion, metrics=garbage) as node:
        routing = {"policy": "least_load", "load_scrape_interval": "50ms"}
        async with running_gateway(tmp_path, [node], health_interval="50ms", routing=routing) as gateway:
            await gateway.discovered()
            await gateway.wait_for(lambda: gateway.node(node.host).load.fails >= 2)
            response = await gateway.http.post(gateway.url + CHAT, json=chat())
            assert gateway.node(node.host).load.last_error == LOAD_METRICS_MISSING
            assert gateway.logged("node load unknown")[0]["error"] == LOAD_METRICS_MISSING
    assert response.status_code == 200 and response.json() == {"ok": True}
    assert len(node.completions) == 1


async def test_check_config_names_the_policy(tmp_path, capsys):
    path = tmp_path / "gateway.toml"
    path.write_text('[routing]\npolicy = "least_load"\n[[nodes]]\nip = "10.0.0.1"\n')
    assert main(["check-config", str(path)]) == 0
    assert "routing: least_load; node load scraped every 2s" in capsys.readouterr().out
    path.write_text('[routing]\npolicy = "least_load"\nload_bound = 0.5\n[[nodes]]\nip = "10.0.0.1"\n')
    assert main(["check-config", str(path)]) != 0
    assert f"{path}: routing.load_bound: load_bound must be a finite number of at least 1" in capsys.readouterr().err


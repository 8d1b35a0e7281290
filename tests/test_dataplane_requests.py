"""The completion routes, non-streaming, step by step of plinth §4.3: body limit, parsing, default
model, ring and model routing, the attempt loop and its retries, the buffering commit gate, and
the request id with its decision record. Real gateway, real sockets, simulated nodes."""

from __future__ import annotations

import time

import msgspec
import pytest
import trio
from prometheus_client import CollectorRegistry

from controlplane.infrastructure.logs import Throttle, clipped
from controlplane.rules.reducer import OFFLINE_SECONDS
from controlplane.effects.control_plane import open_control_plane
from dataplane.attempts import new_upstream_pool
from dataplane.decisions import open_decision_log
from dataplane.exchange import Exchange
from dataplane.headers import forward_headers
from dataplane.metrics import RequestMetrics
from dataplane.planning import UNSERVED_WARNING_INTERVAL
from dataplane.views import SnapshotViews
from events.decisions import AttemptRecord, read_decisions
from events.types import UpstreamFailed
from fixtures.node import serve_nodes
from interlock.serve import new_proxy

from harness import (
    MODEL,
    CapturedLog,
    chat,
    completions_to,
    decision_records,
    error_message,
    node_processes,
    node_specs,
    nodes_and_gateway,
    post_cut_short,
    running_gateway,
    write_config,
)

CHAT = "/v1/chat/completions"


async def raw_exchange(url: str, data: bytes) -> bytes:
    """Send raw bytes to the gateway and read until it closes the connection."""
    host, port = url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(data)
        received = b""
        with trio.fail_after(60):
            while chunk := await stream.receive_some(65536):
                received += chunk
    return received


# --- step 1: the body limit --------------------------------------------------------------------


async def test_body_over_the_limit_gets_413_and_the_connection_is_closed(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1), max_request_body_bytes=1000) as (nodes, gateway):
        head = f"POST {CHAT} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n"
        # Only part of the declared body is sent: the gateway must answer and close anyway.
        answer = await raw_exchange(gateway.url, head.encode() + b"x" * 100)
        assert answer.startswith(b"HTTP/1.1 413 ")
        assert b"\r\nconnection: close\r\n" in answer.lower()
        assert answer.endswith(b'{"error":{"message":"request body too large","type":"invalid_request_error","code":"request_too_large"}}')

        # The same with the whole body sent.
        response = await gateway.http.post(gateway.url + CHAT, content=b"z" * 5000)
        assert response.status_code == 413
        assert response.headers["connection"] == "close"

        # A chunked body without a declared length is cut off at the limit too.
        async def chunks():
            for _ in range(20):
                yield b"y" * 100

        response = await gateway.http.post(gateway.url + CHAT, content=chunks())
        assert response.status_code == 413
        assert error_message(response) == "request body too large"
        assert response.headers["connection"] == "close"

        # Within the limit is fine, and no metrics were recorded for the 413s (plinth).
        response = await gateway.http.post(gateway.url + CHAT, json=chat())
        assert response.status_code == 200
        assert len(completions_to(nodes[0])) == 1
        assert await gateway.metric('gateway_requests_total{model="test-model",status="413"}') is None


# --- step 2: parsing -------------------------------------------------------------------------


async def test_bodies_that_are_not_a_completion_request_get_400(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1), default=MODEL) as (nodes, gateway):
        for body in (b"{bad json", b'{"model": 5}', b'{"stream": "yes"}', b"[1, 2]", b'"text"', b""):
            response = await gateway.http.post(gateway.url + CHAT, content=body)
            assert response.status_code == 400, body
            assert response.json() == {
                "error": {"message": "invalid request body", "type": "invalid_request_error", "code": "invalid_request_body"}
            }
            assert "connection" not in response.headers  # the body was read: keep-alive is fine
        assert completions_to(nodes[0]) == []


# --- step 3: the default model -------------------------------------------------------------------


async def test_the_default_model_is_injected_keeping_the_rest_of_the_body_exactly(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1), default=MODEL) as (nodes, gateway):
        body = b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 0.70, "seed": 12345678901234567890, "max_tokens": 2}'
        response = await gateway.http.post(gateway.url + CHAT, content=body)
        assert response.status_code == 200
        assert response.json()["model"] == MODEL
        forwarded = completions_to(nodes[0])[-1]
        assert forwarded.body == (
            b'{"messages":[{"role": "user", "content": "hi"}],"temperature":0.70,"seed":12345678901234567890,'
            b'"max_tokens":2,"model":"test-model"}'
        )
        assert forwarded.header("content-length") == str(len(forwarded.body))

        # An empty or null model is replaced where it stands.
        for given in (b'""', b"null"):
            await gateway.http.post(gateway.url + CHAT, content=b'{"model": ' + given + b', "n": 1}')
            assert completions_to(nodes[0])[-1].body == b'{"model":"test-model","n":1}'

        # A named model: the body is forwarded byte for byte.
        body = b'{ "model" : "test-model",\n  "messages": [],  "temperature": 1.0e0 }'
        await gateway.http.post(gateway.url + CHAT, content=body)
        assert completions_to(nodes[0])[-1].body == body


async def test_no_model_and_no_default_gets_400(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1)) as (nodes, gateway):
        response = await gateway.http.post(gateway.url + "/v1/completions", json={"prompt": "hi"})
        assert response.status_code == 400
        assert error_message(response) == "model not specified and no default model is configured"
        assert completions_to(nodes[0]) == []


# --- steps 4 and 5: ring and model routing -------------------------------------------------------


async def test_requests_reach_only_the_nodes_of_the_models_ring_in_round_robin(tmp_path):
    specs = node_specs(4)
    specs[0].models = specs[1].models = ["small"]
    specs[2].models = specs[3].models = ["big"]
    async with nodes_and_gateway(
        tmp_path, specs, rings={"n3": "r1", "n4": "r1"}, models=[("small", ""), ("big", "r1")]
    ) as (nodes, gateway):
        await gateway.discovered()
        served_by = []
        for model in ["big", "big", "small", "small", "big", "big"]:
            response = await gateway.http.post(gateway.url + CHAT, json=chat(model))
            assert response.status_code == 200
            served_by.append(response.headers["x-served-by"])
        assert sorted(served_by[:2]) == ["n3", "n4"] and sorted(served_by[4:]) == ["n3", "n4"]
        assert sorted(served_by[2:4]) == ["n1", "n2"]
        assert [len(completions_to(node)) for node in nodes] == [1, 1, 2, 2]


async def test_a_configured_model_no_node_serves_gets_503_and_counts_the_exclusions(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(2), models=[(MODEL, ""), ("unlisted", "")]) as (nodes, gateway):
        await gateway.discovered()
        response = await gateway.http.post(gateway.url + CHAT, json=chat("unlisted"), headers={"X-Request-Id": "r-1"})
        assert response.status_code == 503
        assert response.json()["error"] == {
            "message": "no healthy node available",
            "type": "server_error",
            "code": "no_healthy_node",
        }
        [warning] = gateway.logged("no node serves requested model")
        assert warning == warning | {"level": "warn", "model": "unlisted", "request_id": "r-1"}
        assert await gateway.metric('gateway_model_filter_exclusions_total{model="unlisted",reason="missing"}') == 2
        assert await gateway.metric('gateway_requests_total{model="unlisted",status="503"}') == 1
        assert [completions_to(node) for node in nodes] == [[], []]


async def test_a_model_not_configured_and_listed_by_no_node_gets_vllms_404(tmp_path):
    decision_log = tmp_path / "decisions.jsonl"
    async with nodes_and_gateway(tmp_path, node_specs(2), decision_log=str(decision_log)) as (nodes, gateway):
        await gateway.discovered()
        response = await gateway.http.post(gateway.url + CHAT, json=chat("no-such`model"), headers={"X-Request-Id": "r-2"})
        assert response.status_code == 404 and response.headers["x-request-id"] == "r-2"
        assert response.json() == {
            "error": {"message": "The model `no-such`model` does not exist.", "type": "NotFoundError", "code": "model_not_found"}
        }
        [warning] = gateway.logged("no node serves requested model")
        assert warning == warning | {"level": "warn", "model": "no-such`model", "request_id": "r-2"}
        assert await gateway.metric('gateway_requests_total{model="(other)",status="404"}') == 1
        assert [completions_to(node) for node in nodes] == [[], []]
        await gateway.wait_for(lambda: decision_records(decision_log))
        [decision] = decision_records(decision_log)
    assert (decision.request_id, decision.status, decision.attempts) == ("r-2", 404, ())
    assert [exclusion.reason for exclusion in decision.excluded] == ["missing", "missing"]


async def test_a_model_only_ring_nodes_list_gets_a_404_saying_the_config_routes_it_to_the_ring(tmp_path):
    specs = node_specs(2)
    specs[1].models = ["ringed"]
    async with nodes_and_gateway(tmp_path, specs, rings={"n2": "r1"}) as (nodes, gateway):
        await gateway.discovered()
        response = await gateway.http.post(gateway.url + CHAT, json=chat("ringed"))
        retrieved = await gateway.http.get(gateway.url + "/v1/models/ringed")
        listed = (await gateway.http.get(gateway.url + "/v1/models")).json()["data"]
    hint = (
        "The model `ringed` does not exist. Only nodes of ring `r1` list it, and a ring's nodes serve only the"
        " models [[models.available]] routes to the ring (name = `ringed`, ring = `r1`)."
    )
    assert response.status_code == retrieved.status_code == 404
    assert error_message(response) == error_message(retrieved) == hint
    assert [card["id"] for card in listed] == [MODEL]
    assert completions_to(nodes[1]) == []


async def test_the_warning_for_an_unserved_model_is_rate_limited_and_counts_what_it_held_back(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1)) as (nodes, gateway):
        await gateway.discovered()
        long_name = "m" * 500  # within the model name limit, longer than a log line keeps
        for number in range(20):
            response = await gateway.http.post(gateway.url + CHAT, json=chat(long_name), headers={"X-Request-Id": f"r{number}"})
            assert response.status_code == 404
        await trio.sleep(UNSERVED_WARNING_INTERVAL)
        await gateway.http.post(gateway.url + CHAT, json=chat("last"), headers={"X-Request-Id": "last"})
        lines = gateway.logged("no node serves requested model")
    assert lines[0]["request_id"] == "r0" and "suppressed" not in lines[0]
    assert lines[-1]["request_id"] == "last" and lines[-1]["model"] == "last"
    assert sum(1 + int(line.get("suppressed", "0")) for line in lines) == 21  # each request counted once
    assert all(len(line["model"]) <= 128 for line in lines)
    assert lines[0]["model"].startswith("mmmm") and lines[0]["model"].endswith("…")


def test_a_throttle_lets_one_line_through_per_interval_and_counts_those_it_held_back():
    throttle = Throttle(1.0)
    assert [throttle.allow(at) for at in (10.0, 10.2, 10.9, 11.0, 11.5, 13.0)] == [0, None, None, 2, None, 1]
    assert clipped("short") == "short" and clipped("x" * 200, 10) == "x" * 9 + "…"


async def test_untried_nodes_pass_the_model_filter(tmp_path):
    # Model listings hang, so discovery never completes: every node stays untried.
    async with nodes_and_gateway(tmp_path, node_specs(1, serving=["other"], models="hang")) as (nodes, gateway):
        # The simulated node answers 404 for a model it does not serve: passed through, unretried.
        response = await gateway.http.post(gateway.url + CHAT, json=chat("anything"))
        assert response.status_code == 404
        assert len(completions_to(nodes[0])) == 1


# --- steps 6 and 7: the attempt loop -------------------------------------------------------------


async def test_a_refused_connection_is_retried_on_the_next_node_which_is_marked_offline(tmp_path):
    specs = node_specs(2)
    async with nodes_and_gateway(tmp_path, specs) as (nodes, gateway):
        await gateway.discovered()
        nodes[0].behaviour.refuse = True
        refused = nodes[0].host
        for _ in range(4):
            response = await gateway.http.post(gateway.url + CHAT, json=chat())
            assert response.status_code == 200
            assert response.headers["x-served-by"] == "n2"
        retries = gateway.logged("retrying after connection failure")
        assert len(retries) == 1  # later requests skip the offline node
        assert retries[0]["node"] == refused and retries[0]["level"] == "info" and retries[0]["error"]
        assert gateway.node(refused).is_offline(gateway.control_plane.view.now())
        assert [line["node"] for line in gateway.logged("node marked offline")] == [refused]
        assert await gateway.metric('gateway_proxy_attempts_total{model="test-model",status="502"}') == 1
        assert await gateway.metric('gateway_proxy_attempts_total{model="test-model",status="200"}') == 4
        assert await gateway.metric('gateway_requests_total{model="test-model",status="200"}') == 4


async def test_when_every_node_refuses_the_answer_is_no_reachable_node(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(2)) as (nodes, gateway):
        await gateway.discovered()
        for node in nodes:
            node.behaviour.refuse = True
        response = await gateway.http.post(gateway.url + CHAT, json=chat())
        assert response.status_code == 503
        assert error_message(response) == "no reachable node available"
        assert len(gateway.logged("retrying after connection failure")) == 2
        assert await gateway.metric('gateway_proxy_attempts_total{model="test-model",status="502"}') == 2
        assert await gateway.metric('gateway_requests_total{model="test-model",status="503"}') == 1
        # Both are offline now: the next request finds no candidate at all.
        await gateway.wait_for(lambda: all(gateway.node(node.host).offline_until for node in nodes))
        response = await gateway.http.post(gateway.url + CHAT, json=chat())
        assert error_message(response) == "no reachable node available"
        assert len(gateway.logged("retrying after connection failure")) == 2


async def test_http_errors_from_a_node_are_passed_through_and_never_retried(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(2, completion="http_error", error_status=500)) as (nodes, gateway):
        response = await gateway.http.post(gateway.url + CHAT, json=chat())
        assert response.status_code == 500
        assert response.json()["object"] == "error"  # the node's own body
        assert sum(len(completions_to(node)) for node in nodes) == 1
        assert await gateway.metric('gateway_requests_total{model="test-model",status="500"}') == 1
        assert gateway.logged("retrying after connection failure") == []


async def test_a_connection_lost_mid_response_is_a_502_without_retry(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(2, completion="close_mid_stream")) as (nodes, gateway):
        response = await gateway.http.post(gateway.url + CHAT, json=chat())
        assert response.status_code == 502
        assert error_message(response) == "upstream node error"
        [failure] = gateway.logged("node response truncated or connection lost")
        assert failure["level"] == "error" and failure["error"]
        assert sum(len(completions_to(node)) for node in nodes) == 1
        assert await gateway.metric('gateway_proxy_attempts_total{model="test-model",status="502"}') == 1
        assert await gateway.metric('gateway_requests_total{model="test-model",status="502"}') == 1


@pytest.mark.parametrize("retry_unanswered", [False, True])
async def test_a_request_whose_node_is_killed_before_answering_is_retried_only_with_retry_unanswered(
    tmp_path, retry_unanswered
):
    decision_log = tmp_path / "decisions.jsonl"
    config = {"retry_unanswered": retry_unanswered, "decision_log": str(decision_log)}
    async with node_processes(2) as nodes, running_gateway(tmp_path, nodes, **config) as gateway:
        await gateway.discovered()
        killed, survivor = nodes  # the balancer's first pick is n1, the first in IP order
        control = f"http://{killed.host}:{killed.vllm_port}/_control"
        await gateway.http.post(control, json={"ttft": 60})
        answers = []
        async with trio.open_nursery() as nursery:

            async def ask() -> None:
                answers.append(await gateway.http.post(gateway.url + CHAT, json=chat(), headers={"X-Request-Id": "r1"}))

            nursery.start_soon(ask)
            with trio.fail_after(60):  # until the request is on the node
                while CHAT not in [seen["path"] for seen in (await gateway.http.get(control + "/requests")).json()]:
                    await trio.sleep(0.02)
            killed.kill()
        [response] = answers
        await gateway.wait_for(lambda: decision_records(decision_log))
        [decision] = decision_records(decision_log)
    first = decision.attempts[0]
    assert first.node == killed.host and first.error
    if retry_unanswered:
        assert response.status_code == 200 and response.headers["x-served-by"] == survivor.name
        assert first.outcome == "retried"
        assert decision.attempts[1] == AttemptRecord(survivor.host, "completed", 200)
    else:  # plinth's answer
        assert response.status_code == 502 and error_message(response) == "upstream node error"
        assert [attempt.outcome for attempt in decision.attempts] == ["failed"]
    assert decision.request_id == "r1" and decision.status == response.status_code


async def test_with_retry_unanswered_a_node_that_never_answers_is_retried_after_the_response_timeout(tmp_path):
    specs = node_specs(2)
    async with nodes_and_gateway(tmp_path, specs, response_timeout="1s", retry_unanswered=True) as (nodes, gateway):
        await gateway.discovered()
        nodes[0].behaviour.completion = "hang"
        served_by = set()
        for _ in range(2):
            response = await gateway.http.post(gateway.url + CHAT, json=chat())
            assert response.status_code == 200
            served_by.add(response.headers["x-served-by"])
        assert served_by == {"n2"}
        retries = gateway.logged("retrying after connection failure")
        assert {(retry["node"], retry["error"]) for retry in retries} == {(nodes[0].host, "timeout awaiting response headers")}
        # Slow is not down: the node stays online (and so is tried again by the second request).
        assert len(retries) == 2 and not gateway.node(nodes[0].host).is_offline(gateway.control_plane.view.now())


async def test_a_node_slower_than_the_response_timeout_gets_a_504_tried_once_and_stays_online(tmp_path):
    # A whole answer's head comes after the generation: 1 s here, more than the 0.3 s allowed.
    async with nodes_and_gateway(tmp_path, node_specs(2, ttft=1.0), response_timeout="300ms") as (nodes, gateway):
        await gateway.discovered()
        response = await gateway.http.post(gateway.url + CHAT, json=chat(), headers={"x-request-id": "slow"})
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "upstream_timeout"
        assert error_message(response) == "upstream node did not answer in time"
        assert sum(len(completions_to(node)) for node in nodes) == 1  # retry_unanswered is off
        now = gateway.control_plane.view.now()
        assert not any(gateway.node(node.host).is_offline(now) for node in nodes)
        assert not gateway.logged("node marked offline")


async def test_a_model_s_own_timeouts_override_the_gateway_s(tmp_path):
    # The node's first token takes 1 s: past the gateway's 0.3 s, within the slow model's minute.
    specs = node_specs(1, serving=("slow-model", "other-model"), ttft=1.0)
    models = '[[models.available]]\nname = "slow-model"\nfirst_byte_timeout = "1m"\nresponse_timeout = "1m"\n'
    timeouts = {"first_byte_timeout": "300ms", "response_timeout": "300ms"}
    async with nodes_and_gateway(tmp_path, specs, models=(), extra=models, **timeouts) as (nodes, gateway):
        await gateway.discovered()
        for stream in (True, False):
            served = await gateway.http.post(gateway.url + CHAT, json=chat("slow-model", stream=stream))
            assert served.status_code == 200
            timed_out = await gateway.http.post(gateway.url + CHAT, json=chat("other-model", stream=stream))
            assert timed_out.status_code == 504
        [first_byte, response] = gateway.logged("node response truncated or connection lost")
        assert first_byte["error"] == "timed out waiting for first stream chunk"
        assert response["error"] == "timeout awaiting response headers"


# --- the buffering commit gate -----------------------------------------------------------------


async def test_a_response_larger_than_the_buffer_limit_is_passed_through(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1, tokens=50), max_buffered_response_bytes=200) as (nodes, gateway):
        response = await gateway.http.post(gateway.url + CHAT, json=chat())
        assert response.status_code == 200
        assert len(response.content) > 200
        assert response.json()["usage"]["completion_tokens"] == 50
        [passing] = gateway.logged("response exceeded buffer limit; passing through")
        assert passing == passing | {"node": nodes[0].host, "reason": "content_length", "limit": "200", "level": "info"}
        assert await gateway.metric('gateway_response_passthrough_total{model="test-model",reason="content_length"}') == 1
        assert await gateway.metric('gateway_requests_total{model="test-model",status="200"}') == 1


async def test_a_failure_after_an_early_commit_cuts_the_body_short_and_is_never_a_502(tmp_path):
    # The node sends a chunked body without a length, and closes the connection halfway.
    specs = node_specs(1, tokens=200, completion="close_mid_stream")
    async with nodes_and_gateway(tmp_path, specs, max_buffered_response_bytes=100) as (nodes, gateway):
        response, content = await post_cut_short(gateway.http, gateway.url + CHAT, chat())
        assert response.status_code == 200
        assert len(content) > 100
        assert b"data:" not in content  # no event-stream error event in a JSON body
        try:
            msgspec.json.decode(content)
            raise AssertionError("the body should be cut short")
        except msgspec.DecodeError:
            pass
        assert [line["reason"] for line in gateway.logged("response exceeded buffer limit; passing through")] == ["size_limit"]
        [truncated] = gateway.logged("response truncated after commit")
        assert truncated["node"] == nodes[0].host and truncated["level"] == "error"
        assert gateway.logged("node response truncated or connection lost") == []
        assert not gateway.node(nodes[0].host).offline_until  # not marked offline
        assert await gateway.metric('gateway_requests_total{model="test-model",status="200"}') == 1
        assert await gateway.metric('gateway_response_passthrough_total{model="test-model",reason="size_limit"}') == 1
        assert await gateway.metric(f'gateway_response_truncated_total{{node="{nodes[0].host}"}}') == 1


@pytest.mark.parametrize("passed_through", [False, True])
async def test_a_non_streaming_answer_that_stalls_after_its_head_ends_at_the_response_body_timeout(
    tmp_path, passed_through
):
    """Buffered, nothing has reached the client: a 502, as for a body cut short. Passed through
    (larger than the buffer): the body is cut short. Either way the node's connection is closed."""
    specs = node_specs(1, tokens=200, completion="stall_mid_body")
    config = {"response_body_timeout": "0.3s", "max_buffered_response_bytes": 100 if passed_through else 0}
    async with nodes_and_gateway(tmp_path, specs, **config) as (nodes, gateway):
        if passed_through:
            response, content = await post_cut_short(gateway.http, gateway.url + CHAT, chat())
            assert response.status_code == 200 and len(content) > 100
            [failure] = gateway.logged("response truncated after commit")
        else:
            response = await gateway.http.post(gateway.url + CHAT, json=chat())
            assert response.status_code == 502 and error_message(response) == "upstream node error"
            [failure] = gateway.logged("node response truncated or connection lost")
        assert failure["node"] == nodes[0].host and failure["error"] == "timeout awaiting response body"
        [completion] = completions_to(nodes[0])
        with trio.fail_after(60):
            await completion.ended.wait()
        assert completion.disconnected
        assert await gateway.metric(f'gateway_requests_total{{model="test-model",status="{response.status_code}"}}') == 1


# --- request ids and forwarding --------------------------------------------------------------------


async def test_request_ids_are_echoed_and_forwarded_with_proxy_headers(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1)) as (nodes, gateway):
        response = await gateway.http.post(
            gateway.url + CHAT + "?dropped=1",
            json=chat(),
            headers={"X-Request-Id": "req-123", "X-Forwarded-For": "10.1.1.1", "Connection": "keep-alive, X-Hop", "X-Hop": "1"},
        )
        assert response.headers["x-request-id"] == "req-123"
        forwarded = completions_to(nodes[0])[-1]
        assert forwarded.path == CHAT  # the query string is dropped
        assert forwarded.header("x-request-id") == "req-123"
        assert forwarded.header("x-forwarded-for") == "10.1.1.1, 127.0.0.1"
        assert forwarded.header("x-hop") is None and forwarded.header("connection") is None
        assert forwarded.header("host") == f"{nodes[0].host}:{nodes[0].vllm_port}"

        # Without one, the gateway makes one up, the same on both sides.
        response = await gateway.http.post(gateway.url + CHAT, json=chat())
        made_up = response.headers["x-request-id"]
        assert len(made_up) == 32
        assert completions_to(nodes[0])[-1].header("x-request-id") == made_up
        # Errors carry it too.
        response = await gateway.http.post(gateway.url + CHAT, json=chat("nope"), headers={"X-Request-Id": "r-9"})
        assert response.headers["x-request-id"] == "r-9"


async def test_each_request_gets_a_decision_record(tmp_path):
    decision_log = tmp_path / "decisions.jsonl"
    specs = node_specs(3)
    specs[2].models = ["other"]
    async with nodes_and_gateway(tmp_path, specs, decision_log=str(decision_log)) as (nodes, gateway):
        await gateway.discovered()
        nodes[0].behaviour.refuse = True
        await gateway.http.post(gateway.url + CHAT, json=chat(), headers={"X-Request-Id": "first"})
        await gateway.wait_for(lambda: gateway.node(nodes[0].host).offline_until)
        await gateway.http.post(gateway.url + CHAT, json=chat(), headers={"X-Request-Id": "second"})
        await gateway.wait_for(lambda: len(decision_records(decision_log)) == 2)
        first, second = (msgspec.json.decode(msgspec.json.encode(record)) for record in decision_records(decision_log))

    n1, n2, n3 = (node.host for node in nodes)
    assert first["request_id"] == "first" and first["model"] == MODEL and first["path"] == CHAT
    assert first["ring"] == "" and first["ring_pool"] == [n1, n2, n3]
    assert first["excluded"] == [{"node": n3, "reason": "missing"}]
    [refused, served] = first["attempts"]
    assert refused["node"] == n1 and refused["outcome"] == "retried" and refused["error"]
    assert served == {"node": n2, "outcome": "completed", "status": 200}
    assert first["status"] == 200 and first["stream"] is False
    assert first["seq"] > 0 and first["duration"] > 0 and first["at"] > 0
    # The second request was routed on a later snapshot, where n1 was offline.
    assert second["request_id"] == "second" and second["status"] == 200
    assert second["seq"] > first["seq"]
    assert second["excluded"] == [{"node": n3, "reason": "missing"}, {"node": n1, "reason": "offline"}]
    assert second["attempts"] == [{"node": n2, "outcome": "completed", "status": 200}]


async def test_an_unwritable_decision_log_never_fails_a_request(tmp_path):
    (tmp_path / "not-a-folder").write_text("")
    decision_log = tmp_path / "not-a-folder" / "decisions.jsonl"
    async with nodes_and_gateway(tmp_path, node_specs(1), decision_log=str(decision_log)) as (nodes, gateway):
        for _ in range(3):
            assert (await gateway.http.post(gateway.url + CHAT, json=chat())).status_code == 200
        await gateway.wait_for(lambda: gateway.logged("decision log write failed"))
        for _ in range(3):
            assert (await gateway.http.post(gateway.url + CHAT, json=chat())).status_code == 200
        await trio.sleep(0.1)
        [failure] = gateway.logged("decision log write failed")  # once, not once per record
        assert failure["level"] == "error" and failure["path"] == str(decision_log)


async def test_a_decision_records_the_nodes_the_attempt_loop_passed_over_when_it_picked(tmp_path):
    # The proxy on its own, the control plane's clock in the test's hands: n1 is offline when
    # the request arrives and no longer when the attempt loop picks, so it is picked, not excluded.
    clock = [time.time()]
    log = CapturedLog()
    decision_log = tmp_path / "decisions.jsonl"
    async with serve_nodes(node_specs(2)) as nodes:
        config_path = write_config(tmp_path, nodes, decision_log=str(decision_log))
        async with (
            open_control_plane(config_path, version="test", log=log, now=lambda: clock[0]) as control_plane,
            new_upstream_pool() as pool,
            trio.open_nursery() as nursery,
        ):
            decisions = open_decision_log(control_plane.view.snapshot.config.gateway, log, CollectorRegistry())
            nursery.start_soon(decisions.appender.run)
            proxy = new_proxy(control_plane.view, pool, RequestMetrics(CollectorRegistry()), log, decisions)
            n1 = nodes[0].host
            control_plane.view.observe(UpstreamFailed(node=n1, error="refused", at=clock[0]))
            with trio.fail_after(60):
                while not control_plane.view.snapshot.nodes[n1].offline_until:
                    await trio.sleep(0.01)
            arrived = clock[0] + 1
            clock[0] += OFFLINE_SECONDS + 1
            view = SnapshotViews(control_plane.view).current()
            headers = forward_headers([], "127.0.0.1", "late-pick")
            exchange = Exchange(
                request_id="late-pick",
                path=CHAT,
                model=MODEL,
                stream=False,
                body=msgspec.json.encode(chat()),
                headers=headers,
                view=view,
                at=arrived,
                started=time.perf_counter(),
            )
            reply = await proxy.forward(exchange)
            await decisions.appender.aclose()
            nursery.cancel_scope.cancel()
        [decision] = read_decisions(decision_log)
    assert reply.status == 200
    assert decision.attempts[0].node == n1 and decision.attempts[0].outcome == "completed"
    assert decision.excluded == ()

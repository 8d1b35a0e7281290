"""What a client sends must not grow the gateway's memory, logs or metrics, nor get a traceback:
model names as metric labels, over-long names, deeply nested JSON, odd request targets, slow
request bodies, connections closed mid-answer or left open, HTTP/2. Real gateway, real sockets,
simulated nodes."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from functools import partial

import h2.events
import httpx
import msgspec
import pytest
import trio
from prometheus_client import CollectorRegistry

from bench.client_input import rapid_reset
from dataplane.asgi import MAX_REQUEST_ID_LENGTH
from dataplane.metrics import RequestMetrics, metrics_app
from fixtures.node import Behaviour, NodeSpec, serve_nodes
from interlock.serve import listening_socket, serve_on_socket

from harness import (
    MODEL,
    admission_toml,
    chat,
    completions_to,
    decision_records,
    free_port,
    node_specs,
    nodes_and_gateway,
    serve_process,
    write_config,
)
from raw_http import exchange_until_closed

CHAT = "/v1/chat/completions"


def no_tracebacks(caplog) -> bool:
    """Whether hypercorn logged no exception (the gateway's own log is JSON, never a traceback)."""
    return not [record for record in caplog.records if record.exc_info]


async def test_model_names_no_node_lists_are_counted_under_one_label(tmp_path):
    # n1 also lists "discovered", which no config entry names: it keeps its own label.
    async with nodes_and_gateway(tmp_path, node_specs(1, serving=(MODEL, "discovered"))) as (nodes, gateway):
        await gateway.discovered()
        for index in range(30):
            response = await gateway.http.post(gateway.url + CHAT, json=chat(model=f"client-made-{index:04d}-" + "x" * 200))
            assert response.status_code == 404
        for model in (MODEL, "discovered"):
            assert (await gateway.http.post(gateway.url + CHAT, json=chat(model=model))).status_code == 200
        page = await gateway.metrics()
        assert "client-made" not in page
        assert await gateway.metric('gateway_requests_total{model="(other)",status="404"}') == 30
        assert await gateway.metric('gateway_requests_total{model="test-model",status="200"}') == 1
        assert await gateway.metric('gateway_requests_total{model="discovered",status="200"}') == 1
        warnings = gateway.logged("no node serves requested model")
        assert warnings and all(len(record["model"]) <= 128 for record in warnings)


async def test_a_model_name_longer_than_512_characters_gets_400(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1)) as (nodes, gateway):
        response = await gateway.http.post(gateway.url + CHAT, json=chat(model="m" * 513))
        assert response.status_code == 400
        assert response.json() == {
            "error": {
                "message": "model name longer than 512 characters",
                "type": "invalid_request_error",
                "code": "model_name_too_long",
            }
        }
        assert "m" * 100 not in await gateway.metrics() + "\n".join(gateway.log.lines())
        # 512 characters is still a name (one no node serves).
        assert (await gateway.http.post(gateway.url + CHAT, json=chat(model="m" * 512))).status_code == 404
        assert completions_to(nodes[0]) == []


async def test_an_over_long_request_id_is_replaced_by_a_new_one_everywhere(tmp_path):
    decision_log = tmp_path / "decisions.jsonl"
    async with nodes_and_gateway(tmp_path, node_specs(1), decision_log=str(decision_log)) as (nodes, gateway):
        await gateway.discovered()
        longest = "i" * MAX_REQUEST_ID_LENGTH
        response = await gateway.http.post(gateway.url + CHAT, json=chat(), headers={"X-Request-Id": longest})
        assert response.status_code == 200 and response.headers["x-request-id"] == longest
        response = await gateway.http.post(gateway.url + CHAT, json=chat(), headers={"X-Request-Id": "j" * 8000})
        assert response.status_code == 200
        new_id = response.headers["x-request-id"]
        assert len(new_id) == 32 and "j" not in new_id
        assert [request.header("x-request-id") for request in completions_to(nodes[0])] == [longest, new_id]
        await gateway.wait_for(lambda: len(decision_records(decision_log)) == 2)
        assert [decision.request_id for decision in decision_records(decision_log)] == [longest, new_id]


async def test_json_nested_2000_levels_deep_gets_400_without_a_traceback(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    async with nodes_and_gateway(tmp_path, node_specs(1)) as (nodes, gateway):
        deep = b'{"model": "test-model", "messages": ' + b"[" * 2000 + b"]" * 2000 + b"}"
        for body in (deep, b"[" * 2000):
            response = await gateway.http.post(gateway.url + CHAT, content=body)
            assert response.status_code == 400
            assert response.json()["error"]["message"] == "invalid request body"
        assert completions_to(nodes[0]) == []
    assert no_tracebacks(caplog)


class _ScrapeHeldOpen:
    """A collector whose collection waits until the test lets it finish (or 5 s pass)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.finished = threading.Event()

    def collect(self):
        self.entered.set()
        self.release.wait(5)
        self.finished.set()
        return []


@pytest.mark.parametrize("workers", [1, 2])
async def test_the_api_answers_while_a_metrics_scrape_is_being_rendered(tmp_path, workers):
    async with nodes_and_gateway(tmp_path, node_specs(1), workers=workers) as (nodes, gateway):
        held_open = _ScrapeHeldOpen()
        gateway.control_plane.registry.register(held_open)
        answered_during_scrape = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gateway.metrics)
            while not held_open.entered.is_set():
                await trio.sleep(0.01)
            # Rendered on the event loop, the page would hold up this request until the
            # collector gave up waiting.
            response = await gateway.http.get(gateway.url + "/health")
            answered_during_scrape.append(not held_open.finished.is_set() and response.status_code == 200)
            held_open.release.set()
        assert answered_during_scrape == [True]


async def raw_answer(url: str, data: bytes) -> bytes:
    """Send raw bytes to the gateway; what it answers, until it closes or 2 s of silence."""
    host, port = url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    received = b""
    async with stream:
        await stream.send_all(data)
        with trio.move_on_after(2):
            while chunk := await stream.receive_some(65536):
                received += chunk
                if b"\r\n\r\n" in received and received.endswith(b"}"):
                    break
    return received


async def test_odd_request_targets_get_json_errors_without_a_traceback(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    body = b'{"model": "test-model", "messages": []}'
    post = b"Host: gw\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    async with nodes_and_gateway(tmp_path, node_specs(1)) as (nodes, gateway):
        host = gateway.url.removeprefix("http://").encode()
        requests = {
            b"POST //v1/chat/completions HTTP/1.1\r\n" + post: 404,
            b"GET /v1//models HTTP/1.1\r\nHost: gw\r\n\r\n": 404,
            b"OPTIONS * HTTP/1.1\r\nHost: gw\r\n\r\n": 404,
            b"POST http://" + host + b"/v1/chat/completions HTTP/1.1\r\n" + post: 200,
            b"GET http://" + host + b"/health HTTP/1.1\r\nHost: gw\r\n\r\n": 200,
            b"GET /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n": 404,
        }
        for request, status in requests.items():
            answer = await raw_answer(gateway.url, request)
            head, _, content = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 %d " % status), (request, answer)
            assert b"content-type: application/json" in head.lower(), (request, answer)
            if status != 200:
                assert content.startswith(b'{"error":'), (request, answer)
    assert no_tracebacks(caplog)


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_request_body_sent_too_slowly_gets_408_and_the_connection_is_closed(tmp_path, workers):
    timeouts = {"request_body_timeout": "1.5s", "request_body_idle_timeout": "0.5s"}
    async with nodes_and_gateway(tmp_path, node_specs(1), workers=workers, **timeouts) as (nodes, gateway):
        host, port = gateway.url.removeprefix("http://").split(":")
        head = f"POST {CHAT} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"

        async def answer_to(trickle_every: float | None) -> bytes:
            """The answer to a head and then one body byte per `trickle_every` seconds (None:
            no byte at all), read until the gateway closes the connection."""
            stream = await trio.open_tcp_stream(host, int(port))
            async with stream, trio.open_nursery() as nursery:

                async def trickle() -> None:
                    await stream.send_all(head.encode())
                    with contextlib.suppress(trio.BrokenResourceError):  # closed by the gateway
                        while trickle_every is not None:
                            await trio.sleep(trickle_every)
                            await stream.send_all(b" ")

                nursery.start_soon(trickle)
                received = b""
                with trio.fail_after(60):
                    while chunk := await stream.receive_some(65536):
                        received += chunk
                nursery.cancel_scope.cancel()
            return received

        # Idle after the head; then a byte every 0.2 s, never idle long, but never done either.
        for trickle_every in (None, 0.2):
            answer = await answer_to(trickle_every)
            assert answer.startswith(b"HTTP/1.1 408 "), answer
            assert b"\r\nconnection: close\r\n" in answer.lower()
            assert answer.endswith(
                b'{"error":{"message":"request body not received in time","type":"invalid_request_error",'
                b'"code":"request_timeout"}}'
            )
        assert completions_to(nodes[0]) == []
        assert (await gateway.http.post(gateway.url + CHAT, json=chat())).status_code == 200


async def test_clients_that_close_as_their_408_or_413_is_sent_neither_stop_the_gateway_nor_print_tracebacks(tmp_path):
    """hypercorn ends a connection (`send_eof`) outside its send lock: a client whose FIN arrives
    as its 408 goes out made hypercorn's own 400 meet that close, and the BusyResourceError
    ended the process; one that FINs right after a head too large for the limit met the 413."""
    idle_timeout = 0.3
    port = free_port()
    async with serve_nodes(node_specs(1)) as nodes:
        config = write_config(tmp_path, nodes, request_body_idle_timeout=f"{idle_timeout}s")
        config.write_text(config.read_text().replace('listen = "127.0.0.1:0"', f'listen = "127.0.0.1:{port}"', 1))
        async with serve_process(config) as gateway:
            await gateway.wait_for_log("api server listening")
            answers: list[bytes] = []

            async def client(declared_length: int, close_after: float) -> None:
                """A body that stalls after its first byte, and a FIN `close_after` seconds on."""
                with contextlib.suppress(OSError):  # refused, or reset: the gateway is gone or done
                    stream = await trio.open_tcp_stream("127.0.0.1", port)
                    async with stream:
                        head = f"POST {CHAT} HTTP/1.1\r\nHost: gw\r\nContent-Length: {declared_length}\r\n\r\n{{"
                        await stream.send_all(head.encode())
                        await trio.sleep(close_after)
                        await stream.send_eof()
                        answer = b""
                        with trio.fail_after(60):
                            while chunk := await stream.receive_some():
                                answer += chunk
                        answers.append(answer)

            # FINs spread over 20 ms around the 408; and FINs right after a 413's head.
            clients = [(100, idle_timeout - 0.01 + 0.0005 * index) for index in range(40)]
            clients += [(10**9, 0.0)] * 40
            async with trio.open_nursery() as nursery:
                for declared_length, close_after in clients:
                    nursery.start_soon(client, declared_length, close_after)
                    await trio.sleep(0.01)
            assert gateway.process.returncode is None, "the gateway stopped"
            async with httpx.AsyncClient(trust_env=False) as http:
                assert (await http.post(f"http://127.0.0.1:{port}{CHAT}", json=chat())).status_code == 200
            assert len(answers) == len(clients)
            assert {answer[:12] for answer in answers} <= {b"", b"HTTP/1.1 400", b"HTTP/1.1 408", b"HTTP/1.1 413"}
            gateway.process.terminate()
            code, _, errors = await gateway.exit()
    assert (code, errors) == (0, "")


async def test_the_metrics_listener_closes_connection_close_and_http_1_0_exchanges(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1)) as (nodes, gateway):
        port = int(gateway.metrics_url.rpartition(":")[2])
        for request in (
            b"GET /metrics HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n",
            b"GET /metrics HTTP/1.0\r\n\r\n",
            b"GET /other HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n",
        ):
            answer = await exchange_until_closed(port, request)
            assert answer.startswith((b"HTTP/1.1 200 ", b"HTTP/1.1 404 ")), answer
            assert b"gateway_requests_total" in answer or b"/other" in request


async def test_the_metrics_listener_closes_idle_connections():
    registry = CollectorRegistry()
    RequestMetrics(registry)
    listening = listening_socket("127.0.0.1:0", "metrics_listen")
    port = listening.getsockname()[1]
    stopped = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_on_socket, metrics_app(registry), listening, stopped, keep_alive_timeout=0.2))
        # Kept alive for the next scrape, then closed once idle; a connection with no request too.
        answer = await exchange_until_closed(port, b"GET /metrics HTTP/1.1\r\nHost: gw\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200 ") and b"gateway_requests_total" in answer
        assert await exchange_until_closed(port, b"") == b""
        stopped.set()


async def test_http2_is_off_by_default_an_http2_client_starts_no_request(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1)) as (nodes, gateway):
        received = await rapid_reset(gateway.url.removeprefix("http://"), 500)
        await trio.sleep(0.5)
        assert completions_to(nodes[0]) == []
        assert any(isinstance(event, h2.events.ConnectionTerminated) for event in received)
        assert not any(isinstance(event, h2.events.ResponseReceived) for event in received)
        # HTTP/1.1 is served as ever.
        assert (await gateway.http.post(gateway.url + CHAT, json=chat())).status_code == 200


@pytest.mark.parametrize("http2", [False, True])
async def test_an_upgrade_to_h2c_is_ignored_unless_http2_is_on(tmp_path, http2):
    upgrade = (
        b"GET /health HTTP/1.1\r\nHost: gw\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
        b"HTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n"
    )
    async with nodes_and_gateway(tmp_path, node_specs(1), http2=http2) as (nodes, gateway):
        async with await trio.open_tcp_stream("127.0.0.1", int(gateway.url.rpartition(":")[2])) as stream:
            await stream.send_all(upgrade)
            answer = b""
            with trio.fail_after(60):
                while b"\r\n\r\n" not in answer:
                    answer += await stream.receive_some()
    assert answer.startswith(b"HTTP/1.1 101 " if http2 else b"HTTP/1.1 200 "), answer


async def test_with_http2_on_the_rapid_reset_attack_ends_in_goaway_having_started_a_handful_of_requests(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1), http2=True) as (nodes, gateway):
        received = await rapid_reset(gateway.url.removeprefix("http://"), 5000)
        await trio.sleep(0.5)
        started = len(completions_to(nodes[0]))
        assert started <= 5
        assert any(isinstance(event, h2.events.ConnectionTerminated) for event in received)
        # An HTTP/2 client that does not attack is served.
        async with httpx.AsyncClient(http1=False, http2=True, trust_env=False) as client:
            response = await client.post(gateway.url + CHAT, json=chat())
        assert response.status_code == 200 and response.http_version == "HTTP/2"


def open_files() -> int:
    """The files this process holds open: the gateway's sockets, its nodes' and the test's."""
    return len(os.listdir("/proc/self/fd"))


async def _send_raw(port: int, body: dict, *, until: bytes = b"") -> trio.SocketStream:
    """A connection that has sent one request (and, with `until`, received an answer up to it)."""
    encoded = msgspec.json.encode(body)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(
        b"POST %s HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (CHAT.encode(), len(encoded), encoded)
    )
    received = b""
    while until not in received:
        chunk = await stream.receive_some()
        assert chunk, f"closed before {until!r}: {received!r}"
        received += chunk
    return stream


async def test_500_clients_that_leave_queued_waiting_on_a_slow_node_or_streamed_are_closed_at_once(tmp_path):
    # n1 holds each request before its first token for longer than the test, 150 at a time (the
    # next 150 wait in the queue); n2 streams a long answer. Both run up to 1,000 requests at
    # once, so that their scraped KV cache never saturates them for the queue. Closed at once:
    # the sockets (both sides of each client's connection and of each upstream request) are all
    # closed within the deadline, far shorter than the keep-alive timeout (90 s) that a
    # connection the gateway left open would wait for.
    specs = [
        NodeSpec(name="n1", host="127.0.0.2", models=["slow"], behaviour=Behaviour(ttft=3600, max_running=1000)),
        NodeSpec(
            name="n2", host="127.0.0.3", models=[MODEL], behaviour=Behaviour(tokens=10_000, tpot=2.0, max_running=1000)
        ),
    ]
    async with nodes_and_gateway(
        tmp_path,
        specs,
        models=[(MODEL, ""), ("slow", "")],
        node_settings={"n1": {"max_in_flight": 150}},
        extra=admission_toml(max_queue_seconds=600),
    ) as (nodes, gateway):
        await gateway.discovered()
        queued = 'interlock_admission_queue_length{priority="0",tenant="default"}'
        assert await gateway.metric(queued) is None  # and the test's connection to /metrics is open
        baseline = open_files()
        port = int(gateway.url.rpartition(":")[2])
        clients: list[trio.SocketStream] = []
        arriving = trio.CapacityLimiter(20)  # within the listener's backlog

        async def client(body: dict, until: bytes = b"") -> None:
            async with arriving:
                clients.append(await _send_raw(port, body, until=until))

        with trio.fail_after(60):
            # The streams first: the queue's order would keep them behind the slow model's requests.
            async with trio.open_nursery() as nursery:
                for _ in range(200):
                    nursery.start_soon(client, chat(stream=True), b"data: ")
            async with trio.open_nursery() as nursery:
                for _ in range(300):
                    nursery.start_soon(client, chat("slow", stream=False))
            while len(completions_to(nodes[0])) < 150 or await gateway.metric(queued) != 150:
                await trio.sleep(0.05)
        assert open_files() >= baseline + 2 * 500
        for stream in clients:
            await stream.aclose()
        with trio.fail_after(30):
            while open_files() > baseline:
                await trio.sleep(0.05)
        assert all(upstream.disconnected for node in nodes for upstream in completions_to(node))

"""What a client sends must not grow the gateway's memory, logs or metrics, nor get a traceback:
model names as metric labels, over-long model names and request ids, deeply nested JSON, odd
request targets and WebSocket handshakes; and a scrape of `/metrics` never stalls the API.
Real gateway, real sockets, simulated nodes."""

from __future__ import annotations

import json
import logging
import threading

import pytest
import trio
from prometheus_client.core import GaugeMetricFamily

from dataplane.asgi import MAX_REQUEST_ID_LENGTH
from dataplane.errors import MAX_MODEL_NAME_LENGTH
from dataplane.metrics import OTHER_MODELS

from harness import MODEL, chat, completions_to, decision_records, node_specs, nodes_and_gateway

CHAT = "/v1/chat/completions"


def samples(text: str, name: str) -> dict[str, float]:
    """The samples of metric `name` in a /metrics page, by their full sample name."""
    found = {}
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample.startswith(name + "{"):
            found[sample] = float(value)
    return found


def warnings_and_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What reached Python's logging at WARNING or above (hypercorn's and Quart's tracebacks)."""
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]


async def test_only_known_models_are_metric_labels_every_other_name_counts_as_other(tmp_path):
    specs = node_specs(1, serving=(MODEL, "listed-by-the-node"))
    models = [(MODEL, ""), ("configured-unserved", "")]
    async with nodes_and_gateway(tmp_path, specs, models=models) as (_, gateway):
        await gateway.discovered()
        for model in (MODEL, "listed-by-the-node"):
            assert (await gateway.http.post(gateway.url + CHAT, json=chat(model))).status_code == 200
        assert (await gateway.http.post(gateway.url + CHAT, json=chat("configured-unserved"))).status_code == 503
        for number in range(50):
            response = await gateway.http.post(gateway.url + CHAT, json=chat(f"client-made-{number}-" + "x" * 200))
            assert response.status_code == 404
        page = await gateway.metrics()
    assert samples(page, "gateway_requests_total") == {
        f'gateway_requests_total{{model="{MODEL}",status="200"}}': 1,
        'gateway_requests_total{model="listed-by-the-node",status="200"}': 1,
        'gateway_requests_total{model="configured-unserved",status="503"}': 1,
        f'gateway_requests_total{{model="{OTHER_MODELS}",status="404"}}': 50,
    }
    assert samples(page, "gateway_model_filter_exclusions_total") == {
        'gateway_model_filter_exclusions_total{model="configured-unserved",reason="missing"}': 1,
        f'gateway_model_filter_exclusions_total{{model="{OTHER_MODELS}",reason="missing"}}': 50,
    }
    assert "client-made" not in page


async def test_a_model_name_over_the_limit_is_a_400_and_an_over_long_request_id_is_replaced(tmp_path):
    decision_log = tmp_path / "decisions.jsonl"
    async with nodes_and_gateway(tmp_path, node_specs(1), decision_log=str(decision_log)) as (nodes, gateway):
        await gateway.discovered()
        too_long = "m" * (MAX_MODEL_NAME_LENGTH + 1)
        response = await gateway.http.post(gateway.url + CHAT, json=chat(too_long), headers={"X-Request-Id": "r-1"})
        assert response.status_code == 400 and response.headers["x-request-id"] == "r-1"
        assert response.json() == {
            "error": {
                "message": f"model name longer than {MAX_MODEL_NAME_LENGTH} characters",
                "type": "invalid_request_error",
                "code": "model_name_too_long",
            }
        }
        # At the limit the name is routed (an unknown model: vLLM's 404); the request id a client
        # sends is kept up to its limit, and replaced by a new one beyond it.
        longest_id = "i" * MAX_REQUEST_ID_LENGTH
        response = await gateway.http.post(
            gateway.url + CHAT, json=chat("m" * MAX_MODEL_NAME_LENGTH), headers={"X-Request-Id": longest_id}
        )
        assert response.status_code == 404 and response.headers["x-request-id"] == longest_id
        response = await gateway.http.post(gateway.url + CHAT, json=chat(), headers={"X-Request-Id": "j" * 8000})
        assert response.status_code == 200
        new_id = response.headers["x-request-id"]
        assert len(new_id) == 32 and new_id != "j" * 8000
        assert [request.header("x-request-id") for request in completions_to(nodes[0])] == [new_id]
        await gateway.wait_for(lambda: len(decision_records(decision_log)) == 2)
        decisions = decision_records(decision_log)
        log = "\n".join(gateway.log.lines())
    assert [(decision.request_id, decision.status) for decision in decisions] == [(longest_id, 404), (new_id, 200)]
    assert "m" * 129 not in log and "j" * 129 not in log


async def test_deeply_nested_json_is_a_400_without_a_traceback(tmp_path, caplog):
    nested = b"[" * 2000 + b"]" * 2000
    bodies = [
        b'{"model": "' + MODEL.encode() + b'", "messages": ' + nested + b"}",
        b'{"model": ' + nested + b"}",
        nested,
    ]
    async with nodes_and_gateway(tmp_path, node_specs(1)) as (nodes, gateway):
        for body in bodies:
            assert len(body) <= 4096
            response = await gateway.http.post(gateway.url + CHAT, content=body)
            assert response.status_code == 400
            assert response.json()["error"] == {
                "message": "invalid request body",
                "type": "invalid_request_error",
                "code": "invalid_request_body",
            }
        assert completions_to(nodes[0]) == []
    assert warnings_and_errors(caplog) == []


async def exchange(url: str, head: bytes, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """Send a raw request head (and body) on a new connection: the status, headers and body of
    the answer (read until the gateway closes the connection or the body is complete)."""
    host, port = url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    received = b""
    async with stream:
        await stream.send_all(head + b"\r\n" + body)
        with trio.fail_after(5):
            while b"\r\n\r\n" not in received or not _complete(received):
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                received += chunk
    head_part, _, body_part = received.partition(b"\r\n\r\n")
    status_line, *header_lines = head_part.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in header_lines)}
    if headers.get("transfer-encoding") == "chunked":
        body_part = _dechunk(body_part)
    return int(status_line.split()[1]), headers, body_part


def _complete(received: bytes) -> bool:
    head, _, body = received.partition(b"\r\n\r\n")
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return body.endswith(b"0\r\n\r\n")


def _dechunk(data: bytes) -> bytes:
    body = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if not size:
            break
        body, data = body + data[:size], data[size + 2 :]
    return body


async def test_odd_targets_and_websocket_handshakes_get_json_errors_without_a_traceback(tmp_path, caplog):
    body = json.dumps(chat()).encode()
    post = b"Host: gw\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
    websocket = (
        b"Host: gw\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    )
    cases = [
        (b"POST //v1/chat/completions HTTP/1.1\r\n" + post, body, 404, "404 page not found"),
        (b"POST ///v1/completions HTTP/1.1\r\n" + post, body, 404, "404 page not found"),
        (b"POST /v1//chat/completions HTTP/1.1\r\n" + post, body, 404, "404 page not found"),
        (b"POST http://gw/v1/chat/completions HTTP/1.1\r\n" + post, body, 400, "invalid request target"),
        (b"GET http://gw/health HTTP/1.1\r\nHost: gw\r\n", b"", 400, "invalid request target"),
        (b"OPTIONS * HTTP/1.1\r\nHost: gw\r\n", b"", 400, "invalid request target"),
        (b"GET /v1/chat/completions HTTP/1.1\r\n" + websocket, b"", 400, "websocket is not supported"),
        (b"GET /health HTTP/1.1\r\n" + websocket, b"", 400, "websocket is not supported"),
        (b"GET /nowhere HTTP/1.1\r\n" + websocket, b"", 400, "websocket is not supported"),
    ]
    async with nodes_and_gateway(tmp_path, node_specs(1)) as (nodes, gateway):
        for head, request_body, expected_status, message in cases:
            status, headers, answer = await exchange(gateway.url, head, request_body)
            assert (status, headers["content-type"]) == (expected_status, "application/json"), head
            assert json.loads(answer)["error"]["message"] == message, head
        assert completions_to(nodes[0]) == []
        # The exact path is still the route.
        assert (await gateway.http.post(gateway.url + CHAT, json=chat())).status_code == 200
    assert warnings_and_errors(caplog) == []


class HeldScrape:
    """A collector whose collection waits until the test releases it (at most a few seconds),
    and notes whether it was released or gave up waiting."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.released: bool | None = None

    def describe(self) -> list:
        return []

    def collect(self):
        self.entered.set()
        self.released = self.release.wait(5)
        yield GaugeMetricFamily("held_scrape", "A scrape held until the test released it", value=1)


@pytest.mark.parametrize("workers", [1, 2])
async def test_the_api_answers_while_a_scrape_of_metrics_is_being_rendered(tmp_path, workers):
    async with nodes_and_gateway(tmp_path, node_specs(1), workers=workers) as (_, gateway):
        held = HeldScrape()
        gateway.control_plane.registry.register(held)
        pages = []

        async def scrape() -> None:
            pages.append(await gateway.metrics())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(scrape)
            assert await trio.to_thread.run_sync(held.entered.wait, 10)
            # Rendered on the event loop, the scrape would hold this request until it gave up.
            assert (await gateway.http.get(gateway.url + "/health")).status_code == 200
            assert (await gateway.http.post(gateway.url + CHAT, json=chat())).status_code == 200
            held.release.set()
    assert held.released
    assert "held_scrape 1.0" in pages[0]

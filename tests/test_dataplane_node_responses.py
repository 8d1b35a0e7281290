"""What the gateway makes of a node's response that is not well-formed HTTP/1.1, or that says
more than a well-behaved node would: real gateway (hypercorn and the proxy), a raw node
(tests/raw_http.py) sending exactly the bytes each test gives it.

A response the transport refuses is an upstream failure like any other: before commit the
client gets the proxy's 502, and the metrics and the decision record say 502 too."""

from __future__ import annotations

import gzip

import httpx
import msgspec
import pytest
import trio

from harness import MODEL, chat, decision_records, error_message, running_gateway
from raw_http import ServerConnection, raw_node

CHAT = "/v1/chat/completions"
OK = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 12\r\n\r\n{"ok": true}'


def chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


async def post(gateway, request_id: str = "r1") -> httpx.Response:
    return await gateway.http.post(gateway.url + CHAT, json=chat(), headers={"X-Request-Id": request_id})


async def assert_upstream_error(gateway, decision_log, response: httpx.Response) -> None:
    """The client got the proxy's 502, and the metrics and the decision record agree."""
    assert response.status_code == 502 and error_message(response) == "upstream node error"
    assert await gateway.metric(f'gateway_requests_total{{model="{MODEL}",status="502"}}') == 1
    assert await gateway.metric(f'gateway_proxy_attempts_total{{model="{MODEL}",status="502"}}') == 1
    assert await gateway.metric(f'gateway_requests_total{{model="{MODEL}",status="200"}}') is None
    await gateway.wait_for(lambda: decision_records(decision_log))
    [decision] = decision_records(decision_log)
    assert decision.status == 502
    [attempt] = decision.attempts
    assert attempt.outcome == "failed" and attempt.status is None and attempt.error
    [failure] = gateway.logged("node response truncated or connection lost")
    assert failure["error"] == attempt.error


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        # An interim response needs a status of 100 to 199: 000 is no status at all.
        (b"HTTP/1.1 000 Zero\r\n\r\n" + OK, "malformed status line"),
        # The body would reach the client still gzip-encoded, with nothing saying so.
        (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: gzip, chunked\r\n\r\n"
            + chunked(gzip.compress(b'{"ok": true}')),
            "unsupported Transfer-Encoding",
        ),
        # hypercorn cannot send these headers on: the client would get an empty 500.
        (OK.replace(b"\r\n\r\n", b"\r\nx-note: a\x01b\r\n\r\n"), "control byte"),
        (OK.replace(b"\r\n\r\n", b"\r\nx-note: a\x00b\r\n\r\n"), "control byte"),
        (OK.replace(b"\r\n\r\n", b"\r\nx(note): 1\r\n\r\n"), "malformed header line"),
        # Line ends of a bare LF: refused at once, not after the response header timeout.
        (b"HTTP/1.1 200 OK\ncontent-type: application/json\ncontent-length: 2\n\n{}", "bare LF"),
    ],
    ids=["status-000", "gzip-chunked", "control-byte", "nul-byte", "name-not-a-token", "bare-lf"],
)
async def test_a_response_the_transport_refuses_is_the_proxys_502_everywhere(tmp_path, answer, error):
    decision_log = tmp_path / "decisions.jsonl"
    async with raw_node(answer) as node, running_gateway(tmp_path, [node], decision_log=str(decision_log)) as gateway:
        response = await post(gateway)
        await assert_upstream_error(gateway, decision_log, response)
        [failure] = gateway.logged("node response truncated or connection lost")
        assert error in failure["error"]
        assert len(node.completions) == 1


async def test_the_body_a_204_declares_is_not_read_as_the_next_response(tmp_path):
    # The node sends the body its 204 announces after the head, late: on the same connection it
    # would be taken for the start of the next response.
    first_connection = []

    async def no_content_then_a_body(connection: ServerConnection) -> None:
        first_connection.append(connection.number)
        await connection.send(b"HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n")

    async def late_body_then_ok(connection: ServerConnection) -> None:
        await connection.send((b"hello" if connection.number in first_connection else b"") + OK)

    async with (
        raw_node(no_content_then_a_body, late_body_then_ok) as node,
        running_gateway(tmp_path, [node]) as gateway,
    ):
        first = await post(gateway, "r1")
        assert first.status_code == 204 and first.content == b""
        second = await post(gateway, "r2")
        assert second.status_code == 200 and second.json() == {"ok": True}
        [(on_first, _), (on_second, _)] = node.completions
        assert on_first == first_connection[0] and on_second != on_first


@pytest.mark.parametrize(
    "answer",
    [b"HTTP/1.1 204 No Content\r\nx-a: 1\r\n\r\n", b'HTTP/1.1 304 Not Modified\r\netag: "e"\r\n\r\n'],
    ids=["204", "304"],
)
async def test_a_response_without_a_body_reaches_the_client_without_a_content_length(tmp_path, answer):
    async with raw_node(answer) as node, running_gateway(tmp_path, [node]) as gateway:
        host, port = gateway.url.removeprefix("http://").split(":")
        body = msgspec.json.encode(chat())
        request = b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (
            CHAT.encode(),
            len(body),
            body,
        )
        stream = await trio.open_tcp_stream(host, int(port))
        received = b""
        async with stream:
            await stream.send_all(request)
            with trio.fail_after(60):
                while chunk := await stream.receive_some(65536):
                    received += chunk
        head, _, body = received.partition(b"\r\n\r\n")
        assert head.split(b"\r\n")[0].split(b" ")[1] == answer.split(b" ")[1]
        assert b"content-length" not in head.lower() and body == b""
        assert len(node.completions) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
async def test_the_headers_the_nodes_connection_header_names_are_not_passed_on(tmp_path, stream):
    answer = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: X-Hop, keep-alive\r\nx-hop: node-only\r\n"
        b"x-kept: yes\r\ntransfer-encoding: chunked\r\n\r\n" + chunked(b"data: [DONE]\n\n")
    )
    async with raw_node(answer) as node, running_gateway(tmp_path, [node]) as gateway:
        response = await gateway.http.post(gateway.url + CHAT, json=chat(stream=stream))
        assert response.status_code == 200 and response.text == "data: [DONE]\n\n"
        assert response.headers["x-kept"] == "yes" and "x-hop" not in response.headers


async def test_a_stream_whose_node_sends_a_refused_head_goes_to_the_next_node(tmp_path):
    # Before its first chunk, a stream moves on after any failure, a refused response included.
    decision_log = tmp_path / "decisions.jsonl"
    bad = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: gzip, chunked\r\n\r\n" + chunked(
        gzip.compress(b"data: [DONE]\n\n")
    )
    good = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" + chunked(
        b"data: [DONE]\n\n"
    )
    async with (
        raw_node(bad, host="127.0.0.2", name="n1") as first,
        raw_node(good, host="127.0.0.3", name="n2") as second,
        running_gateway(tmp_path, [first, second], decision_log=str(decision_log)) as gateway,
    ):
        response = await gateway.http.post(gateway.url + CHAT, json=chat(stream=True))
        assert response.status_code == 200 and response.text == "data: [DONE]\n\n"
        await gateway.wait_for(lambda: decision_records(decision_log))
        [decision] = decision_records(decision_log)
        assert [(attempt.node, attempt.outcome) for attempt in decision.attempts] == [
            ("127.0.0.2", "retried"),
            ("127.0.0.3", "completed"),
        ]
        assert "unsupported Transfer-Encoding" in decision.attempts[0].error
        assert decision.status == 200

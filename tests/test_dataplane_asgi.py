"""The API listener's split (dataplane.asgi): completion POSTs answered in plain ASGI, everything
else by the Quart app; what the other data-plane tests do not reach of it: other methods on the
completion paths, a keep-alive connection carrying every kind of reply in turn, a client leaving
while a whole answer is buffered, and a 413 to a body sent as many chunks."""

from __future__ import annotations

import json

import h11
import trio

from harness import MODEL, chat, completions_to, error_message, node_specs, nodes_and_gateway, post_and_leave

CHAT = "/v1/chat/completions"


async def test_other_methods_on_the_completion_paths_are_405_from_the_quart_app(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1)) as (nodes, gateway):
        for path in (CHAT, "/v1/completions"):
            for method in ("GET", "HEAD", "PUT", "DELETE", "OPTIONS"):
                response = await gateway.http.request(method, gateway.url + path)
                assert response.status_code == 405, (method, path)
                assert response.headers["allow"] == "POST"
                if method != "HEAD":
                    assert error_message(response) == "Method Not Allowed"
        # A body left unread closes the connection.
        response = await gateway.http.put(gateway.url + CHAT, json=chat())
        assert response.status_code == 405 and response.headers["connection"] == "close"
        # Only the exact paths are completion routes.
        response = await gateway.http.post(gateway.url + CHAT + "/", json=chat())
        assert response.status_code == 404
        assert completions_to(nodes[0]) == []


async def test_one_keep_alive_connection_carries_every_kind_of_reply_in_turn(tmp_path):
    models = [(MODEL, ""), ("configured-elsewhere", "")]
    async with nodes_and_gateway(tmp_path, node_specs(1, tokens=3), models=models) as (nodes, gateway):
        await gateway.discovered()  # so that models the node does not list are a 503 and a 404
        host, port = gateway.url.removeprefix("http://").split(":")
        stream = await trio.open_tcp_stream(host, int(port))
        client = h11.Connection(h11.CLIENT)
        answers = []
        async with stream:
            for body in (
                chat(),
                chat(stream=True),
                b"{not json",
                chat("configured-elsewhere"),
                chat("nobody-serves-this"),
                chat(),
            ):
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                headers = [("host", "gw"), ("content-type", "application/json"), ("content-length", str(len(data)))]
                request = client.send(h11.Request(method="POST", target=CHAT, headers=headers))
                await stream.send_all(request + client.send(h11.Data(data=data)) + client.send(h11.EndOfMessage()))
                status, received = None, b""
                with trio.fail_after(60):
                    while True:
                        event = client.next_event()
                        if event is h11.NEED_DATA:
                            client.receive_data(await stream.receive_some(65536))
                        elif isinstance(event, h11.Response):
                            status = event.status_code
                        elif isinstance(event, h11.Data):
                            received += event.data
                        elif isinstance(event, h11.EndOfMessage):
                            break
                answers.append((status, received))
                client.start_next_cycle()  # raises unless both sides kept the connection open
    assert [status for status, _ in answers] == [200, 200, 400, 503, 404, 200]
    assert answers[1][1].endswith(b"data: [DONE]\n\n")
    assert len(completions_to(nodes[0])) == 3


async def test_a_client_leaving_while_a_whole_answer_is_buffered_cancels_the_upstream_request(tmp_path):
    # The node sends its headers, then nothing: the gateway waits for the rest of the body.
    async with nodes_and_gateway(tmp_path, node_specs(1, completion="no_first_chunk")) as (nodes, gateway):
        upstream = await post_and_leave(gateway, nodes[0], chat())
        with trio.fail_after(60):
            await upstream.ended.wait()
        assert upstream.disconnected
        assert await gateway.metric('gateway_requests_total{model="test-model",status="200"}') is None
        assert gateway.logged("node response truncated or connection lost") == []


async def test_a_body_far_over_the_limit_in_many_chunks_gets_413_and_the_connection_is_closed(tmp_path):
    # hypercorn queues every chunk for the app as a message of its own: those the gateway leaves
    # unread must not hold up the answer or the closing of the connection.
    async with nodes_and_gateway(tmp_path, node_specs(1), max_request_body_bytes=1000) as (nodes, gateway):
        host, port = gateway.url.removeprefix("http://").split(":")
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            head = f"POST {CHAT} HTTP/1.1\r\nHost: gw\r\nX-Request-Id: big-1\r\nTransfer-Encoding: chunked\r\n\r\n"
            chunks = (b"64\r\n" + b"x" * 100 + b"\r\n") * 100
            await stream.send_all(head.encode() + chunks)  # all there before the gateway reads any
            received = b""
            with trio.fail_after(60):
                try:
                    while chunk := await stream.receive_some(65536):
                        received += chunk
                except trio.BrokenResourceError:
                    pass  # closed with part of the body unread: a reset after the answer
        assert received.startswith(b"HTTP/1.1 413 ")
        assert b"\r\nconnection: close\r\n" in received.lower() and b"\r\nx-request-id: big-1\r\n" in received.lower()
        assert received.endswith(b'"code":"request_too_large"}}')
        assert completions_to(nodes[0]) == []

"""The HTTP versions of the API port (`gateway.http2`, interlock.http_versions): HTTP/1.1 only by
default, HTTP/2 when switched on, and then streams opened and reset in quick succession (the
"rapid reset" attack) start at most a handful of completions on the nodes."""

from __future__ import annotations

import json

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import httpx
import pytest
import trio

from interlock.http_versions import H2_RESET_ALLOWANCE

from harness import chat, completions_to, node_specs, nodes_and_gateway

CHAT = "/v1/chat/completions"


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


@pytest.mark.parametrize("workers", [1, 2])
async def test_without_http2_the_preface_is_refused_and_h2c_upgrades_are_ignored(tmp_path, workers):
    async with nodes_and_gateway(tmp_path, node_specs(1), workers=workers) as (nodes, gateway):
        await gateway.discovered()
        async with httpx.AsyncClient(http1=False, http2=True, trust_env=False) as http2_only:
            with pytest.raises(httpx.TransportError):  # refused: a broken pipe or a closed connection
                await http2_only.post(gateway.url + CHAT, json=chat())
        # A raw preface, a request and its body: the connection is closed, nothing answered.
        client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        client.initiate_connection()
        stream_id = client.get_next_available_stream_id()
        client.send_headers(stream_id, _request_headers())
        client.send_data(stream_id, json.dumps(chat()).encode(), end_stream=True)
        async with await trio.open_tcp_stream(*_address(gateway.url)) as stream:
            await stream.send_all(client.data_to_send())
            received = b""
            with trio.fail_after(5):
                try:
                    while chunk := await stream.receive_some(65536):
                        received += chunk
                except trio.BrokenResourceError:
                    pass
        assert received == b""
        # An h2c upgrade is answered in HTTP/1.1, not switched.
        response = await gateway.http.post(
            gateway.url + CHAT, json=chat(), headers={"connection": "Upgrade, HTTP2-Settings", "upgrade": "h2c"}
        )
        assert (response.status_code, response.http_version) == (200, "HTTP/1.1")
        assert len(completions_to(nodes[0])) == 1


async def test_with_http2_requests_are_served_and_rapid_resets_start_a_handful_of_completions(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1), http2=True) as (nodes, gateway):
        await gateway.discovered()
        async with httpx.AsyncClient(http1=False, http2=True, trust_env=False) as http2_only:
            responses = [await http2_only.post(gateway.url + CHAT, json=chat()) for _ in range(3)]
        assert [(r.status_code, r.http_version) for r in responses] == [(200, "HTTP/2")] * 3
        assert len(completions_to(nodes[0])) == 3
        opened, goaway = await _open_and_reset_streams(gateway.url, 2000)
        assert goaway == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
        assert opened <= 2 * H2_RESET_ALLOWANCE
        started = len(completions_to(nodes[0])) - 3
        assert started <= H2_RESET_ALLOWANCE, started
        # The gateway serves on.
        response = await gateway.http.post(gateway.url + CHAT, json=chat())
        assert response.status_code == 200


def _request_headers() -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":path", CHAT),
        (":scheme", "http"),
        (":authority", "gw"),
        ("content-type", "application/json"),
    ]


async def _open_and_reset_streams(url: str, streams: int) -> tuple[int, int | None]:
    """The rapid-reset attacker: on one HTTP/2 connection, up to `streams` times, open a stream
    with a whole completion request and reset it at once. How many streams it opened before the
    gateway closed the connection, and the GOAWAY's error code (None without one)."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    body = json.dumps(chat()).encode()
    opened = 0
    goaway = None
    async with await trio.open_tcp_stream(*_address(url)) as stream:
        await stream.send_all(client.data_to_send())
        sending = trio.Lock()

        async def send() -> None:
            async with sending:
                await stream.send_all(client.data_to_send())

        async def read() -> None:
            nonlocal goaway
            while data := await stream.receive_some(65536):
                for event in client.receive_data(data):
                    if isinstance(event, h2.events.ConnectionTerminated):
                        goaway = event.error_code
                await send()

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read)
                try:
                    while opened < streams and goaway is None:
                        if client.outbound_flow_control_window < len(body):
                            await trio.sleep(0.001)  # the window updates come in `read`
                            continue
                        stream_id = client.get_next_available_stream_id()
                        client.send_headers(stream_id, _request_headers())
                        client.send_data(stream_id, body, end_stream=True)
                        client.reset_stream(stream_id)
                        opened += 1
                        await send()
                except (h2.exceptions.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # the gateway closed the connection
                with trio.move_on_after(5):
                    while goaway is None:
                        await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
    return opened, goaway

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

from bench.client_input import H2_REQUEST_HEADERS, reset_streams_on_one_connection
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
        client.send_headers(stream_id, H2_REQUEST_HEADERS)
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
        body = json.dumps(chat()).encode()
        opened, goaway = await reset_streams_on_one_connection(_address(gateway.url)[1], 2000, body)
        assert goaway == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
        assert opened <= 2 * H2_RESET_ALLOWANCE
        started = len(completions_to(nodes[0])) - 3
        assert started <= H2_RESET_ALLOWANCE, started
        # The gateway serves on.
        response = await gateway.http.post(gateway.url + CHAT, json=chat())
        assert response.status_code == 200

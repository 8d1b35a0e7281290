"""The private surface of the HTTP stack and of prometheus_client: what the gateway uses of
hypercorn beyond its public API, and of prometheus_client's metrics on the request path, is still
there in the version installed, and one without it fails loudly, naming its version. The behaviour behind each use is tested where it shows (tests/test_client_input.py:
the 408 race, h2c, the HTTP/2 reset budget; tests/test_dataplane_asgi.py: bodies)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from importlib.metadata import version

import hypercorn.protocol
import hypercorn.trio.run
import pytest
import trio
import trio.testing
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.tcp_server import TCPServer
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dataplane import hypercorn_private, prometheus_private
from dataplane.hypercorn_private import is_queue_receive, queued_message
from interlock.serve import listening_socket, serve_on_socket

from raw_http import exchange_until_closed

HYPERCORN = f"hypercorn {version('hypercorn')}"


async def _lifespan(receive, send) -> None:
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


@asynccontextmanager
async def _served(app, **options) -> AsyncIterator[int]:
    """`app` served by hypercorn as the gateway serves (`serve_on_socket`) while the block runs;
    its port."""
    listening = listening_socket("127.0.0.1:0", "listen")
    port = listening.getsockname()[1]
    stopped = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_on_socket, app, listening, stopped, **options))
        try:
            yield port
        finally:
            stopped.set()


def test_the_installed_hypercorn_has_what_the_gateway_overrides_and_takes_its_classes():
    hypercorn_private.check_private_surface()
    assert hypercorn.protocol.H2Protocol is hypercorn_private._H2WithResetBudget
    assert hypercorn.protocol.H11Protocol is hypercorn_private._H11AsServed
    assert hypercorn.trio.run.TCPServer is hypercorn_private._TCPServerClosingOnce


def test_a_hypercorn_without_an_overridden_method_stops_the_gateway_naming_its_version(monkeypatch):
    monkeypatch.delattr(H11Protocol, "_check_protocol")
    with pytest.raises(hypercorn_private.HypercornChanged) as raised:
        hypercorn_private.check_private_surface()
    message = str(raised.value)
    assert message.startswith(f"{HYPERCORN} is not the hypercorn Interlock was tested on")
    assert "async H11Protocol._check_protocol(self, event)" in message
    assert "H2Protocol" not in message


def test_a_hypercorn_whose_responses_bypass_the_overridden_send_stops_the_gateway(monkeypatch):
    async def stream_send(self, event) -> None:
        await self.send(event)

    monkeypatch.setattr(H11Protocol, "stream_send", stream_send)
    with pytest.raises(hypercorn_private.HypercornChanged) as raised:
        hypercorn_private.check_private_surface()
    assert "H11Protocol.stream_send sending its h11.Response through _send_h11_event" in str(raised.value)


async def test_status_lines_carry_the_reason_phrase():
    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        status = int(scope["path"].strip("/"))
        await send({"type": "http.response.start", "status": status, "headers": [(b"x-kept", b"Yes")]})
        await send({"type": "http.response.body", "body": b""})

    answers = {}
    async with _served(app) as port:
        for status in (200, 404, 503, 299):
            request = b"GET /%d HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n" % status
            answers[status] = await exchange_until_closed(port, request)
        answers["hypercorn's own"] = await exchange_until_closed(port, b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n")
    status_lines = {key: answer.partition(b"\r\n")[0] for key, answer in answers.items()}
    assert status_lines == {
        200: b"HTTP/1.1 200 OK",
        404: b"HTTP/1.1 404 Not Found",
        503: b"HTTP/1.1 503 Service Unavailable",
        299: b"HTTP/1.1 299 ",
        "hypercorn's own": b"HTTP/1.1 400 Bad Request",
    }
    assert b"\r\nx-kept: Yes\r\n" in answers[200]


def test_a_hypercorn_whose_connection_sends_outside_its_lock_stops_the_gateway(monkeypatch):
    """The close takes the send lock so that it never meets a send: that holds only while
    hypercorn sends under that lock."""

    async def protocol_send(self, event) -> None:
        await self.stream.send_all(event.data)

    monkeypatch.setattr(TCPServer, "protocol_send", protocol_send)
    with pytest.raises(hypercorn_private.HypercornChanged) as raised:
        hypercorn_private.check_private_surface()
    assert "TCPServer.protocol_send sending under send_lock" in str(raised.value)


def test_a_hypercorn_whose_connection_keeps_its_keep_alive_timeout_elsewhere_stops_the_gateway(monkeypatch):
    """The keep-alive timeout's stand-in (`_KeepAliveTimer`) takes the place of hypercorn's idle task."""

    async def protocol_send(self, event) -> None:
        async with self.send_lock:
            await self.stream.send_all(event.data)

    monkeypatch.setattr(TCPServer, "protocol_send", protocol_send)
    with pytest.raises(hypercorn_private.HypercornChanged) as raised:
        hypercorn_private.check_private_surface()
    assert str(raised.value).startswith(f"{HYPERCORN} is not the hypercorn Interlock was tested on")
    assert "TCPServer keeping its keep-alive timeout in idle_task" in str(raised.value)


async def _answer(stream: trio.SocketStream, path: bytes) -> bytes:
    """One keep-alive request's answer (its body is `ok`)."""
    await stream.send_all(b"GET %s HTTP/1.1\r\nHost: gw\r\n\r\n" % path)
    received = b""
    with trio.fail_after(60):
        while not received.endswith(b"\r\n\r\nok"):
            chunk = await stream.receive_some()
            assert chunk, f"closed before the answer to {path!r}: {received!r}"
            received += chunk
    return received


async def _closed(stream: trio.SocketStream) -> bool:
    with trio.fail_after(60):
        return await stream.receive_some() == b""


async def test_a_connection_stays_open_through_requests_longer_than_its_keep_alive_timeout_and_closes_once_idle():
    keep_alive = 1.0

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        if scope["path"] == "/slow":
            await trio.sleep(keep_alive * 1.5)  # a request longer than the keep-alive timeout
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async with _served(app, keep_alive_timeout=keep_alive) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            for path in (b"/slow", b"/fast", b"/fast", b"/slow", b"/fast"):
                assert (await _answer(stream, path)).startswith(b"HTTP/1.1 200 ")
            assert await _closed(stream)


async def test_a_server_ending_closes_its_idle_connections_at_once_and_a_busy_one_after_its_answer():
    release = trio.Event()

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        if scope["path"] == "/held":
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    listening = listening_socket("127.0.0.1:0", "listen")
    port = listening.getsockname()[1]
    stopped = trio.Event()
    async with trio.open_nursery() as nursery:
        # A keep-alive timeout far longer than the test waits for anything.
        await nursery.start(partial(serve_on_socket, app, listening, stopped, keep_alive_timeout=3600))
        async with (
            await trio.open_tcp_stream("127.0.0.1", port) as idle,
            await trio.open_tcp_stream("127.0.0.1", port) as busy,
        ):
            assert (await _answer(idle, b"/fast")).startswith(b"HTTP/1.1 200 ")
            async with trio.open_nursery() as held:
                held.start_soon(_answer, busy, b"/held")
                await trio.testing.wait_all_tasks_blocked()  # the held request is in the app
                stopped.set()
                assert await _closed(idle)
                release.set()
            assert await _closed(busy)


async def test_a_client_closing_its_side_has_its_connection_closed_once_the_app_has_seen_it_leave():
    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        while (await receive())["type"] != "http.disconnect":
            pass

    # A keep-alive timeout far longer than the test waits for anything.
    async with _served(app, keep_alive_timeout=3600) as port:
        for request in (b"", b"GET /held HTTP/1.1\r\nHost: gw\r\n\r\n"):  # idle, then in a request
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(request)
                await stream.send_eof()
                assert await _closed(stream)


def test_a_hypercorn_whose_connection_reads_otherwise_stops_the_gateway(monkeypatch):
    """The keep-alive timer ends when the connection's reading does (`_read_data`)."""
    monkeypatch.delattr(TCPServer, "_read_data")
    with pytest.raises(hypercorn_private.HypercornChanged) as raised:
        hypercorn_private.check_private_surface()
    assert "async TCPServer._read_data(self)" in str(raised.value)


def test_metrics_updated_through_their_values_expose_what_their_own_methods_would():
    prometheus_private.check_private_surface()
    pages = []
    for direct in (False, True):
        registry = CollectorRegistry()
        counter = Counter("c", "a counter", ["model"], registry=registry).labels("m")
        gauge = Gauge("g", "a gauge", ["node"], registry=registry).labels("n")
        histogram = Histogram("h_seconds", "a histogram", buckets=(0.005, 0.01, 1.0), registry=registry)
        if direct:
            prometheus_private.value_of(counter).inc(3)
            prometheus_private.value_of(gauge).inc(2)
            prometheus_private.value_of(gauge).inc(-1)
            observer = prometheus_private.Observer(histogram)
        else:
            counter.inc(3)
            gauge.inc(2)
            gauge.dec()
            observer = histogram
        for seconds in (0.0, 0.005, 0.0050001, 0.01, 0.5, 1.0, 7.0):
            observer.observe(seconds)
        pages.append(b"\n".join(line for line in generate_latest(registry).splitlines() if b"_created" not in line))
    assert pages[0] == pages[1]
    assert b'h_seconds_bucket{le="0.005"} 2.0' in pages[1]


def test_a_prometheus_client_keeping_a_histogram_otherwise_stops_the_gateway_naming_its_version(monkeypatch):
    def observe(self, amount: float, exemplar=None) -> None:
        self._value.inc(amount)

    monkeypatch.setattr(Histogram, "observe", observe)
    with pytest.raises(prometheus_private.PrometheusClientChanged) as raised:
        prometheus_private.check_private_surface()
    message = str(raised.value)
    assert message.startswith(
        f"prometheus_client {version('prometheus_client')} is not the prometheus_client Interlock was tested on"
    )
    assert "Histogram.observe adding to _sum and to the first bucket" in message
    assert "Counter.inc" not in message


async def test_a_body_sent_with_its_head_is_queued_whole_with_its_end_when_the_app_starts():
    """hypercorn's puts are made at once (`_TaskGroupPuttingAtOnce`): the app takes such a body
    without waiting (`dataplane.asgi._read_body`)."""
    seen: list[list[tuple[bytes, bool]]] = []

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        queued = []
        assert is_queue_receive(receive)
        while (message := queued_message(receive)) is not None:
            queued.append((message["body"], message["more_body"]))
        seen.append(queued)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async with _served(app) as port:
        request = b"POST / HTTP/1.1\r\nHost: gw\r\nContent-Length: 5\r\n\r\nhello"
        answer = await exchange_until_closed(
            port, request + request.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
        )
    assert answer.count(b"HTTP/1.1 204 ") == 2
    assert seen == [[(b"hello", True), (b"", False)]] * 2, (
        f"{HYPERCORN} no longer gives the app a trio memory channel's receive with a body sent with its head "
        "queued whole when the app starts: see dataplane/hypercorn_private.py"
    )


def test_a_hypercorn_whose_task_group_hands_requests_over_otherwise_stops_the_gateway(monkeypatch):
    async def spawn_app(self, app, config, scope, send):
        return await self._queue(app, config, scope, send)

    monkeypatch.setattr(TaskGroup, "spawn_app", spawn_app)
    with pytest.raises(hypercorn_private.HypercornChanged) as raised:
        hypercorn_private.check_private_surface()
    assert str(raised.value).startswith(f"{HYPERCORN} is not the hypercorn Interlock was tested on")
    assert "whose spawn_app returns a trio memory channel's send" in str(raised.value)

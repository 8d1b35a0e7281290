"""Step generators run together by one task (transport/readiness.py) and prepared requests as step
generators (`request_steps` in transport/steps.py), against real servers: the raw servers of
test_http11.py and the simulated node. A prepared request must read every response as
`HttpClient.request` + `read_body` do, so most tests compare the two on the same server."""

from __future__ import annotations

import socket
import threading

import pytest
import trio
from test_http11 import (
    HOST,
    OK_HELLO,
    ServerConnection,
    answer_each,
    closed_by_client,
    closes_after_reading_the_second_request,
    node_spec,
    raw_server,
)

from controlplane.effects.probes import MAX_BODY_BYTES
from fixtures.node import serve_node
from transport.http11 import BodyTooLarge, ConnectFailed, HttpClient, HttpError
from transport.steps import request_steps
from transport.readiness import GATHER_FROM, GATHER_SECONDS, READ, InThread, Readiness, TimedOut, Wait, drive


async def steps_get(client: HttpClient, host: str, port: int, target: bytes = b"/", limit: int | None = None):
    request = client.prepare(b"GET", host, port, target)
    return await drive(request_steps(request, trio.current_time() + 5, limit))


async def client_get(client: HttpClient, host: str, port: int, target: bytes = b"/", limit: int | None = None):
    response = await client.request(b"GET", host, port, target)
    return response.status, await response.read_body(limit)


async def both_ways(response: bytes) -> list[tuple[int, bytes] | tuple[type, str]]:
    """What `client.request` + `read_body` and a prepared request each make of `response`, sent
    to each on a fresh connection that the server then closes: the status and body, or the
    error's type and text."""

    async def answer_and_close(connection: ServerConnection) -> None:
        await connection.request()
        await connection.send(response)

    outcomes = []
    for way in (client_get, steps_get):
        async with raw_server(answer_and_close) as server, HttpClient() as client:
            try:
                outcomes.append(await way(client, HOST, server.port))
            except HttpError as error:
                outcomes.append((type(error), str(error)))
    return outcomes


@pytest.mark.parametrize(
    "response",
    [
        OK_HELLO,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;name=value\r\nhello\r\n1 \r\n \r\nB\r\nhello again\r\n0\r\nX-Checksum: abc\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK_HELLO,
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\ndown",
        b"HTTP/1.0 200 OK\r\n\r\nuntil the close",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello",
        b"HTTP/1.1 2OO OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nA: 1\nB: 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5, 6\r\n\r\nhello",
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhiX\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;" + b"x" * 5000,
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-",
        b"",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nBad Trailer: x\r\n\r\n",
    ],
    ids=[
        "sized", "chunked", "interim", "no-body", "error-status", "until-close", "repeated-length", "bad-status",
        "bare-lf", "bad-length", "cut-short", "bad-chunk-size", "chunk-without-crlf", "long-chunk-line", "101",
        "cut-head", "closed", "unsupported-coding", "bad-trailer",
    ],
)  # fmt: skip
async def test_a_prepared_request_reads_each_response_as_the_client_does(response):
    from_client, from_steps = await both_ways(response)
    assert from_steps == from_client


async def test_a_chunked_body_sent_byte_by_byte_is_decoded_and_the_connection_kept():
    message = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n10\r\n0123456789abcdef\r\n0\r\n\r\n"

    async def trickle(connection: ServerConnection) -> None:
        while await connection.request() is not None:
            for index in range(len(message)):
                await connection.send(message[index : index + 1])
                await trio.sleep(0.001)
        connection.server.closed_by_client += 1

    async with raw_server(trickle) as server, HttpClient() as client:
        assert await steps_get(client, HOST, server.port) == (200, b"abc0123456789abcdef")
        assert await steps_get(client, HOST, server.port) == (200, b"abc0123456789abcdef")
    assert server.connections == 1


async def test_a_get_that_fails_on_a_reused_connection_before_any_response_byte_is_sent_again():
    async with raw_server(closes_after_reading_the_second_request()) as server, HttpClient() as client:
        await steps_get(client, HOST, server.port)
        assert await steps_get(client, HOST, server.port, b"/again") == (200, b"hello")
    assert [(number, request.split(b" ")[1]) for number, request in server.requests] == [
        (1, b"/"),
        (1, b"/again"),
        (2, b"/again"),
    ]


async def test_a_refused_connection_and_an_unknown_host_are_connect_failures_as_for_the_client():
    with socket.socket() as unused:
        unused.bind((HOST, 0))
        port = unused.getsockname()[1]
    for host in (HOST, "no-such-host.invalid"):
        async with HttpClient() as client:
            with pytest.raises(ConnectFailed) as from_client:
                await client_get(client, host, port)
            with pytest.raises(ConnectFailed) as from_steps:
                await steps_get(client, host, port)
        assert str(from_steps.value) == str(from_client.value)


async def test_an_oversized_chunked_body_from_the_node_is_cut_off_at_the_limit():
    async with serve_node(node_spec(models="oversized")) as node, HttpClient() as client:
        with pytest.raises(BodyTooLarge):
            await steps_get(client, node.host, node.vllm_port, b"/v1/models", limit=MAX_BODY_BYTES)
        assert await steps_get(client, node.host, node.vllm_port, b"/health") == (200, b"")
        assert len(node.requests) == 2


# --- many step generators in one Readiness -------------------------------------------------------


async def test_many_requests_run_together_on_kept_connections_and_a_hung_one_holds_up_none():
    async def hang(connection: ServerConnection) -> None:
        await connection.request()
        await connection.wait_closed_by_client()

    async with (
        raw_server(answer_each(OK_HELLO)) as answering,
        raw_server(hang) as hung,
        HttpClient(max_idle_per_host=20) as client,
        trio.open_nursery() as nursery,
    ):
        readiness = Readiness(nursery)
        targets = [b"/%d" % number for number in range(20)]
        requests = {target: client.prepare(b"GET", HOST, answering.port, target) for target in targets}
        hung_request = client.prepare(b"GET", HOST, hung.port, b"/hung")
        hung_deadline = trio.current_time() + 0.5
        for round_number in range(2):
            readiness.start(b"/hung", request_steps(hung_request, hung_deadline))
            for target, request in requests.items():
                readiness.start(target, request_steps(request, trio.current_time() + 5))
            reported = []
            while len(reported) < len(targets) + 1:
                reported.extend(await readiness.finished())
            assert {key: result for key, result, _ in reported[:-1]} == {target: (200, b"hello") for target in targets}
            assert reported[-1][0] == b"/hung" and isinstance(reported[-1][2], TimedOut)
            await closed_by_client(hung, round_number + 1)
            hung_deadline = trio.current_time() + 0.1
        assert len(readiness) == 0
        readiness.close()
        nursery.cancel_scope.cancel()
    assert answering.connections == len(targets)  # each kept and used again by the second round
    assert len(answering.requests) == 2 * len(targets)


async def test_a_host_name_is_looked_up_in_a_task_and_the_request_runs_with_the_others():
    async with raw_server(answer_each(OK_HELLO)) as server, HttpClient() as client, trio.open_nursery() as nursery:
        readiness = Readiness(nursery)
        for key, host in (("by name", "localhost"), ("by address", HOST)):
            request = client.prepare(b"GET", host, server.port, b"/")
            readiness.start(key, request_steps(request, trio.current_time() + 5))
        reported = []
        while len(reported) < 2:
            reported.extend(await readiness.finished())
        readiness.close()
        nursery.cancel_scope.cancel()
    assert sorted(reported) == [("by address", (200, b"hello"), None), ("by name", (200, b"hello"), None)]


def _in_worker_thread(text: str) -> tuple[str, bool]:
    if text == "bad":
        raise ValueError("bad input")
    return text.upper(), threading.current_thread() is not threading.main_thread()


def _in_thread_then_return(text: str):
    try:
        return (yield InThread(_in_worker_thread, text))
    except ValueError as error:
        return f"thrown in: {error}"


async def test_work_handed_to_a_thread_is_sent_back_or_its_exception_thrown_in():
    assert await drive(_in_thread_then_return("abc")) == ("ABC", True)
    async with trio.open_nursery() as nursery:
        readiness = Readiness(nursery)
        readiness.start("ok", _in_thread_then_return("abc"))
        readiness.start("raises", _in_thread_then_return("bad"))
        reported = []
        while len(reported) < 2:
            reported.extend(await readiness.finished())
        readiness.close()
    assert sorted(reported) == [("ok", ("ABC", True), None), ("raises", "thrown in: bad input", None)]


async def test_closing_a_readiness_ends_its_step_generators_and_drops_their_connections():
    async def hang(connection: ServerConnection) -> None:
        await connection.request()
        await connection.wait_closed_by_client()

    async def keep_reporting(readiness: Readiness) -> None:
        while True:
            await readiness.finished()

    async with raw_server(hang) as hung, HttpClient() as client:
        async with trio.open_nursery() as nursery:
            readiness = Readiness(nursery)
            nursery.start_soon(keep_reporting, readiness)
            for number in range(3):
                request = client.prepare(b"GET", HOST, hung.port, b"/")
                readiness.start(number, request_steps(request, trio.current_time() + 60))
            while len(hung.requests) < 3:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        readiness.close()
        await closed_by_client(hung, 3)


async def test_with_many_step_generators_waiting_the_sockets_are_looked_at_once_per_gathering_time(mock_clock):
    """Sockets that become ready one after another within GATHER_SECONDS are reported together,
    not one wake-up each (the clock stands still until the test moves it)."""
    count = GATHER_FROM + 8

    def read_one(sock: socket.socket):
        yield Wait(sock, READ, trio.current_time() + 60)
        return sock.recv(10)

    pairs = [socket.socketpair() for _ in range(count)]
    batches: list[int] = []
    async with trio.open_nursery() as nursery:
        readiness = Readiness(nursery)
        for number, (ours, _) in enumerate(pairs):
            ours.setblocking(False)
            readiness.start(number, read_one(ours))

        async def collect() -> None:
            while sum(batches) < count:
                batches.append(len(await readiness.finished()))

        nursery.start_soon(collect)
        pairs[0][1].send(b"first")
        while not batches:
            await trio.sleep(0)  # the first answer, seen as soon as it came
        for _, theirs in pairs[1:]:
            theirs.send(b"later")
            await trio.sleep(0)  # a wake-up per socket would happen here
        assert batches == [1]
        mock_clock.jump(GATHER_SECONDS)
    readiness.close()
    for pair in pairs:
        for sock in pair:
            sock.close()
    assert batches == [1, count - 1]

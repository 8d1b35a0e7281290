"""The lean HTTP/1.1 client (transport/http11.py, its parser transport/parser.py) against real servers: the simulated node,
and small raw trio servers (tests/raw_http.py) for the edge cases a well-behaved server never shows."""

from __future__ import annotations

import socket

import msgspec
import pytest
import trio

from controlplane.effects.probes import ProbeClient, ProbeError
from fixtures.node import Behaviour, NodeSpec, RecordedRequest, SimulatedNode, serve_node
from transport.http11 import (
    MAX_HEAD_BYTES,
    BodyTooLarge,
    ConnectFailed,
    ConnectionLost,
    HttpClient,
    LostBeforeResponse,
    ProtocolError,
    WriteFailed,
)
from transport.parser import parse_head
from transport.readiness import drive

from raw_http import HOST, Handler, RawServer, ServerConnection, answer_each, raw_server

OK_HELLO = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"


async def get(client: HttpClient, server: RawServer, target: bytes = b"/", **options) -> tuple[int, bytes]:
    response = await client.request(b"GET", HOST, server.port, target, **options)
    return response.status, await response.read_body()


async def settle() -> None:
    """Let the other side see what one side just did."""
    await trio.sleep(0.05)


async def closed_by_client(server: RawServer, count: int) -> None:
    """Wait until the server has seen `count` connections closed by the client."""
    with trio.fail_after(60):
        while server.closed_by_client < count:
            await trio.sleep(0.01)
    assert server.closed_by_client == count


# --- requests and keep-alive ---------------------------------------------------------------------


async def test_a_request_is_written_as_one_message_and_its_connection_is_reused():
    async with raw_server(answer_each(OK_HELLO)) as server, HttpClient() as client:
        response = await client.request(
            b"POST", HOST, server.port, b"/v1/x?y=1", [(b"content-type", b"application/json")], b'{"a": 1}'
        )
        assert (response.status, response.reason, response.version) == (200, b"OK", b"HTTP/1.1")
        assert response.headers == [(b"content-length", b"5")]
        assert response.content_length == 5 and response.header(b"content-length") == b"5"
        assert await response.read_body() == b"hello" and response.complete
        assert await get(client, server) == (200, b"hello")
    assert server.connections == 1
    assert server.requests == [
        (
            1,
            b"POST /v1/x?y=1 HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
            b'content-length: 8\r\n\r\n{"a": 1}' % server.port,
        ),
        (1, b"GET / HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n\r\n" % server.port),
    ]


async def test_headers_with_cr_or_lf_and_bad_targets_are_refused_before_sending():
    async with raw_server(answer_each(OK_HELLO)) as server, HttpClient() as client:
        with pytest.raises(ValueError, match="CR or LF"):
            await client.request(b"GET", HOST, server.port, b"/", [(b"x-a", b"1\r\nx-injected: 2")])
        with pytest.raises(ValueError, match="bad request target"):
            await client.request(b"GET", HOST, server.port, b"/ HTTP/1.0\r\n")
    assert server.connections == 0


async def test_concurrent_requests_use_separate_connections_and_at_most_max_idle_are_kept():
    async def slow_answer(connection: ServerConnection) -> None:
        while await connection.request() is not None:
            await trio.sleep(0.05)
            await connection.send(OK_HELLO)
        connection.server.closed_by_client += 1

    async with raw_server(slow_answer) as server, HttpClient(max_idle_per_host=2) as client:
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(get, client, server)
        await closed_by_client(server, 1)
        assert server.connections == 3
        for _ in range(4):
            assert await get(client, server) == (200, b"hello")
    assert server.connections == 3


async def test_an_idle_connection_expires():
    async with raw_server(answer_each(OK_HELLO)) as server, HttpClient(idle_seconds=0.05) as client:
        await get(client, server)
        await trio.sleep(0.1)
        await get(client, server)
        await closed_by_client(server, 1)
        assert server.connections == 2


async def test_forget_closes_the_idle_connections_to_a_host():
    async with raw_server(answer_each(OK_HELLO)) as server, HttpClient() as client:
        await get(client, server)
        client.forget(HOST)
        await closed_by_client(server, 1)
        await get(client, server)
    assert server.connections == 2


# --- response framing --------------------------------------------------------------------------


async def test_a_chunked_body_is_decoded_despite_extensions_and_trailers_and_the_connection_reused():
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;name=value\r\nhello\r\n1 \r\n \r\nB\r\nhello again\r\n0\r\nX-Checksum: abc\r\nX-Other: 1\r\n\r\n"
    )
    async with raw_server(answer_each(chunked, OK_HELLO)) as server, HttpClient() as client:
        response = await client.request(b"GET", HOST, server.port, b"/")
        assert response.content_length is None
        assert await response.read_body() == b"hello hello again"
        assert await get(client, server) == (200, b"hello")
    assert server.connections == 1


async def test_a_chunked_body_sent_byte_by_byte_is_decoded():
    message = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n10\r\n0123456789abcdef\r\n0\r\n\r\n"

    async def trickle(connection: ServerConnection) -> None:
        await connection.request()
        for index in range(len(message)):
            await connection.send(message[index : index + 1])
            await trio.sleep(0.001)
        await connection.wait_closed_by_client()

    async with raw_server(trickle) as server, HttpClient() as client:
        response = await client.request(b"GET", HOST, server.port, b"/")
        pieces = [piece async for piece in response]
        assert b"".join(pieces) == b"abc0123456789abcdef"
        assert all(pieces)
        assert response.complete


async def test_chunks_are_handed_over_as_they_arrive():
    gate = trio.Event()

    async def two_chunks(connection: ServerConnection) -> None:
        await connection.request()
        await connection.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\nfirst \r\n")
        await gate.wait()
        await connection.send(b"6\r\nsecond\r\n0\r\n\r\n")
        await connection.wait_closed_by_client()

    async with raw_server(two_chunks) as server, HttpClient() as client:
        response = await client.request(b"GET", HOST, server.port, b"/")
        assert await response.next_chunk() == b"first "
        gate.set()
        assert await response.next_chunk() == b"second"
        assert await response.next_chunk() == b""
        assert await response.next_chunk() == b""


async def test_a_close_delimited_body_is_read_to_the_end_and_its_connection_not_reused():
    async def close_delimited(connection: ServerConnection) -> None:
        await connection.request()
        await connection.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil ")
        await connection.send(b"the close")

    async with raw_server(close_delimited) as server, HttpClient() as client:
        assert await get(client, server) == (200, b"until the close")
        assert await get(client, server) == (200, b"until the close")
    assert server.connections == 2


@pytest.mark.parametrize(
    ("method", "head"),
    [
        (b"GET", b"HTTP/1.1 204 No Content\r\n\r\n"),
        (b"GET", b"HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n"),
        (b"HEAD", b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n"),
        (b"GET", b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"),
    ],
)
async def test_responses_without_a_body_are_complete_at_once_and_keep_their_connection(method, head):
    async with raw_server(answer_each(head, OK_HELLO)) as server, HttpClient() as client:
        response = await client.request(method, HOST, server.port, b"/")
        assert response.complete
        assert await response.read_body() == b""
        assert await get(client, server) == (200, b"hello")
    assert server.connections == 1


async def test_interim_responses_are_skipped():
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n"
    async with raw_server(answer_each(interim + OK_HELLO, OK_HELLO)) as server, HttpClient() as client:
        assert await get(client, server) == (200, b"hello")
        assert await get(client, server) == (200, b"hello")
    assert server.connections == 1


@pytest.mark.parametrize(
    "response",
    [
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 5\r\n\r\nhello",
        b"HTTP/1.1 200 OK\r\nconnection: Keep-Alive, CLOSE\r\nContent-Length: 5\r\n\r\nhello",
        b"HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\nhello",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello, and bytes nobody asked for",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    ],
    ids=["connection-close", "close-among-tokens", "http-1.0", "bytes-after-body", "length-and-chunked"],
)
async def test_a_connection_that_cannot_carry_another_response_is_not_reused(response):
    async with raw_server(answer_each(response)) as server, HttpClient() as client:
        assert await get(client, server) == (200, b"hello")
        assert await get(client, server) == (200, b"hello")
        await closed_by_client(server, 2)
    assert server.connections == 2


@pytest.mark.parametrize("declared", [b"Content-Length: 5", b"Transfer-Encoding: chunked"])
async def test_a_204_that_declares_a_body_does_not_keep_its_connection(declared):
    # Its body, when it comes after the head, would be read as the next response.
    head = b"HTTP/1.1 204 No Content\r\n" + declared + b"\r\n\r\n"

    async def first_a_204(connection: ServerConnection) -> None:
        while await connection.request() is not None:
            await connection.send(head if len(connection.server.requests) == 1 else OK_HELLO)

    async with raw_server(first_a_204) as server, HttpClient() as client:
        assert await get(client, server) == (204, b"")
        assert await get(client, server) == (200, b"hello")
    assert server.connections == 2


async def test_the_connection_options_a_response_names_are_listed_lower_case():
    response = b"HTTP/1.1 200 OK\r\nConnection: X-Hop, keep-alive\r\nconnection: Other\r\nContent-Length: 0\r\n\r\n"
    async with raw_server(answer_each(response)) as server, HttpClient() as client:
        answer = await client.request(b"GET", HOST, server.port, b"/")
        assert answer.connection_options == (b"x-hop", b"keep-alive", b"other")


async def test_an_http_1_0_keep_alive_response_keeps_its_connection():
    response = b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 5\r\n\r\nhello"
    async with raw_server(answer_each(response)) as server, HttpClient() as client:
        await get(client, server)
        await get(client, server)
    assert server.connections == 1


async def test_repeated_content_length_values_that_agree_are_accepted():
    response = b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\ncontent-length: 5\r\n\r\nhello"
    async with raw_server(answer_each(response)) as server, HttpClient() as client:
        assert await get(client, server) == (200, b"hello")


# --- malformed responses -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "error"),
    [
        (b"HTTP/1.1 2OO OK\r\n\r\n", "malformed status line b'HTTP/1.1 2OO OK'"),
        (b"ICY 200 OK\r\n\r\n", "malformed status line b'ICY 200 OK'"),
        (b"HTTP/2 200\r\n\r\n", "malformed status line b'HTTP/2 200'"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header line b'no colon here'"),
        (b"HTTP/1.1 200 OK\r\nBad Name: x\r\n\r\n", "malformed header line b'Bad Name: x'"),
        (b"HTTP/1.1 200 OK\r\nA: 1\r\n folded\r\n\r\n", "malformed header line b' folded'"),
        (b"HTTP/1.1 200 OK\r\nA: 1\nB: 2\r\n\r\n", "bare CR or LF in the response head"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5, 6\r\n\r\nhello", "bad Content-Length b'5, 6'"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\nhello", "bad Content-Length b'-5'"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size line b'zz'"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n", "bad chunk size line b'0x5'"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhiX\r\n", "chunk data not followed by CRLF"),
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n", "unexpected 101 Switching Protocols"),
        (b"HTTP/1.1 000 Zero\r\n\r\nHTTP/1.1 200 OK\r\n\r\n", "malformed status line b'HTTP/1.1 000 Zero'"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            "unsupported Transfer-Encoding b'gzip, chunked' (only chunked is)",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            "unsupported Transfer-Encoding b'chunked, chunked' (only chunked is)",
        ),
        (
            b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: identity\r\n\r\n",
            "unsupported Transfer-Encoding b'identity' (only chunked is)",
        ),
        (
            b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\n\r\n",
            "control byte b'\\x00' in the response head b'HTTP/1.1 200 OK\\r\\nX-A: a\\x00b'",
        ),
        (b"HTTP/1.1 200 OK\r\nX(A): 1\r\n\r\n", "malformed header line b'X(A): 1'"),
        (
            b"HTTP/1.1 200 OK\nContent-Length: 5\n\nhello",
            "bare LF in the response head b'HTTP/1.1 200 OK\\nContent-Length: 5\\n\\nhello'",
        ),
        (b"HTTP/1.1 204 No Content\r\nContent-Length: x\r\n\r\n", "bad Content-Length b'x'"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5 ;x\r\nhello\r\n", "bad chunk size line b'5 ;x'"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-T: a\x01b\r\n\r\n",
            "control byte in the chunked trailers b'X-T: a\\x01b'",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nno colon\r\n\r\n",
            "malformed header line b'no colon'",
        ),
    ],
)
async def test_a_malformed_response_is_a_protocol_error_and_drops_the_connection(response, error):
    async def answer_once(connection: ServerConnection) -> None:
        await connection.request()
        await connection.send(response)
        await connection.wait_closed_by_client()

    async with raw_server(answer_once) as server, HttpClient() as client:
        with pytest.raises(ProtocolError) as caught:
            await get(client, server)
        assert str(caught.value) == error
        await closed_by_client(server, 1)


async def test_an_oversized_head_is_refused():
    huge = b"HTTP/1.1 200 OK\r\n" + b"X-Filler: " + b"x" * MAX_HEAD_BYTES + b"\r\n\r\n"
    async with raw_server(answer_each(huge)) as server, HttpClient() as client:
        with pytest.raises(ProtocolError, match=f"response head exceeds {MAX_HEAD_BYTES} bytes"):
            await get(client, server)


async def test_oversized_chunk_lines_and_trailers_are_refused():
    long_line = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;" + b"x" * 5000
    trailers = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n" + b"X-T: y\r\n" * (MAX_HEAD_BYTES // 8 + 1)
    async with raw_server(answer_each(long_line)) as server, HttpClient() as client:
        with pytest.raises(ProtocolError, match="chunk size line exceeds 4096 bytes"):
            await get(client, server)
    async with raw_server(answer_each(trailers)) as server, HttpClient() as client:
        with pytest.raises(ProtocolError, match=f"chunked trailers exceed {MAX_HEAD_BYTES} bytes"):
            await get(client, server)


def test_parse_head_lowercases_names_and_strips_values():
    head = b"HTTP/1.1 404 Not Found\r\nX-Thing:  spaced \t\r\nEmpty:\r\nx-colon: a:b"
    assert parse_head(head) == (
        b"HTTP/1.1",
        404,
        b"Not Found",
        [(b"x-thing", b"spaced"), (b"empty", b""), (b"x-colon", b"a:b")],
    )
    assert parse_head(b"HTTP/1.1 200") == (b"HTTP/1.1", 200, b"", [])


# --- broken connections ------------------------------------------------------------------------


async def test_a_refused_connection_is_a_connect_failure_that_names_the_address():
    with socket.socket() as unused:
        unused.bind((HOST, 0))
        port = unused.getsockname()[1]
    async with HttpClient() as client:
        with pytest.raises(ConnectFailed) as caught:
            await client.request(b"GET", HOST, port, b"/")
    assert str(caught.value) == f"dial tcp 127.0.0.1:{port}: connect: connection refused"


async def test_a_connect_that_takes_too_long_is_a_connect_failure():
    with socket.socket() as listener:
        listener.bind((HOST, 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        with socket.create_connection((HOST, port)):  # fills the backlog: later SYNs are dropped
            async with HttpClient() as client:
                with pytest.raises(ConnectFailed) as caught:
                    await client.request(b"GET", HOST, port, b"/", connect_timeout=0.2)
    assert str(caught.value) == f"dial tcp 127.0.0.1:{port}: i/o timeout after 0.2s"


async def test_an_unknown_host_is_a_connect_failure():
    async with HttpClient() as client:
        with pytest.raises(ConnectFailed, match=r"^dial tcp no-such-host\.invalid:80: lookup no-such-host\.invalid: "):
            await client.request(b"GET", "no-such-host.invalid", 80, b"/")


async def test_a_body_cut_short_is_a_lost_connection():
    async def cut(connection: ServerConnection) -> None:
        await connection.request()
        await connection.send(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello")

    async with raw_server(cut) as server, HttpClient() as client:
        with pytest.raises(ConnectionLost) as caught:
            await get(client, server)
    assert str(caught.value) == "connection closed after 5 of 10 body bytes"
    assert type(caught.value) is ConnectionLost


async def test_a_server_that_closes_without_responding_on_a_new_connection_is_a_lost_connection():
    async def hang_up(connection: ServerConnection) -> None:
        await connection.request()

    async with raw_server(hang_up) as server, HttpClient() as client:
        with pytest.raises(ConnectionLost) as caught:
            await get(client, server)
    assert type(caught.value) is LostBeforeResponse  # a new connection: not a write-phase failure
    assert str(caught.value) == "the server closed the connection before the response head was complete"
    assert server.connections == 1  # not retried


async def test_a_server_that_closes_in_the_middle_of_the_head_is_a_lost_connection_after_response_bytes():
    async def half_a_head(connection: ServerConnection) -> None:
        await connection.request()
        await connection.send(b"HTTP/1.1 200 OK\r\nContent-")

    async with raw_server(half_a_head) as server, HttpClient() as client:
        with pytest.raises(ConnectionLost) as caught:
            await get(client, server)
    assert type(caught.value) is ConnectionLost
    assert str(caught.value) == "the server closed the connection before the response head was complete"


async def test_an_idle_connection_the_server_closed_is_not_reused():
    async def one_response_then_close(connection: ServerConnection) -> None:
        await connection.request()
        await connection.send(OK_HELLO)

    async with raw_server(one_response_then_close) as server, HttpClient() as client:
        await get(client, server)
        with trio.fail_after(60):
            while server.handlers_done < 1:
                await trio.sleep(0.01)
        await settle()
        assert await get(client, server) == (200, b"hello")
    assert server.connections == 2
    assert [number for number, _ in server.requests] == [1, 2]  # nothing was sent on the closed one


def closes_after_reading_the_second_request() -> Handler:
    """Connection 1 answers one request, then reads the next and closes without a word (the race
    of a keep-alive connection the server closes as the client reuses it); later ones answer."""

    async def handler(connection: ServerConnection) -> None:
        if connection.number == 1:
            await connection.request()
            await connection.send(OK_HELLO)
            await connection.request()
            return
        await answer_each(OK_HELLO)(connection)

    return handler


async def test_a_get_that_fails_on_a_reused_connection_before_any_response_byte_is_sent_again():
    async with raw_server(closes_after_reading_the_second_request()) as server, HttpClient() as client:
        await get(client, server)
        assert await get(client, server, b"/again") == (200, b"hello")
    assert [(number, request.split(b" ")[1]) for number, request in server.requests] == [
        (1, b"/"),
        (1, b"/again"),
        (2, b"/again"),
    ]


async def test_a_post_that_fails_on_a_reused_connection_before_any_response_byte_is_a_write_failure():
    async with raw_server(closes_after_reading_the_second_request()) as server, HttpClient() as client:
        await get(client, server)
        with pytest.raises(WriteFailed) as caught:
            await client.request(b"POST", HOST, server.port, b"/completions", body=b"{}")
    assert str(caught.value) == "the server closed the keep-alive connection before responding"
    assert isinstance(caught.value, ConnectionLost)
    assert server.connections == 1  # the caller decides whether to send it again


async def test_a_response_closed_before_its_body_was_read_drops_its_connection():
    async with raw_server(answer_each(OK_HELLO)) as server, HttpClient() as client:
        response = await client.request(b"GET", HOST, server.port, b"/")
        response.close()
        response.close()  # again: harmless
        assert not response.complete
        with pytest.raises(trio.ClosedResourceError):
            await response.next_chunk()
        await closed_by_client(server, 1)
        await get(client, server)
    assert server.connections == 2


async def test_a_read_cancelled_mid_body_drops_the_connection():
    async def half_a_body(connection: ServerConnection) -> None:
        await connection.request()
        await connection.send(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello")
        await connection.wait_closed_by_client()

    async with raw_server(half_a_body) as server, HttpClient() as client:
        response = await client.request(b"GET", HOST, server.port, b"/")
        with trio.move_on_after(0.1):
            await response.read_body()
        await closed_by_client(server, 1)
        with pytest.raises(trio.ClosedResourceError):
            await response.read_body()


async def test_read_body_stops_at_its_limit_and_drops_the_connection():
    declared = b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n"  # never sent: not needed
    unfinished = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nhello \r\n5\r\nagain\r\n"
    for response in (declared, unfinished):
        async with raw_server(answer_each(response)) as server, HttpClient() as client:
            reply = await client.request(b"GET", HOST, server.port, b"/")
            with pytest.raises(BodyTooLarge) as caught:
                await reply.read_body(limit=10)
            assert str(caught.value) == "response body exceeds 10 bytes" and caught.value.limit == 10
            await closed_by_client(server, 1)
    async with raw_server(answer_each(unfinished + b"0\r\n\r\n")) as server, HttpClient() as client:
        reply = await client.request(b"GET", HOST, server.port, b"/")
        assert await reply.read_body(limit=11) == b"hello again"


async def test_a_closed_client_takes_no_requests_and_closes_connections_given_back():
    async with raw_server(answer_each(OK_HELLO)) as server:
        client = HttpClient()
        response = await client.request(b"GET", HOST, server.port, b"/")
        client.close()
        assert await response.read_body() == b"hello"
        await closed_by_client(server, 1)
        with pytest.raises(RuntimeError, match="closed"):
            await client.request(b"GET", HOST, server.port, b"/")


# --- against the simulated node ----------------------------------------------------------------


def node_spec(**behaviour) -> NodeSpec:
    return NodeSpec(name="n1", host="127.0.0.2", models=["m1"], behaviour=Behaviour(**behaviour))


def completion(stream: bool) -> bytes:
    return msgspec.json.encode({"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": stream})


async def post_completion(client: HttpClient, node: SimulatedNode, stream: bool):
    headers = [(b"content-type", b"application/json")]
    target = b"/v1/chat/completions"
    return await client.request(b"POST", node.host, node.vllm_port, target, headers, completion(stream))


def last_request(node: SimulatedNode) -> RecordedRequest:
    return node.requests[-1]


async def test_the_node_streams_server_sent_events_chunk_by_chunk_over_a_kept_alive_connection():
    async with serve_node(node_spec(tokens=4, tpot=0.02)) as node, HttpClient() as client:
        response = await post_completion(client, node, stream=True)
        assert response.status == 200 and response.header(b"content-type") == b"text/event-stream"
        chunks = [chunk async for chunk in response]
        assert len(chunks) >= 4  # one event per token (and [DONE]), as they were sent
        events = b"".join(chunks).split(b"\n\n")
        assert events[-2:] == [b"data: [DONE]", b""]
        assert len(events) == 6
        models = await client.request(b"GET", node.host, node.vllm_port, b"/v1/models")
        assert msgspec.json.decode(await models.read_body())["data"][0]["id"] == "m1"
        assert len(client._pools[(node.host, node.vllm_port)].idle) == 1  # the stream's connection, reused


async def test_a_stream_the_node_cuts_is_a_lost_connection_after_the_first_chunks():
    async with serve_node(node_spec(completion="close_mid_stream", tokens=8)) as node, HttpClient() as client:
        response = await post_completion(client, node, stream=True)
        received = b""
        with pytest.raises(ConnectionLost) as caught:
            async for chunk in response:
                received += chunk
    assert str(caught.value) == "connection closed in the middle of a chunked body"
    assert received.count(b"data: ") == 4 and b"[DONE]" not in received


async def test_a_refusing_node_is_a_connect_failure_and_its_closed_idle_connections_are_not_reused():
    async with serve_node(node_spec()) as node, HttpClient() as client:
        health = await client.request(b"GET", node.host, node.vllm_port, b"/health")
        assert (health.status, await health.read_body()) == (200, b"")
        node.behaviour.refuse = True  # closes the idle keep-alive connection
        with pytest.raises(ConnectFailed, match="connection refused"):
            await client.request(b"GET", node.host, node.vllm_port, b"/health")
        node.behaviour.refuse = False
        health = await client.request(b"GET", node.host, node.vllm_port, b"/health")
        assert health.status == 200


async def test_a_hung_node_is_left_by_cancelling_and_sees_the_client_go():
    async with serve_node(node_spec(health="hang")) as node, HttpClient() as client:
        with trio.move_on_after(0.2) as deadline:
            await client.request(b"GET", node.host, node.vllm_port, b"/health")
        assert deadline.cancelled_caught
        with trio.fail_after(60):
            await last_request(node).ended.wait()
        assert last_request(node).disconnected


async def test_an_oversized_body_from_the_node_is_cut_off_at_the_limit():
    async with serve_node(node_spec(models="oversized")) as node, HttpClient() as client:
        response = await client.request(b"GET", node.host, node.vllm_port, b"/v1/models")
        with pytest.raises(BodyTooLarge, match="response body exceeds 1048576 bytes"):
            await response.read_body(limit=1024 * 1024)
        with trio.fail_after(60):
            await last_request(node).ended.wait()
        assert last_request(node).disconnected


# --- the probes' use of it ---------------------------------------------------------------------


async def test_probe_errors_name_the_url_and_say_what_failed():
    with socket.socket() as unused:
        unused.bind((HOST, 0))
        port = unused.getsockname()[1]
    async with serve_node(node_spec(health="hang", models="oversized")) as node, ProbeClient() as probes:
        with pytest.raises(ProbeError) as refused:
            await drive(probes.get_steps(HOST, port, b"/health", timeout=5))
        with pytest.raises(ProbeError) as hung:
            await drive(probes.get_steps(node.host, node.vllm_port, b"/health", timeout=0.1))
        with pytest.raises(ProbeError) as oversized:
            await drive(probes.get_steps(node.host, node.vllm_port, b"/v1/models", timeout=5))
        answered = await drive(probes.get_steps(node.host, node.metrics_port, b"/health", timeout=5))
    assert str(refused.value) == (
        f'Get "http://127.0.0.1:{port}/health": dial tcp 127.0.0.1:{port}: connect: connection refused'
    )
    assert str(hung.value) == f'Get "http://127.0.0.2:{node.vllm_port}/health": timed out after 0.1s'
    assert str(oversized.value) == "response body exceeds 4194304 bytes"
    assert answered == (200, b"ok")

"""The response parser of transport/http11.py against h11's, on generated responses.

Each example is a response, well-formed or not: interim 1xx heads before the final one, a body
delimited by Content-Length, chunked (extensions, trailers) or the close, HEAD and 204/304,
headers and framing values good and bad, bytes after the end. A raw server sends it to our
client over a real socket, cut at random byte boundaries into pieces our client reads one by
one, then closes; h11 is fed the same pieces and the close. Both must give the same verdict:
the same body, or both refuse the response (a protocol error or an end cut short).

Where we are stricter than h11 on purpose, the example says so and we must refuse it
(EXCLUSIONS, each with its reason); there is no case where we are laxer.
"""

from __future__ import annotations

import itertools

import h11
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transport.http11 import HttpClient, HttpError

from raw_http import HOST, ServerConnection, raw_server

EXCLUSIONS = {
    "bare-lf": "line ends of a bare LF: h11 takes them (RFC 9112 §2.2 lets a recipient); we refuse them at once, "
    "because waiting for a CRLF CRLF that never comes would hold the request until its timeout",
    "obs-fold": "a header line folded onto the next (obs-fold): h11 unfolds it; RFC 9112 §5.2 deprecates it and lets "
    "a recipient refuse it, and a node never sends one",
    "control-byte": "a control byte other than NUL, VT and FF in the head: h11 passes it on; RFC 9110 §5.5 allows "
    "none, and hypercorn cannot send such a header on to the client",
    "version": "an HTTP version other than 1.0 and 1.1: h11 takes any digit.digit; we cannot know how such a "
    "message is framed",
}

TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
VALUE_BYTES = [bytes([b]) for b in range(0x21, 0x7F)] + [b"\x80", b"\xe9", b"\xff", b" ", b"\t"]
CONTROL_BYTES_H11_TAKES = [bytes([b]) for b in (*range(0x01, 0x09), *range(0x0E, 0x20), 0x7F)]
CONTROL_BYTES_H11_REFUSES = [b"\x00", b"\x0b", b"\x0c"]


class Example:
    """A generated response: its bytes, the method it answers, and why we must refuse it when
    h11 would not (a key of EXCLUSIONS), if so."""

    def __init__(self) -> None:
        self.data = b""
        self.excluded: set[str] = set()

    def __repr__(self) -> str:
        return f"Example({self.data!r}, excluded={sorted(self.excluded)})"


def mostly(good: list, bad: list, odds: int = 30) -> st.SearchStrategy:
    """One of `good` (each as likely), and now and then (one time in `odds`) one of `bad`."""
    return st.sampled_from(good * (odds * max(1, len(bad)) // len(good)) + bad)


names = st.one_of(
    st.sampled_from([b"x-a", b"X-Custom", b"server", b"content-type", b"date", b"etag"]),
    st.text(TOKEN_CHARS, min_size=1, max_size=8).map(str.encode),
)
bad_names = st.sampled_from([b"bad name", b"x(a)", b"", b"x\xe9", b"x\x00"])
values = st.lists(st.sampled_from(VALUE_BYTES), max_size=12).map(b"".join)


@st.composite
def header_lines(draw, example: Example) -> list[bytes]:
    """Ordinary header lines (no framing ones), now and then a bad one."""
    lines = []
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(mostly(["good"], ["bad-name", "control", "h11-control", "no-colon", "fold"]))
        name, value = draw(names), draw(values)
        if kind == "bad-name":
            name = draw(bad_names)
        elif kind == "control":
            value += draw(st.sampled_from(CONTROL_BYTES_H11_REFUSES)) + b"x"
        elif kind == "h11-control":
            value += draw(st.sampled_from(CONTROL_BYTES_H11_TAKES)) + b"x"
            example.excluded.add("control-byte")
        if kind == "no-colon":
            lines.append(name + b" " + value)
        else:
            lines.append(name + b":" + draw(st.sampled_from([b"", b" ", b"  \t"])) + value)
        if kind == "fold" and lines:
            lines.append(draw(st.sampled_from([b" ", b"\t"])) + b"folded")
            example.excluded.add("obs-fold")
    return lines


@st.composite
def status_lines(draw, example: Example, status: int) -> bytes:
    version = draw(mostly([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0"], [b"HTTP/2.0", b"HTTP/1.x", b"http/1.1"]))
    if version == b"HTTP/2.0":
        example.excluded.add("version")
    reason = draw(mostly([b" OK", b" Some Reason", b" ", b"", b" caf\xe9"], [b" a\x00b", b" a\x01b"]))
    if reason == b" a\x01b":
        example.excluded.add("control-byte")
    code = draw(mostly([b"%03d" % status], [b"2OO", b"20", b"2000"]))
    return version + b" " + code + reason


@st.composite
def chunked_bodies(draw) -> bytes:
    """A chunked body as sent, now and then with a bad size line or chunk end."""
    sent = b""
    for _ in range(draw(st.integers(0, 3))):
        chunk = draw(st.binary(min_size=1, max_size=20))
        size = draw(st.sampled_from([b"%x", b"%X", b"%04x"])) % len(chunk)
        extension = draw(st.sampled_from([b"", b"", b";a=1", b';name="quoted value"', b";x", b" ", b"\t"]))
        size = draw(mostly([size], [b"zz", b"", b" " + size, b"0x" + size, b"-1", b"1" * 17]))
        sent += size + extension + b"\r\n" + chunk + draw(mostly([b"\r\n"], [b"", b"\n", b"XX"]))
    sent += b"0" + draw(st.sampled_from([b"", b";last=yes"])) + b"\r\n"
    for _ in range(draw(st.integers(0, 2))):
        sent += draw(mostly([b"x-trailer: 1", b"X-Checksum:abc"], [b"bad trailer", b"x-t: a\x00b"], 10)) + b"\r\n"
    sent += b"\r\n"
    return sent


@st.composite
def responses(draw) -> tuple[bytes, Example]:
    """(the request method, the response)."""
    example = Example()
    method = draw(st.sampled_from([b"GET", b"POST", b"HEAD"]))
    heads = []
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
        status = draw(mostly([100, 103, 199], [101, 0, 99], 10))
        heads.append([draw(status_lines(example, status)), *draw(header_lines(example))])
    status = draw(st.sampled_from([200, 200, 201, 204, 299, 304, 404, 500, 599, 999]))
    status_line, headers = draw(status_lines(example, status)), draw(header_lines(example))
    framing = draw(mostly(["length", "chunked", "close"], ["odd-coding", "odd-length"], 5))
    content = draw(st.binary(max_size=40))
    if framing == "length":
        headers.append(b"Content-Length: %d" % draw(mostly([len(content)], [0, len(content) + 3], 10)))
        sent = content
    elif framing == "chunked":
        headers.append(
            b"Transfer-Encoding: " + draw(st.sampled_from([b"chunked", b"chunked", b"Chunked", b" chunked "]))
        )
        if draw(st.booleans()) and draw(st.booleans()):
            headers.append(b"Content-Length: 3")
        sent = draw(chunked_bodies())
    elif framing == "odd-coding":
        codings = [b"gzip, chunked", b"identity", b"chunked, chunked", b"gzip", b"chunked;q=1", b""]
        headers.append(b"Transfer-Encoding: " + draw(st.sampled_from(codings)))
        if draw(st.booleans()):
            headers.append(b"Transfer-Encoding: chunked")
        sent = draw(chunked_bodies())
    elif framing == "odd-length":
        headers.append(
            b"Content-Length: " + draw(st.sampled_from([b"5, 5", b"5, 6", b"+5", b"abc", b"05", b"", b"5 5"]))
        )
        sent = b"hello"
    else:
        sent = content
    if draw(st.booleans()):
        headers.append(draw(st.sampled_from([b"Connection: close", b"Connection: keep-alive", b"connection: x-a"])))
    heads.append([status_line, *draw(st.permutations(headers))])
    line_end = b"\r\n"
    if draw(mostly([False], [True])):
        line_end = b"\n"
        example.excluded.add("bare-lf")
    example.data = b"".join(line_end.join(head) + line_end + line_end for head in heads)
    example.data += sent + draw(mostly([b""], [b"HTTP/1.1 200 OK\r\n\r\n", b"junk"], 10))
    return method, example


@st.composite
def pieces(draw, data: bytes) -> list[bytes]:
    """`data` cut at random byte boundaries."""
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(data) - 1)), max_size=6)))
    bounds = [0, *(cut for cut in cuts if cut < len(data)), len(data)]
    return [data[start:end] for start, end in itertools.pairwise(bounds) if end > start]


def h11_body(method: bytes, parts: list[bytes]) -> bytes | None:
    """The body h11 reads from `parts` and then the close, or None if it refuses the response."""
    connection = h11.Connection(h11.CLIENT)
    headers = [(b"host", b"node")] + ([(b"content-length", b"0")] if method == b"POST" else [])
    connection.send(h11.Request(method=method, target=b"/", headers=headers))
    connection.send(h11.EndOfMessage())
    body = []
    try:
        for part in [*parts, b""]:
            connection.receive_data(part)
            while (event := connection.next_event()) is not h11.NEED_DATA:
                if isinstance(event, h11.Data):
                    body.append(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    return b"".join(body)
                elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                    return None
    except h11.RemoteProtocolError:
        return None
    return None


async def our_body(method: bytes, parts: list[bytes]) -> bytes | None:
    """The body our client reads, over a socket, from a server that sends `parts` one read at
    a time and then closes; None if it refuses the response."""

    async def send_in_pieces(connection: ServerConnection) -> None:
        await connection.request()
        for part in parts:
            await connection.send(part)
            await trio.testing.wait_all_tasks_blocked()  # the client has read it and waits for more
        await connection.close()

    async with raw_server(send_in_pieces) as server, HttpClient() as client:
        with trio.fail_after(60):
            try:
                response = await client.request(method, HOST, server.port, b"/")
                return await response.read_body()
            except HttpError:
                return None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
async def test_our_parser_and_h11_agree_on_what_a_response_is(data):
    method, example = data.draw(responses())
    parts = data.draw(pieces(example.data))
    ours = await our_body(method, parts)
    if example.excluded:
        assert ours is None, f"we must refuse it ({', '.join(EXCLUSIONS[key] for key in example.excluded)})"
    else:
        assert ours == h11_body(method, parts)


@pytest.mark.parametrize(
    ("exclusion", "response"),
    [
        ("bare-lf", b"HTTP/1.1 200 OK\ncontent-length: 2\n\nhi"),
        ("obs-fold", b"HTTP/1.1 200 OK\r\nx-a: 1\r\n folded\r\ncontent-length: 2\r\n\r\nhi"),
        ("control-byte", b"HTTP/1.1 200 OK\r\nx-a: \x01\r\ncontent-length: 2\r\n\r\nhi"),
        ("version", b"HTTP/2.0 200 OK\r\ncontent-length: 2\r\n\r\nhi"),
    ],
)
async def test_each_exclusion_is_a_response_h11_takes_and_we_refuse(exclusion, response):
    assert exclusion in EXCLUSIONS
    assert h11_body(b"GET", [response]) == b"hi"
    assert await our_body(b"GET", [response]) is None

"""A lean HTTP/1.1 client on trio: keep-alive pools per (host, port), a hand-written response
parser, and bodies handed over as raw chunks as they arrive.

It exists for speed. The control plane probes every node every second (3,000 requests/s for a
1,000-node cluster) and the data plane relays every completion; httpx and httpcore spend most
of their time on request and response models, pool bookkeeping, h11's event machinery and
trio's stream layer, none of which these callers need. Here a request is one `send` on the
socket, and a small response one wait for it to be readable, one `recv`, one `bytes.find` and
one `split`. (Measured on a 2-core VM, `GET /health` on a simulated node: a quarter of the
CPU per request of httpcore, a sixth of httpx's.)

    async with HttpClient() as client:
        response = await client.request(b"GET", "10.0.0.1", 8000, b"/health")
        body = await response.read_body(limit=4096)      # or: async for chunk in response
        ...

What it leaves out: TLS, proxies, redirects, cookies, content decoding, pipelining, streamed
request bodies, and timeouts. Callers bound the waits that must end with trio cancel scopes;
only connecting has a deadline of its own (`connect_timeout`), so that a dial failure
(ConnectFailed, nothing sent) can be told apart from a later one.

What it refuses (ProtocolError): a response that is not well-formed HTTP/1.1 (a status outside
100-999, a header name that is not a token, a control byte in the head, line ends of a bare
LF: refused as soon as one arrives), or whose body it cannot frame (a transfer-coding other than
`chunked`, Content-Length values that disagree). tests/test_http11_against_h11.py checks the
parser against h11's, and names where it is stricter.

Connections: a response hands its connection back to its pool once its body has been read to
the end, unless either side said `Connection: close`, the body was delimited by the close, or
bytes came that the framing does not account for (after the body, or a 204 that declares one);
anything else (an error, a cancellation, a body left unread, `close()`) closes it. A pool keeps
at most `max_idle_per_host` idle connections per (host, port), each for at most `idle_seconds`
(checked when one is taken or returned: there is no reaper task). An idle connection the server
closed meanwhile is noticed before reuse (it reads as readable) and dropped. If a request still
fails on a reused connection before any byte of a response, the server most likely closed it
while we were writing: a GET or HEAD without a body is then sent once more on a new connection;
for any other request the error is a WriteFailed, and the caller decides.
"""

from __future__ import annotations

import errno
import math
import os
import re
import socket
from collections.abc import Sequence
from typing import NamedTuple

import trio

from transport.readiness import READ, WRITE, Exchange, Lookup, TimedOut, Wait, drive

RECEIVE_SIZE = 65536
MAX_HEAD_BYTES = 65536
"""Largest response head (status line and headers, or a chunked body's trailers)."""
MAX_CHUNK_LINE_BYTES = 4096
"""Largest chunk-size line, extensions included."""
MAX_IDLE_PER_HOST = 4
IDLE_SECONDS = 90.0

Headers = Sequence[tuple[bytes, bytes]]

# --- errors ------------------------------------------------------------------------------------


class HttpError(Exception):
    """A request that got no (complete) response. The message is written to read well in a log."""


class ConnectFailed(HttpError):
    """No connection could be made (refused, unreachable, unknown host, connect timeout): the
    server cannot have seen the request."""


class ConnectionLost(HttpError):
    """The connection broke after it was made: reset, or closed before the response was complete."""


class WriteFailed(ConnectionLost):
    """The connection broke while the request was written, or a reused keep-alive connection
    turned out closed before any byte of a response (the server closed it while it was idle):
    the server may never have seen the request. (plinth's "write-phase network error".)"""


class LostBeforeResponse(ConnectionLost):
    """The connection broke after the request was written and before any byte of a response
    arrived (the server closed it, reset it, or died): the server may have started on the
    request, or may never have seen it."""


class ProtocolError(HttpError):
    """The server's bytes are not an HTTP/1.1 response this client accepts."""


class BodyTooLarge(HttpError):
    """`read_body(limit)`: the body is larger than the limit (the rest is not read: the
    connection is dropped)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"response body exceeds {limit} bytes")
        self.limit = limit


def _os_error_text(error: BaseException | None) -> str:
    """`connection refused` rather than `[Errno 111] Connection refused`."""
    if isinstance(error, OSError) and error.errno is not None:
        return os.strerror(error.errno).lower()
    return str(error) or type(error).__name__


# --- the client --------------------------------------------------------------------------------


class HttpClient:
    """Keep-alive connection pools, one per (host, port). Not thread-safe; one trio run."""

    def __init__(self, *, max_idle_per_host: int = MAX_IDLE_PER_HOST, idle_seconds: float = IDLE_SECONDS) -> None:
        self.max_idle_per_host = max_idle_per_host
        self.idle_seconds = idle_seconds
        self._pools: dict[tuple[str, int], _Pool] = {}
        self._closed = False

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every idle connection; connections in use close when their response ends."""
        self._closed = True
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            pool.retire()

    def forget(self, host: str) -> None:
        """Close the idle connections to `host` (every port) and forget its pools."""
        for key in [key for key in self._pools if key[0] == host]:
            self._pools.pop(key).retire()

    def prepare(self, method: bytes, host: str, port: int, target: bytes, headers: Headers = ()) -> PreparedRequest:
        """A body-less request built once, to be sent as often as needed with `request_steps`
        (on this client's connections to host:port, until `forget(host)`). Headers as for `request`."""
        if self._closed:
            raise RuntimeError("prepare on a closed HttpClient")
        pool = self._pools.get((host, port))
        if pool is None:
            pool = self._pools[(host, port)] = _Pool(host, port, self.max_idle_per_host, self.idle_seconds)
        try:
            addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
        except socket.gaierror:
            addresses = None  # a host name: looked up on each connect, as `request` does
        return PreparedRequest(pool, method, _request_bytes(method, target, pool.host_header, headers, b""), addresses)

    async def request(
        self,
        method: bytes,
        host: str,
        port: int,
        target: bytes,
        headers: Headers = (),
        body: bytes = b"",
        *,
        connect_timeout: float | None = None,
    ) -> Response:
        """Send a request and return the response once its head has arrived; read its body with
        `read_body`, `next_chunk` or `async for`, and `close()` it if you stop early.

        The client writes the `Host` header and, for a body or a POST, PUT or PATCH,
        `Content-Length`: `headers` must not include those, `Transfer-Encoding` or `Connection`.
        Raises ConnectFailed (also when connecting takes longer than `connect_timeout`
        seconds), WriteFailed, ConnectionLost or ProtocolError.
        """
        if self._closed:
            raise RuntimeError("request on a closed HttpClient")
        pool = self._pools.get((host, port))
        if pool is None:
            pool = self._pools[(host, port)] = _Pool(host, port, self.max_idle_per_host, self.idle_seconds)
        message = _request_bytes(method, target, pool.host_header, headers, body)
        retry_allowed = not body and (method == b"GET" or method == b"HEAD")
        while True:
            connection = pool.take_idle()
            reused = connection is not None
            if connection is None:
                connection = await pool.connect(connect_timeout)
            try:
                return await connection.exchange(message, method, reused)
            except WriteFailed:
                connection.close()
                if reused and retry_allowed:
                    retry_allowed = False  # once, and on a new connection
                    pool.close_idle()  # its siblings were idle as long: likely closed too
                    continue
                raise
            except BaseException:
                connection.close()
                raise


def _request_bytes(method: bytes, target: bytes, host_header: bytes, headers: Headers, body: bytes) -> bytes:
    if b" " in target or b"\r" in target or b"\n" in target:
        raise ValueError(f"bad request target {target[:100]!r}")
    head = b"%s %s HTTP/1.1\r\nhost: %s\r\n" % (method, target, host_header)
    if headers:
        block = b"\r\n".join(map(b": ".join, headers))
        lines = len(headers) - 1
        if block.count(b"\n") != lines or block.count(b"\r") != lines:
            raise ValueError("header names and values must not contain CR or LF")
        head += block + b"\r\n"
    if body or method in _METHODS_WITH_BODY:
        head += b"content-length: %d\r\n" % len(body)
    return head + b"\r\n" + body


_METHODS_WITH_BODY = frozenset((b"POST", b"PUT", b"PATCH"))


class _Pool:
    """The idle connections to one (host, port), most recently used last."""

    __slots__ = ("host", "port", "max_idle", "idle_seconds", "address", "host_header", "idle", "retired")

    def __init__(self, host: str, port: int, max_idle: int, idle_seconds: float) -> None:
        self.host = host
        self.port = port
        self.max_idle = max_idle
        self.idle_seconds = idle_seconds
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        """How errors name the server (Go's `dial tcp 10.0.0.1:8000: …`)."""
        self.host_header = self.address.encode("idna" if not host.isascii() else "ascii")
        self.idle: list[_Connection] = []
        self.retired = False
        """Its client was closed, or forgot the host: connections given back are closed."""

    def take_idle(self) -> _Connection | None:
        """An idle connection still worth using, or None: expired ones and ones the server
        closed (or wrote to) while they were idle are closed on the way."""
        idle = self.idle
        while idle:
            connection = idle.pop()
            if trio.current_time() - connection.idle_since <= self.idle_seconds and not connection.readable():
                return connection
            connection.close()
        return None

    def give_back(self, connection: _Connection) -> None:
        now = trio.current_time()
        idle = self.idle
        while idle and now - idle[0].idle_since > self.idle_seconds:
            idle.pop(0).close()  # the oldest first
        if self.retired or len(idle) >= self.max_idle:
            connection.close()
        else:
            connection.idle_since = now
            idle.append(connection)

    def retire(self) -> None:
        self.retired = True
        self.close_idle()

    def close_idle(self) -> None:
        idle, self.idle = self.idle, []
        for connection in idle:
            connection.close()

    async def connect(self, timeout: float | None) -> _Connection:
        """A new connection (`_connect_steps`, driven in the calling task)."""
        deadline = trio.current_time() + (math.inf if timeout is None else timeout)
        with trio.move_on_at(deadline):  # the host name's lookup too
            try:
                return await drive(_connect_steps(self, None, deadline))
            except TimedOut:
                pass
        raise ConnectFailed(f"dial tcp {self.address}: i/o timeout after {timeout:g}s")


class _Connection:
    """One TCP connection; a response owns it until its body ends.

    Reads and writes go straight to the socket and wait (trio's `wait_readable`, or the
    stream's `send_all` for what the kernel did not take at once) only when it is not ready:
    trio's stream layer costs more than the rest of a small exchange. So `receive` returns
    without a checkpoint when bytes are already waiting.
    """

    __slots__ = ("pool", "stream", "socket", "idle_since")

    def __init__(self, pool: _Pool, stream: trio.SocketStream, sock: socket.socket) -> None:
        self.pool = pool
        self.stream = stream
        self.socket = sock
        """The standard-library socket under `stream` (non-blocking)."""
        self.idle_since = 0.0

    def readable(self) -> bool:
        """An idle connection that is readable has been closed by the server (or has stray bytes)."""
        return self.stream.socket.is_readable()

    def close(self) -> None:
        self.stream.socket.close()

    async def send(self, message: bytes) -> None:
        try:
            sent = self.socket.send(message)
        except BlockingIOError:
            sent = 0
        except OSError as error:
            raise WriteFailed(f"write: {_os_error_text(error)}") from None
        if sent < len(message):
            try:
                await self.stream.send_all(memoryview(message)[sent:])
            except trio.BrokenResourceError as error:
                raise WriteFailed(f"write: {_os_error_text(error.__cause__)}") from None

    async def receive(self, *, wait_first: bool = False) -> bytes:
        """The next bytes from the server; b"" once it has closed the connection. `wait_first`
        skips the first attempt when no bytes can be there yet (right after a request)."""
        if wait_first:
            await trio.lowlevel.wait_readable(self.socket)
        while True:
            try:
                return self.socket.recv(RECEIVE_SIZE)
            except BlockingIOError:
                pass
            except OSError as error:
                raise ConnectionLost(f"read: {_os_error_text(error)}") from None
            await trio.lowlevel.wait_readable(self.socket)

    async def exchange(self, message: bytes, method: bytes, reused: bool) -> Response:
        """Write the request and read the response head (interim 1xx responses skipped)."""
        await self.send(message)
        scanner = _HeadScanner()
        first = True
        while (head := scanner.feed(await self._receive_head_bytes(first=first, reused=reused))) is None:
            first = False
        return Response(self, method, *head)

    async def _receive_head_bytes(self, *, first: bool, reused: bool) -> bytes:
        try:
            data = await self.receive(wait_first=first)
        except ConnectionLost as error:
            raise _head_read_failure(error, first=first, reused=reused) from None
        if data:
            return data
        raise _head_read_failure(None, first=first, reused=reused)


def _head_read_failure(error: ConnectionLost | None, *, first: bool, reused: bool) -> HttpError:
    """What it means that reading a response head failed (`error`) or met the end of the
    connection (None); `first`: before any byte of a response."""
    if first and reused:
        if error is not None:
            return WriteFailed(f"{error} (on a reused keep-alive connection)")
        return WriteFailed("the server closed the keep-alive connection before responding")
    if error is not None:
        return LostBeforeResponse(str(error)) if first else error
    lost = LostBeforeResponse if first else ConnectionLost
    return lost("the server closed the connection before the response head was complete")


class _HeadScanner:
    """Finds the final head in a response's bytes, fed as they arrive (interim 1xx responses
    skipped). Sans-IO: both ways of reading a response, `_Connection.exchange` and
    `_exchange_steps`, feed it."""

    __slots__ = ("_data", "_searched")

    def __init__(self) -> None:
        self._data = b""
        self._searched = 0
        """Where the next search for CRLF CRLF starts: none ends before it."""

    def feed(self, more: bytes) -> tuple[bytes, int, bytes, list[tuple[bytes, bytes]], bytes] | None:
        """The final head once `more` completes it: (version, status, reason, headers, the bytes
        after it); None while more bytes are needed. Raises ProtocolError as soon as the bytes
        cannot be the start of a response this client accepts."""
        data = self._data + more if self._data else more
        searched = self._searched
        while True:
            end = data.find(b"\r\n\r\n", searched)
            if end < 0:
                if len(data) > MAX_HEAD_BYTES:
                    raise ProtocolError(f"response head exceeds {MAX_HEAD_BYTES} bytes")
                if data and data.count(b"\n") != data.count(b"\r\n"):  # at once: no CRLF CRLF will come
                    raise ProtocolError(f"bare LF in the response head {data[:100]!r}")
                self._data, self._searched = data, max(0, len(data) - 3)
                return None
            if end > MAX_HEAD_BYTES:
                raise ProtocolError(f"response head exceeds {MAX_HEAD_BYTES} bytes")
            version, status, reason, headers = parse_head(data[:end])
            if status >= 200:
                return version, status, reason, headers, data[end + 4 :]
            if status == 101:
                raise ProtocolError("unexpected 101 Switching Protocols")
            data, searched = data[end + 4 :], 0  # 100 Continue, 103 Early Hints…


# --- responses ---------------------------------------------------------------------------------

_NONE, _LENGTH, _CHUNKED, _UNTIL_CLOSE = range(4)
"""How a body ends: there is none, after Content-Length bytes, at the last chunk, at EOF."""
_SIZE, _DATA, _DATA_END, _TRAILERS, _END = range(5)
"""Where a chunked decoder is: at a size line, in a chunk's data, at the CRLF after it, in the
trailers, past the end."""
_HEX_DIGITS = b"0123456789abcdefABCDEF"


class Response:
    """A response whose head has arrived. `headers` are (lower-case name, value) pairs in order;
    `content_length` is the declared length of a Content-Length-delimited body, else None;
    `connection_options` the (lower-case) names the Connection header lists: headers about
    this connection only, that a proxy does not pass on (RFC 9110 §7.6.1).

    The body is read once: with `read_body(limit)`, or piece by piece with `next_chunk()` or
    `async for chunk in response`. Pieces are raw bytes as they arrive, chunked framing
    removed. Read to the end, the connection goes back to the pool by itself; `close()` (safe
    to call any time, and again) drops it when the body is left unread. Any error or
    cancellation while reading drops the connection too.
    """

    __slots__ = (
        "status", "reason", "version", "headers", "content_length", "connection_options", "complete",
        "_connection", "_reusable", "_framing", "_buffer", "_position", "_left", "_received", "_chunks",
    )  # fmt: skip

    def __init__(
        self,
        connection: _Connection,
        method: bytes,
        version: bytes,
        status: int,
        reason: bytes,
        headers: list[tuple[bytes, bytes]],
        rest: bytes,
    ) -> None:
        self.version = version
        self.status = status
        self.reason = reason
        self.headers = headers
        self.complete = False
        """The body has been read to its end."""
        self._connection: _Connection | None = connection
        self._position = 0
        self._received = 0
        self._framing, self.content_length, self._reusable, self.connection_options = _framing(
            method, version, status, headers
        )
        if self._framing == _CHUNKED:
            self._chunks: _ChunkDecoder | None = _ChunkDecoder(rest)
            self._buffer = b""
        else:
            self._chunks = None
            self._buffer = rest
        self._left = self.content_length or 0
        if self._framing == _NONE or (self._framing == _LENGTH and self._left == 0):
            self._end()

    def header(self, name: bytes) -> bytes | None:
        """The first value of header `name` (lower-case), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def close(self) -> None:
        """Drop the connection unless the body was read to the end (then it is back in its pool)."""
        connection = self._connection
        if connection is not None:
            self._connection = None
            connection.close()

    def __aiter__(self) -> Response:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self.next_chunk()
        if not chunk:
            raise StopAsyncIteration
        return chunk

    async def read_body(self, limit: int | None = None) -> bytes:
        """The whole body. Raises BodyTooLarge, without reading further, as soon as the body
        (or its declared Content-Length) is larger than `limit` bytes."""
        if limit is not None and self.content_length is not None and self.content_length > limit:
            self.close()
            raise BodyTooLarge(limit)
        pieces = []
        size = 0
        while chunk := await self.next_chunk():
            size += len(chunk)
            if limit is not None and size > limit:
                self.close()
                raise BodyTooLarge(limit)
            pieces.append(chunk)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    async def next_chunk(self) -> bytes:
        """The next piece of the body, as it arrives; b"" once the body is complete."""
        if self._connection is None:
            if not self.complete:
                raise trio.ClosedResourceError("the response was closed before its body was read")
            return b""
        try:
            if self._framing == _CHUNKED:
                return await self._next_chunked()
            if self._framing == _LENGTH:
                return await self._next_sized()
            return await self._next_until_close()
        except BaseException:
            self.close()
            raise

    async def _more(self) -> bytes:
        """The buffered bytes not yet consumed, else the next bytes from the socket."""
        if self._position < len(self._buffer):
            data = self._buffer[self._position :] if self._position else self._buffer
        else:
            data = await self._connection.receive()
        self._buffer, self._position = b"", 0
        return data

    async def _next_sized(self) -> bytes:
        data = await self._more()
        if not data:
            raise ConnectionLost(f"connection closed after {self._received} of {self.content_length} body bytes")
        if len(data) > self._left:
            data = data[: self._left]
            self._reusable = False  # bytes beyond the body: this connection is out of step
        self._received += len(data)
        self._left -= len(data)
        if not self._left:
            self._end()
        return data

    async def _next_until_close(self) -> bytes:
        data = await self._more()
        if not data:
            self._end()
        return data

    async def _next_chunked(self) -> bytes:
        chunks = self._chunks
        while True:
            data = chunks.decode()
            if chunks.state == _END:
                if chunks.position < len(chunks.buffer):
                    self._reusable = False  # bytes after the last chunk
                self._end()
                return data
            if data:
                return data
            more = await self._connection.receive()
            if not more:
                raise ConnectionLost("connection closed in the middle of a chunked body")
            chunks.feed(more)

    def _end(self) -> None:
        """The body is complete: the connection goes back to its pool, or is closed."""
        connection, self._connection = self._connection, None
        self.complete = True
        if self._reusable and self._position >= len(self._buffer):
            connection.pool.give_back(connection)
        else:
            connection.close()


class _ChunkDecoder:
    """A chunked body's bytes, fed as they arrive, decoded into its data (RFC 9112 §7.1); the
    trailers are checked, then dropped. Sans-IO: both ways of reading a body, `Response` and
    `_chunked_body_steps`, feed it."""

    __slots__ = ("buffer", "position", "state", "left", "trailer_bytes", "limit", "declared")

    def __init__(self, data: bytes, limit: int | None = None) -> None:
        self.buffer = data
        self.position = 0
        """Where the bytes not decoded yet start in `buffer` (once `state` is _END: the bytes after the body)."""
        self.state = _SIZE
        self.left = 0
        """The bytes of the current chunk's data not decoded yet."""
        self.trailer_bytes = 0
        self.limit = limit
        """A size line that takes the body past it is refused (BodyTooLarge); None: no limit."""
        self.declared = 0
        """The sizes of the chunks read so far, added up (only with a limit)."""

    def feed(self, more: bytes) -> None:
        rest = self.buffer[self.position :]
        self.buffer, self.position = (rest + more if rest else more), 0

    def decode(self) -> bytes:
        """Decode what the buffer holds; the data found (b"" if none: more bytes are needed,
        unless `state` is _END)."""
        buffer, position, end = self.buffer, self.position, len(self.buffer)
        pieces = []
        state = self.state
        while position < end:
            if state == _DATA:
                taken = min(self.left, end - position)
                pieces.append(buffer[position : position + taken])
                position += taken
                self.left -= taken
                if not self.left:
                    state = _DATA_END
            elif state == _DATA_END:
                if end - position < 2:
                    break
                if not buffer.startswith(b"\r\n", position):
                    raise ProtocolError("chunk data not followed by CRLF")
                position += 2
                state = _SIZE
            elif state == _SIZE:
                line_end = buffer.find(b"\r\n", position, position + MAX_CHUNK_LINE_BYTES)
                if line_end < 0:
                    if end - position >= MAX_CHUNK_LINE_BYTES:
                        raise ProtocolError(f"chunk size line exceeds {MAX_CHUNK_LINE_BYTES} bytes")
                    break
                self.left = _chunk_size(buffer[position:line_end])
                if self.limit is not None:
                    self.declared += self.left
                    if self.declared > self.limit:
                        raise BodyTooLarge(self.limit)
                position = line_end + 2
                state = _DATA if self.left else _TRAILERS
            elif state == _TRAILERS:
                line_end = buffer.find(b"\r\n", position)
                if line_end < 0:
                    if self.trailer_bytes + end - position > MAX_HEAD_BYTES:
                        raise ProtocolError(f"chunked trailers exceed {MAX_HEAD_BYTES} bytes")
                    break
                self.trailer_bytes += line_end + 2 - position
                if self.trailer_bytes > MAX_HEAD_BYTES:
                    raise ProtocolError(f"chunked trailers exceed {MAX_HEAD_BYTES} bytes")
                if line_end == position:
                    position += 2
                    state = _END
                    break
                trailer = buffer[position:line_end]
                if _CONTROL_BYTE.search(trailer):
                    raise ProtocolError(f"control byte in the chunked trailers {trailer[:100]!r}")
                _field_line(trailer)  # checked, then dropped
                position = line_end + 2
            else:
                break
        self.buffer, self.position, self.state = buffer, position, state
        if len(pieces) == 1:
            return pieces[0]
        return b"".join(pieces)


def _framing(
    method: bytes, version: bytes, status: int, headers: list[tuple[bytes, bytes]]
) -> tuple[int, int | None, bool, tuple[bytes, ...]]:
    """How a response's body ends (RFC 9112 §6.3), its declared length if Content-Length
    delimits it, whether its connection can carry another response, and its connection options."""
    reusable = version == b"HTTP/1.1"
    lengths: list[bytes] = []
    codings: list[bytes] = []
    options: tuple[bytes, ...] = ()
    for name, value in headers:
        if name == b"content-length":
            lengths.append(value)
        elif name == b"transfer-encoding":
            codings.append(value)
        elif name == b"connection":
            tokens = tuple(token.strip().lower() for token in value.split(b","))
            options += tokens
            if b"close" in tokens:
                reusable = False
            elif b"keep-alive" in tokens and version == b"HTTP/1.0":
                reusable = True
    if codings and (len(codings) > 1 or codings[0].lower() != b"chunked"):
        # Any other coding would reach the caller still encoded.
        raise ProtocolError(f"unsupported Transfer-Encoding {b', '.join(codings)[:100]!r} (only chunked is)")
    length = _content_length(lengths) if lengths else None
    if method == b"HEAD" or status == 304:
        return _NONE, None, reusable, options
    if status == 204:
        # It has no body; one that declares one may send it anyway, and its bytes would be read
        # as the next response on this connection.
        return _NONE, None, reusable and not codings and not length, options
    if codings:
        # Transfer-Encoding overrides Content-Length; a message with both is one a request
        # smuggler could have built: its connection is not reused.
        return _CHUNKED, None, reusable and length is None, options
    if length is not None:
        return _LENGTH, length, reusable, options
    return _UNTIL_CLOSE, None, False, options


def _content_length(values: list[bytes]) -> int:
    """The length Content-Length headers declare: repeated or listed values must agree (RFC 9110 §8.6)."""
    if len(values) == 1 and values[0].isdigit():
        return int(values[0])
    distinct = {part.strip() for value in values for part in value.split(b",")}
    length = distinct.pop()
    if distinct or not length.isdigit():
        raise ProtocolError(f"bad Content-Length {b', '.join(values)[:100]!r}")
    return int(length)


def _chunk_size(line: bytes) -> int:
    size, semicolon, extensions = line.partition(b";")  # extensions are ignored
    if not semicolon:
        size = size.rstrip(b" \t")
    elif extensions.find(b"\n") >= 0 or extensions.find(b"\r") >= 0:
        raise ProtocolError(f"bare CR or LF in chunk size line {line[:100]!r}")
    if not size or len(size) > 16 or size.strip(_HEX_DIGITS):
        raise ProtocolError(f"bad chunk size line {line[:100]!r}")
    return int(size, 16)


_TOKEN_BYTES = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_CONTROL_BYTE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
"""What no status or field line may hold (RFC 9110 §5.5): a control byte other than HTAB."""
_CONTROL_BYTE_IN_HEAD = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
"""The same, in a head whose CR LF line ends are checked apart."""


def parse_head(head: bytes) -> tuple[bytes, int, bytes, list[tuple[bytes, bytes]]]:
    """(version, status, reason, headers) of a response head without its final CRLF CRLF;
    header names lower-cased, values stripped. Raises ProtocolError."""
    lines = head.split(b"\r\n")
    if head.count(b"\n") != len(lines) - 1 or head.count(b"\r") != len(lines) - 1:
        raise ProtocolError("bare CR or LF in the response head")
    control = _CONTROL_BYTE_IN_HEAD.search(head)
    if control:
        raise ProtocolError(f"control byte {control.group()!r} in the response head {head[:100]!r}")
    status_line = lines[0]
    version, _, rest = status_line.partition(b" ")
    code, _, reason = rest.partition(b" ")
    if (version != b"HTTP/1.1" and version != b"HTTP/1.0") or len(code) != 3 or not code.isdigit() or code < b"100":
        raise ProtocolError(f"malformed status line {status_line[:100]!r}")
    return version, int(code), reason, [_field_line(line) for line in lines[1:]]


def _field_line(line: bytes) -> tuple[bytes, bytes]:
    """(lower-case name, stripped value) of a header or trailer line whose bytes are checked
    already. Raises ProtocolError."""
    name, colon, value = line.partition(b":")
    if not colon or not name or name.translate(None, _TOKEN_BYTES):
        raise ProtocolError(f"malformed header line {line[:100]!r}")
    return name.lower(), value.strip(b" \t")


# --- prepared requests as non-blocking steps (`transport.readiness`) ----------------------------


class PreparedRequest(NamedTuple):
    """A body-less request built by `HttpClient.prepare`: its pool, method and bytes, and the
    address to connect to when the host is an IP address (None: a host name, looked up)."""

    pool: _Pool
    method: bytes
    message: bytes
    addresses: list | None


def request_steps(request: PreparedRequest, deadline: float, limit: int | None = None) -> Exchange:
    """`request` as an exchange for `transport.readiness`: returns (status, whole body), as
    `HttpClient.request` and then `read_body(limit)` would, with the same errors, the same single
    retry of a GET or HEAD on a reused connection the server had closed, and the connection back
    in its pool once the body has been read. Every wait ends at `deadline` (TimedOut)."""
    pool = request.pool
    retry_allowed = request.method == b"GET" or request.method == b"HEAD"
    while True:
        connection = pool.take_idle()
        reused = connection is not None
        if connection is None:
            connection = yield from _connect_steps(pool, request.addresses, deadline)
        try:
            return (yield from _exchange_steps(connection, request, reused, deadline, limit))
        except WriteFailed:
            connection.close()
            if reused and retry_allowed:
                retry_allowed = False  # once, and on a new connection
                pool.close_idle()
                continue
            raise
        except BaseException:
            connection.close()
            raise


def _connect_steps(pool: _Pool, addresses: list | None, deadline: float) -> Exchange:
    """A new connection of `pool`, to the first of the host's addresses that accepts one (the
    host is looked up unless `addresses` are given)."""
    if addresses is None:
        try:
            addresses = yield Lookup(pool.host, pool.port)
        except OSError as error:
            raise ConnectFailed(f"dial tcp {pool.address}: lookup {pool.host}: {error.strerror or error}") from None
    failure: OSError | None = None
    for family, kind, protocol, _, address in addresses:
        try:
            raw = socket.socket(family, kind, protocol)
        except OSError as error:  # out of file descriptors, say
            failure = error
            continue
        try:
            raw.setblocking(False)
            code = raw.connect_ex(address)
            if code == errno.EINPROGRESS:
                yield Wait(raw, WRITE, deadline)
                code = raw.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        except BaseException:
            raw.close()
            raise
        if code:
            raw.close()
            failure = OSError(code, os.strerror(code))
            continue
        return _Connection(pool, trio.SocketStream(trio.socket.from_stdlib_socket(raw)), raw)
    raise ConnectFailed(f"dial tcp {pool.address}: connect: {_os_error_text(failure)}")


def _exchange_steps(
    connection: _Connection, request: PreparedRequest, reused: bool, deadline: float, limit: int | None
) -> Exchange:
    """`_Connection.exchange` and `Response.read_body` as steps."""
    yield from _send_steps(connection, request.message, deadline)
    scanner = _HeadScanner()
    first = True
    while (head := scanner.feed((yield from _head_bytes_steps(connection, first, reused, deadline)))) is None:
        first = False
    version, status, _, headers, rest = head
    framing, length, reusable, _ = _framing(request.method, version, status, headers)
    if framing == _NONE:
        body = b""
    elif framing == _LENGTH:
        body, rest = yield from _sized_body_steps(connection, rest, length, deadline, limit)
    elif framing == _CHUNKED:
        body, rest = yield from _chunked_body_steps(connection, rest, deadline, limit)
    else:
        body, rest, reusable = (yield from _body_until_close_steps(connection, rest, deadline, limit)), b"", False
    if reusable and not rest:
        connection.pool.give_back(connection)
    else:
        connection.close()
    return status, body


def _send_steps(connection: _Connection, message: bytes, deadline: float) -> Exchange:
    view = memoryview(message)
    while True:
        try:
            sent = connection.socket.send(view)
        except BlockingIOError:
            sent = 0
        except OSError as error:
            raise WriteFailed(f"write: {_os_error_text(error)}") from None
        if sent == len(view):
            return
        view = view[sent:]
        yield Wait(connection.socket, WRITE, deadline)


def _receive_steps(connection: _Connection, deadline: float, *, wait_first: bool = False) -> Exchange:
    """The next bytes from the server; b"" once it has closed the connection."""
    if wait_first:
        yield Wait(connection.socket, READ, deadline)
    while True:
        try:
            return connection.socket.recv(RECEIVE_SIZE)
        except BlockingIOError:
            pass
        except OSError as error:
            raise ConnectionLost(f"read: {_os_error_text(error)}") from None
        yield Wait(connection.socket, READ, deadline)


def _head_bytes_steps(connection: _Connection, first: bool, reused: bool, deadline: float) -> Exchange:
    """`_Connection._receive_head_bytes` as steps."""
    try:
        data = yield from _receive_steps(connection, deadline, wait_first=first)
    except ConnectionLost as error:
        raise _head_read_failure(error, first=first, reused=reused) from None
    if data:
        return data
    raise _head_read_failure(None, first=first, reused=reused)


def _sized_body_steps(
    connection: _Connection, data: bytes, length: int, deadline: float, limit: int | None
) -> Exchange:
    """(body, bytes after it) of a Content-Length body."""
    if limit is not None and length > limit:
        raise BodyTooLarge(limit)
    pieces, received = [data], len(data)
    while received < length:
        more = yield from _receive_steps(connection, deadline)
        if not more:
            raise ConnectionLost(f"connection closed after {received} of {length} body bytes")
        pieces.append(more)
        received += len(more)
    data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
    return data[:length], data[length:]


def _chunked_body_steps(connection: _Connection, data: bytes, deadline: float, limit: int | None) -> Exchange:
    """(body, bytes after it) of a chunked body; a chunk that would take the body past `limit`
    is refused as soon as its size line is read."""
    chunks = _ChunkDecoder(data, limit)
    pieces = []
    while True:
        pieces.append(chunks.decode())
        if chunks.state == _END:
            return b"".join(pieces), chunks.buffer[chunks.position :]
        more = yield from _receive_steps(connection, deadline)
        if not more:
            raise ConnectionLost("connection closed in the middle of a chunked body")
        chunks.feed(more)


def _body_until_close_steps(connection: _Connection, data: bytes, deadline: float, limit: int | None) -> Exchange:
    pieces, size = [data], len(data)
    while True:
        if limit is not None and size > limit:
            raise BodyTooLarge(limit)
        more = yield from _receive_steps(connection, deadline)
        if not more:
            return b"".join(pieces)
        pieces.append(more)
        size += len(more)

"""The async HTTP/1.1 client on trio sockets that the proxy uses: keep-alive pools per
(host, port), and bodies handed over as raw chunks as they arrive.

It exists for speed: httpx and httpcore spend most of their time on request and response
models, pool bookkeeping, h11's event machinery and trio's stream layer, none of which these
callers need. Here a request is one `send` on the socket, and a small response one wait for it
to be readable, one `recv`, one `bytes.find` and one `split`. The bytes are read by the
sans-IO parser (`transport/parser.py`), the connections kept in `transport/connections.py`;
the probes send the same requests as steps (`transport/steps.py`).

    async with HttpClient() as client:
        response = await client.request(b"GET", "10.0.0.1", 8000, b"/health")
        body = await response.read_body(limit=4096)      # or: async for chunk in response
        ...

HTTPS: a request given an `ssl.SSLContext` (`tls`) goes over TLS, to the pool of TLS
connections made with that context (a new context, after a reload, starts a new pool).

What it leaves out: proxies, redirects, cookies, content decoding, pipelining, streamed
request bodies, and timeouts. Callers bound the waits that must end with trio cancel scopes;
only connecting has a deadline of its own (`connect_timeout`), so that a dial failure
(ConnectFailed, nothing sent) can be told apart from a later one.

Connections: a response hands its connection back to its pool once its body has been read to
the end, unless either side said `Connection: close`, the body was delimited by the close, or
bytes came that the framing does not account for (after the body, or a 204 that declares one);
anything else (an error, a cancellation, a body left unread, `close()`) closes it. If a request
still fails on a reused connection before any byte of a response, the server most likely
closed it while we were writing: a GET or HEAD without a body is then sent once more on a new
connection; for any other request the error is a WriteFailed, and the caller decides.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Sequence

import trio

from transport.connections import Connection, Pool
from transport.errors import (
    BodyTooLarge,
    ConnectFailed,
    ConnectionLost,
    HttpError,
    LostBeforeResponse,
    ProtocolError,
    WriteFailed,
)
from transport.parser import MAX_HEAD_BYTES, BodyReader, Framing, framing
from transport.steps import PreparedRequest

__all__ = [
    "MAX_HEAD_BYTES",
    "BodyTooLarge",
    "ConnectFailed",
    "ConnectionLost",
    "HttpClient",
    "HttpError",
    "LostBeforeResponse",
    "PreparedRequest",
    "ProtocolError",
    "Response",
    "WriteFailed",
]

MAX_IDLE_PER_HOST = 4
IDLE_SECONDS = 90.0

Headers = Sequence[tuple[bytes, bytes]]


class HttpClient:
    """Keep-alive connection pools, one per (host, port). Not thread-safe; one trio run."""

    def __init__(self, *, max_idle_per_host: int = MAX_IDLE_PER_HOST, idle_seconds: float = IDLE_SECONDS) -> None:
        self.max_idle_per_host = max_idle_per_host
        self.idle_seconds = idle_seconds
        self._pools: dict[tuple[str, int], Pool] = {}
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

    def _pool(self, host: str, port: int, tls: ssl.SSLContext | None) -> Pool:
        """The pool of host:port's connections made with `tls` (replacing one made with another)."""
        pool = self._pools.get((host, port))
        if pool is None or pool.tls is not tls:
            if pool is not None:
                pool.retire()
            pool = self._pools[(host, port)] = Pool(host, port, self.max_idle_per_host, self.idle_seconds, tls)
        return pool

    def prepare(
        self,
        method: bytes,
        host: str,
        port: int,
        target: bytes,
        headers: Headers = (),
        *,
        tls: ssl.SSLContext | None = None,
    ) -> PreparedRequest:
        """A body-less request built once, to be sent as often as needed with `request_steps`
        (on this client's connections to host:port, until `forget(host)` or a request to it with
        another `tls`). Headers and `tls` as for `request`."""
        if self._closed:
            raise RuntimeError("prepare on a closed HttpClient")
        pool = self._pool(host, port, tls)
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
        tls: ssl.SSLContext | None = None,
    ) -> Response:
        """Send a request and return the response once its head has arrived; read its body with
        `read_body`, `next_chunk` or `async for`, and `close()` it if you stop early.

        The client writes the `Host` header and, for a body or a POST, PUT or PATCH,
        `Content-Length`: `headers` must not include those, `Transfer-Encoding` or `Connection`.
        `tls`: HTTPS, with connections made with this context (None: plain HTTP).
        Raises ConnectFailed (also when connecting takes longer than `connect_timeout`
        seconds), WriteFailed, ConnectionLost or ProtocolError.
        """
        if self._closed:
            raise RuntimeError("request on a closed HttpClient")
        pool = self._pools.get((host, port))
        if pool is None or pool.tls is not tls:
            pool = self._pool(host, port, tls)
        message = _request_bytes(method, target, pool.host_header, headers, body)
        retry_allowed = not body and (method == b"GET" or method == b"HEAD")
        while True:
            connection = pool.take_idle()
            reused = connection is not None
            if connection is None:
                connection = await pool.connect(connect_timeout)
            try:
                (version, status, reason, response_headers), rest = await connection.exchange(message, reused)
                response_framing = framing(method, version, status, response_headers)
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
            return Response(connection, version, status, reason, response_headers, response_framing, rest)


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
        "_connection", "_reusable", "_body",
    )  # fmt: skip

    def __init__(
        self,
        connection: Connection,
        version: bytes,
        status: int,
        reason: bytes,
        headers: list[tuple[bytes, bytes]],
        response_framing: Framing,
        rest: bytes,
    ) -> None:
        """`rest`: the bytes that came after the head."""
        self.version = version
        self.status = status
        self.reason = reason
        self.headers = headers
        self.content_length = response_framing.length
        self.connection_options = response_framing.options
        self.complete = False
        """The body has been read to its end."""
        self._connection: Connection | None = connection
        self._reusable = response_framing.reusable
        self._body = BodyReader(response_framing, rest)
        if self._body.done:
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
        (or its declared length) is larger than `limit` bytes."""
        if limit is not None:
            try:
                self._body.limit(limit)
            except BodyTooLarge:
                self.close()
                raise
        pieces = []
        while chunk := await self.next_chunk():
            pieces.append(chunk)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    async def next_chunk(self) -> bytes:
        """The next piece of the body, as it arrives; b"" once the body is complete."""
        connection = self._connection
        if connection is None:
            if not self.complete:
                raise trio.ClosedResourceError("the response was closed before its body was read")
            return b""
        body = self._body
        try:
            while True:
                data = body.read()
                if body.done:
                    self._end()
                    return data
                if data:
                    return data
                body.feed(await connection.receive())
        except BaseException:
            self.close()
            raise

    def _end(self) -> None:
        """The body is complete: the connection goes back to its pool, or is closed."""
        connection, self._connection = self._connection, None
        self.complete = True
        if self._reusable and not self._body.stray:
            connection.pool.give_back(connection)
        else:
            connection.close()

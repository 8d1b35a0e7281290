"""Keep-alive connections and their pools, shared by the async client (`transport/http11.py`)
and the probes' steps (`transport/steps.py`).

A connection's socket work is written once, as calls that never block (`send_now`,
`receive_now`); the async client waits between them with trio, the steps by yielding a
`transport.readiness.Wait`. Connecting is written once, as steps (`connect_steps`), which the
async client drives in its own task.

A pool whose `tls` is an SSLContext makes TLS connections (`TlsConnection`): the handshake is
one more step of connecting, and the TLS socket is driven through the same non-blocking calls.
A plain pool's connections never meet the TLS code.

A pool keeps at most `max_idle` idle connections, each for at most `idle_seconds` (checked when
one is taken or given back: there is no reaper task). An idle connection the server closed
meanwhile is noticed before reuse (it reads as readable) and dropped.
"""

from __future__ import annotations

import errno
import math
import os
import select
import socket
import ssl

import trio

from transport.errors import ConnectFailed, ConnectionLost, HttpError, LostBeforeResponse, WriteFailed, os_error_text
from transport.parser import Head, HeadScanner
from transport.readiness import READ, WRITE, Lookup, Steps, TimedOut, Wait, drive

RECEIVE_SIZE = 65536


class Pool:
    """The idle connections to one (host, port), most recently used last."""

    __slots__ = ("host", "port", "tls", "max_idle", "idle_seconds", "address", "host_header", "idle", "retired")

    def __init__(
        self, host: str, port: int, max_idle: int, idle_seconds: float, tls: ssl.SSLContext | None = None
    ) -> None:
        self.host = host
        self.port = port
        self.tls = tls
        """None: plain HTTP; else HTTPS, the server's certificate checked against `host`."""
        self.max_idle = max_idle
        self.idle_seconds = idle_seconds
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        """How errors name the server (Go's `dial tcp 10.0.0.1:8000: …`)."""
        self.host_header = self.address.encode("idna" if not host.isascii() else "ascii")
        self.idle: list[Connection] = []
        self.retired = False
        """Its client was closed, or forgot the host: connections given back are closed."""

    def take_idle(self) -> Connection | None:
        """An idle connection still worth using, or None: expired ones and ones the server
        closed (or wrote to) while they were idle are closed on the way."""
        idle = self.idle
        while idle:
            connection = idle.pop()
            if trio.current_time() - connection.idle_since <= self.idle_seconds and not connection.readable():
                return connection
            connection.close()
        return None

    def give_back(self, connection: Connection) -> None:
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

    async def connect(self, timeout: float | None) -> Connection:
        """A new connection (`connect_steps`, driven in the calling task)."""
        deadline = trio.current_time() + (math.inf if timeout is None else timeout)
        with trio.move_on_at(deadline):  # the host name's lookup too
            try:
                return await drive(connect_steps(self, None, deadline))
            except TimedOut:
                pass
        raise ConnectFailed(f"dial tcp {self.address}: i/o timeout after {timeout:g}s")


def connect_steps(pool: Pool, addresses: list | None, deadline: float) -> Steps:
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
            if not code and family != socket.AF_UNIX:
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            raw.close()
            raise
        if code:
            raw.close()
            failure = OSError(code, os.strerror(code))
            continue
        if pool.tls is not None:
            return (yield from _handshake_steps(pool, pool.tls, raw, deadline))
        return Connection(pool, raw)
    raise ConnectFailed(f"dial tcp {pool.address}: connect: {os_error_text(failure)}")


def _handshake_steps(pool: Pool, context: ssl.SSLContext, raw: socket.socket, deadline: float) -> Steps:
    """The TLS handshake on the connected socket `raw`; a TlsConnection. A failed handshake is a
    ConnectFailed (no request byte was sent) naming what TLS refused."""
    try:
        sock = context.wrap_socket(raw, server_hostname=pool.host, do_handshake_on_connect=False)
    except BaseException:
        raw.close()
        raise
    try:
        while True:
            try:
                sock.do_handshake()
                break
            except ssl.SSLWantReadError:
                yield Wait(sock, READ, deadline)
            except ssl.SSLWantWriteError:
                yield Wait(sock, WRITE, deadline)
    except ssl.SSLCertVerificationError as error:
        sock.close()
        reason = f"certificate verify failed: {error.verify_message}"
        raise ConnectFailed(f"dial tcp {pool.address}: tls: {reason}") from None
    except (ssl.SSLError, OSError) as error:
        sock.close()
        reason = getattr(error, "reason", None) or os_error_text(error)
        raise ConnectFailed(f"dial tcp {pool.address}: tls handshake: {reason}") from None
    except BaseException:
        sock.close()
        raise
    return TlsConnection(pool, sock)


class Connection:
    """One TCP connection; a response owns it until its body ends.

    Reads and writes go straight to the (non-blocking) socket and wait only when it is not
    ready: trio's stream layer costs more than the rest of a small exchange. So `receive`
    returns without a checkpoint when bytes are already waiting.
    """

    __slots__ = ("pool", "socket", "_trio_socket", "idle_since")

    def __init__(self, pool: Pool, sock: socket.socket) -> None:
        self.pool = pool
        self.socket = sock
        self._trio_socket = self._closed_through_trio(sock)
        """The same socket, closed through trio so that a task waiting on it is woken."""
        self.idle_since = 0.0

    @staticmethod
    def _closed_through_trio(sock: socket.socket) -> trio.socket.SocketType:
        return trio.socket.from_stdlib_socket(sock)

    def readable(self) -> bool:
        """An idle connection that is readable has been closed by the server (or has stray bytes)."""
        return self._trio_socket.is_readable()

    def close(self) -> None:
        self._trio_socket.close()

    # The socket work, once: neither call blocks.

    def send_now(self, data: bytes | memoryview) -> int:
        """Write what the kernel takes of `data` at once; how many bytes it took."""
        try:
            return self.socket.send(data)
        except BlockingIOError:
            return 0
        except OSError as error:
            raise WriteFailed(f"write: {os_error_text(error)}") from None

    def receive_now(self) -> bytes | None:
        """The bytes waiting (b"" once the server has closed the connection); None if none yet."""
        try:
            return self.socket.recv(RECEIVE_SIZE)
        except BlockingIOError:
            return None
        except OSError as error:
            raise ConnectionLost(f"read: {os_error_text(error)}") from None

    # Waiting for it in a trio task…

    async def send(self, message: bytes) -> None:
        sent = self.send_now(message)
        if sent < len(message):
            view = memoryview(message)[sent:]
            while view:
                await trio.lowlevel.wait_writable(self.socket)
                view = view[self.send_now(view) :]

    async def receive(self, *, wait_first: bool = False) -> bytes:
        """The next bytes from the server; b"" once it has closed the connection. `wait_first`
        skips the first attempt when no bytes can be there yet (right after a request)."""
        if wait_first:
            await trio.lowlevel.wait_readable(self.socket)
        while (data := self.receive_now()) is None:
            await trio.lowlevel.wait_readable(self.socket)
        return data

    async def exchange(self, message: bytes, reused: bool) -> tuple[Head, bytes]:
        """Write the request and read the response's final head; the head and the bytes after it."""
        await self.send(message)
        scanner = HeadScanner()
        first = True
        while True:
            try:
                data = await self.receive(wait_first=first)
            except ConnectionLost as error:
                raise _head_read_failure(error, first=first, reused=reused) from None
            if (found := _scan(scanner, data, first, reused)) is not None:
                return found
            first = False

    # …or as steps (`transport.readiness`), until `deadline`.

    def send_steps(self, message: bytes, deadline: float) -> Steps:
        view = memoryview(message)
        while view := view[self.send_now(view) :]:
            yield Wait(self.socket, WRITE, deadline)

    def receive_steps(self, deadline: float, *, wait_first: bool = False) -> Steps:
        """`receive` as steps."""
        if wait_first:
            yield Wait(self.socket, READ, deadline)
        while (data := self.receive_now()) is None:
            yield Wait(self.socket, READ, deadline)
        return data

    def exchange_steps(self, message: bytes, reused: bool, deadline: float) -> Steps:
        """`exchange` as steps."""
        yield from self.send_steps(message, deadline)
        scanner = HeadScanner()
        first = True
        while True:
            try:
                data = yield from self.receive_steps(deadline, wait_first=first)
            except ConnectionLost as error:
                raise _head_read_failure(error, first=first, reused=reused) from None
            if (found := _scan(scanner, data, first, reused)) is not None:
                return found
            first = False


class TlsConnection(Connection):
    """A connection over TLS (`ssl.SSLSocket`, non-blocking): the same socket work, where the
    socket not being ready shows as SSLWantReadError or SSLWantWriteError. Bytes TLS already
    decrypted are read before waiting (`receive` tries first, except right after a request)."""

    __slots__ = ()

    @staticmethod
    def _closed_through_trio(sock: socket.socket) -> trio.socket.SocketType:
        return _TlsSocketCloser(sock)  # type: ignore[return-value]

    def send_now(self, data: bytes | memoryview) -> int:
        try:
            return self.socket.send(data)
        except (ssl.SSLWantWriteError, ssl.SSLWantReadError, BlockingIOError):
            return 0
        except OSError as error:
            raise WriteFailed(f"write: {_tls_error_text(error)}") from None

    def receive_now(self) -> bytes | None:
        try:
            return self.socket.recv(RECEIVE_SIZE)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
            return None
        except OSError as error:
            raise ConnectionLost(f"read: {_tls_error_text(error)}") from None


class _TlsSocketCloser:
    """What a Connection needs of a trio socket, for an SSLSocket (which trio does not wrap)."""

    __slots__ = ("_socket",)

    def __init__(self, sock: ssl.SSLSocket) -> None:
        self._socket = sock

    def is_readable(self) -> bool:
        sock = self._socket
        return sock.fileno() >= 0 and (sock.pending() > 0 or bool(select.select([sock], [], [], 0)[0]))

    def close(self) -> None:
        sock = self._socket
        if sock.fileno() >= 0:
            trio.lowlevel.notify_closing(sock)
        sock.close()


def _tls_error_text(error: OSError) -> str:
    if isinstance(error, ssl.SSLError):
        return f"tls: {error.reason or error}"
    return os_error_text(error)


def _scan(scanner: HeadScanner, data: bytes, first: bool, reused: bool) -> tuple[Head, bytes] | None:
    """Feed the head's next bytes to `scanner` (b"": the server closed the connection)."""
    if not data:
        raise _head_read_failure(None, first=first, reused=reused)
    return scanner.feed(data)


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

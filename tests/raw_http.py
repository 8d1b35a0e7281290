"""Raw HTTP servers for tests: they send exactly the bytes a test gives them, the malformed and
the unusual included, which no well-behaved server (the simulated node) ever sends.

`raw_server` runs a handler per connection; `raw_node` is a node a gateway can route to (it
answers the probes as vLLM does) whose completion answers are raw bytes; `exchange_until_closed`
is a raw client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import msgspec
import trio

HOST = "127.0.0.1"


class ServerConnection:
    """One accepted connection of a RawServer, as its handler sees it."""

    def __init__(self, stream: trio.SocketStream, server: RawServer, number: int) -> None:
        self.stream = stream
        self.server = server
        self.number = number
        self.closed = False
        """The handler closed it (`close`): no more requests are read."""
        self._buffer = b""

    async def request(self) -> bytes | None:
        """The next request (head and Content-Length body) as received; None once the client closed."""
        if self.closed:
            return None
        while b"\r\n\r\n" not in self._buffer:
            data = await self._receive()
            if not data:
                return None
            self._buffer += data
        head, _, rest = self._buffer.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(rest) < length:
            rest += await self._receive()
        request, self._buffer = head + b"\r\n\r\n" + rest[:length], rest[length:]
        self.server.requests.append((self.number, request))
        return request

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def close(self) -> None:
        """Close the connection (as a server ends a close-delimited body)."""
        self.closed = True
        await self.stream.aclose()

    async def wait_closed_by_client(self) -> None:
        """Return once the client has closed its end (or reset it)."""
        while await self._receive():
            pass
        self.server.closed_by_client += 1

    async def _receive(self) -> bytes:
        try:
            return await self.stream.receive_some(65536)
        except trio.BrokenResourceError:
            return b""


Handler = Callable[[ServerConnection], Awaitable[None]]


class RawServer:
    def __init__(self, port: int) -> None:
        self.port = port
        self.connections = 0
        self.closed_by_client = 0
        self.requests: list[tuple[int, bytes]] = []
        """(connection number, request bytes), in order of arrival."""
        self.handlers_done = 0


@asynccontextmanager
async def raw_server(handler: Handler, host: str = HOST) -> AsyncIterator[RawServer]:
    """A TCP server on `host` running `handler` for each connection (closed when it returns)."""
    [listener] = await trio.open_tcp_listeners(0, host=host)
    server = RawServer(listener.socket.getsockname()[1])

    async def serve(stream: trio.SocketStream) -> None:
        server.connections += 1
        async with stream:
            await handler(ServerConnection(stream, server, server.connections))
        server.handlers_done += 1

    failure: Exception | None = None  # re-raised as it is, not wrapped in an ExceptionGroup
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, serve, [listener])
        try:
            yield server
        except Exception as exc:
            failure = exc
        finally:
            nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure


def answer_each(*responses: bytes) -> Handler:
    """A keep-alive handler: the n-th request on a connection gets responses[n] (the last one
    repeats); it stops when the client closes."""

    async def handler(connection: ServerConnection) -> None:
        served = 0
        while await connection.request() is not None:
            await connection.send(responses[min(served, len(responses) - 1)])
            served += 1
        connection.server.closed_by_client += 1

    return handler


# --- a node for the gateway ----------------------------------------------------------------------

Answer = bytes | Callable[[ServerConnection], Awaitable[None]]
"""A completion answer: bytes sent as they are, or a function that sends what it likes on the
connection (and may close it)."""


class RawNode:
    """A node on a raw server, with what `harness.config_text` reads of a node. `completions`
    holds (connection number, request bytes) of each completion request, in order."""

    def __init__(
        self, name: str, host: str, models: Sequence[str], answers: Sequence[Answer], metrics: Answer | None = None
    ) -> None:
        self.name = name
        self.host = host
        self.vllm_port = 0
        self.metrics_port = 0
        self.completions: list[tuple[int, bytes]] = []
        self._answers = answers
        listing = {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "vllm"} for model in models]}
        self.probe_answers: dict[bytes, Answer] = {
            b"/health": _ok(b""),
            b"/v1/models": _ok(msgspec.json.encode(listing), b"application/json"),
            b"/metrics": _ok(b"", b"text/plain") if metrics is None else metrics,
        }
        """The answer to each probe's path (as a completion answer is given); a test may change
        one while the node runs."""

    async def serve(self, connection: ServerConnection) -> None:
        while (request := await connection.request()) is not None:
            method, target, _ = request.split(b" ", 2)
            if method != b"POST":
                await _send(connection, self.probe_answers.get(target, b"HTTP/1.1 404 Not Found\r\n\r\n"))
                continue
            self.completions.append((connection.number, request))
            await _send(connection, self._answers[min(len(self.completions), len(self._answers)) - 1])


async def _send(connection: ServerConnection, answer: Answer) -> None:
    if isinstance(answer, bytes):
        await connection.send(answer)
    else:
        await answer(connection)


def _ok(body: bytes, content_type: bytes = b"text/plain") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (content_type, len(body), body)


@asynccontextmanager
async def raw_node(
    *answers: Answer,
    models: Sequence[str] = ("test-model",),
    host: str = "127.0.0.2",
    name: str = "n1",
    metrics: Answer | None = None,
) -> AsyncIterator[RawNode]:
    """A node on `host` that answers `/health`, `/v1/models` (listing `models`) and `/metrics`
    (an empty 200, or the answer `metrics`) as a vLLM node does, and its n-th completion
    request with answers[n] (the last one repeats)."""
    node = RawNode(name, host, models, answers, metrics)
    async with raw_server(node.serve, host) as server:
        node.vllm_port = node.metrics_port = server.port
        yield node


async def exchange_until_closed(port: int, request: bytes) -> bytes:
    """Send `request` on a new connection and read until the server closes it (10 s at most)."""
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        await stream.send_all(request)
        received = b""
        with trio.fail_after(60):
            while chunk := await stream.receive_some():
                received += chunk
        return received

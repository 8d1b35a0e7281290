"""The probes' requests as non-blocking steps (`transport.readiness`): a body-less request
prepared once by `HttpClient.prepare` and sent as often as needed, each time as a step
generator that a `Readiness` runs among a thousand others in one task."""

from __future__ import annotations

from typing import NamedTuple

from transport.connections import Connection, Pool, connect_steps
from transport.errors import WriteFailed
from transport.parser import BodyReader, framing
from transport.readiness import Steps


class PreparedRequest(NamedTuple):
    """A body-less request built by `HttpClient.prepare`: its pool, method and bytes, and the
    address to connect to when the host is an IP address (None: a host name, looked up)."""

    pool: Pool
    method: bytes
    message: bytes
    addresses: list | None


def request_steps(request: PreparedRequest, deadline: float, limit: int | None = None) -> Steps:
    """`request` as a step generator for `transport.readiness`: returns (status, whole body), as
    `HttpClient.request` and then `read_body(limit)` would, with the same errors, the same single
    retry of a GET or HEAD on a reused connection the server had closed, and the connection back
    in its pool once the body has been read. Every wait ends at `deadline` (TimedOut)."""
    pool = request.pool
    retry_allowed = request.method == b"GET" or request.method == b"HEAD"
    while True:
        connection = pool.take_idle()
        reused = connection is not None
        if connection is None:
            connection = yield from connect_steps(pool, request.addresses, deadline)
        try:
            return (yield from _response_steps(connection, request, reused, deadline, limit))
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


def _response_steps(
    connection: Connection, request: PreparedRequest, reused: bool, deadline: float, limit: int | None
) -> Steps:
    """Send the request; (status, whole body) of its response."""
    (version, status, _, headers), rest = yield from connection.exchange_steps(request.message, reused, deadline)
    response_framing = framing(request.method, version, status, headers)
    body = BodyReader(response_framing, rest)
    if limit is not None:
        body.limit(limit)
    pieces = []
    while True:
        if data := body.read():
            pieces.append(data)
        if body.done:
            break
        if not data:
            body.feed((yield from connection.receive_steps(deadline)))
    if response_framing.reusable and not body.stray:
        connection.pool.give_back(connection)
    else:
        connection.close()
    return status, b"".join(pieces)

"""The errors of the HTTP/1.1 client, shared by the parser, the async client and the probes'
steps. Each message is written to read well in a log."""

from __future__ import annotations

import os


class HttpError(Exception):
    """A request that got no (complete) response."""


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
    """The body is larger than the reader's limit (the rest is not read: the connection is dropped)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"response body exceeds {limit} bytes")
        self.limit = limit


def os_error_text(error: BaseException | None) -> str:
    """`connection refused` rather than `[Errno 111] Connection refused`."""
    if isinstance(error, OSError) and error.errno is not None:
        return os.strerror(error.errno).lower()
    return str(error) or type(error).__name__

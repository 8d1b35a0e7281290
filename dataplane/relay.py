"""A committed body: what reaches the client once the node's status and headers have gone to it.

The body flows chunk by chunk as the node sends it. After commit a failure ends the response
early (never a 502, never a fabricated `[DONE]`), and visibly: an event stream gets an error
event the SDKs raise, and the response ends without its terminating chunk (as nginx does), so
HTTP clients see it cut short. The relay's end, whatever ends it, ends the attempt and the
request in the request's ledger.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable

import trio

from dataplane.admission.tokens import UsageTap
from dataplane.errors import SHUTTING_DOWN, STREAM_TERMINATED
from dataplane.exchange import Outcome
from dataplane.ledger import CLIENT_GONE, COMPLETED, TRUNCATED, Ledger
from transport.http11 import Response as UpstreamResponse

_STREAM_ERROR_EVENT = b"data: " + STREAM_TERMINATED.body + b"\n\n"
"""The last event of a stream the node cut short, in the shape vLLM and OpenAI use: the OpenAI
SDKs raise it as an APIError."""
_SHUTDOWN_EVENT = b"data: " + SHUTTING_DOWN.body + b"\n\n"
"""The last event of a stream still open when the shutdown grace ends (`Relay.end`)."""


class ResponseBodyTimeout(Exception):
    """A non-streaming answer's body did not end by its deadline (`gateway.response_body_timeout`):
    not retried, as a body cut short is not (the node has answered)."""


class Relay:
    """A committed body: the pieces already read, then the rest as the node sends it. Its end
    (whole, cut short by the node or by `end`, or the client gone) ends the attempt and the
    request in the request's ledger. While it flows it is in `flowing`."""

    __slots__ = ("_ledger", "_node", "_upstream", "_first", "_deadline", "_flowing", "_ended")

    def __init__(
        self,
        ledger: Ledger,
        node: str,
        upstream: UpstreamResponse,
        first: list[bytes],
        deadline: float,
        flowing: set[Relay],
    ) -> None:
        self._ledger = ledger
        self._node = node
        self._upstream = upstream
        self._first = first
        self._deadline = deadline
        self._flowing = flowing
        self._ended = False

    def end(self) -> None:
        """Stop relaying (the gateway is shutting down): the upstream connection is closed, which
        wakes the relay waiting on it, and the relay ends the body as `relay` says."""
        self._ended = True
        self._upstream.close()

    async def relay(
        self, send_head: Callable[[], Awaitable[None]], send_piece: Callable[[bytes], Awaitable[None]]
    ) -> bool:
        """Send the head, then the body. The client going away ends it early (the upstream
        connection is then closed at once, which cancels the generation on the node). So does a
        node failure, visibly: an event stream gets an error event last, and the answer is
        False, for the response to end without its terminating chunk. A body not ended by the
        deadline is such a failure, and so is an event of a token-counted stream past its bound
        (`tokens.EventTooLarge`). So is one ended by `end`, but an event stream then ends
        properly after its error event (the answer is True): the gateway, not the node, ended it."""
        upstream = self._upstream
        outcome = Outcome(COMPLETED, status=upstream.status, committed=True)
        chunk = b""
        next_chunk = upstream.next_chunk
        if self._deadline != math.inf:
            next_chunk = functools.partial(_next_chunk_by, upstream, self._deadline)
        tap = self._ledger.ticket.tap
        if tap is not None:
            send_piece = functools.partial(_send_tapped, tap, send_piece)
        self._flowing.add(self)
        try:
            await send_head()
            try:
                for chunk in self._first:
                    await send_piece(chunk)
                while chunk := await next_chunk():
                    await send_piece(chunk)
                if tap is not None and (rest := tap.finish()):
                    await send_piece(rest)
            except Exception as error:
                if self._ended:
                    error = SHUTTING_DOWN.message
                outcome = Outcome(TRUNCATED, status=upstream.status, error=error, committed=True)
        except BaseException:  # trio.Cancelled: the client left
            outcome = Outcome(CLIENT_GONE, status=upstream.status, error="client disconnected", committed=True)
            raise
        finally:
            self._flowing.discard(self)
            upstream.close()
            self._ledger.attempt_ended(self._node, outcome)
            self._ledger.request_ended(upstream.status)
        if outcome.kind != TRUNCATED:
            return True
        if not (upstream.header(b"content-type") or b"").startswith(b"text/event-stream"):
            return False
        # `chunk` is the last piece relayed: an event it leaves unfinished is ended first.
        event = _SHUTDOWN_EVENT if self._ended else _STREAM_ERROR_EVENT
        await send_piece((b"" if chunk.endswith(b"\n\n") else b"\n\n") + event)
        return self._ended


async def _send_tapped(tap: UsageTap, send_piece: Callable[[bytes], Awaitable[None]], piece: bytes) -> None:
    """Send what the usage tap lets through of `piece` (`admission.tokens.UsageTap`)."""
    if piece := tap.feed(piece):
        await send_piece(piece)


async def _next_chunk_by(upstream: UpstreamResponse, deadline: float) -> bytes:
    """The answer's next piece; ResponseBodyTimeout once `deadline` has passed."""
    with trio.move_on_at(deadline):
        return await upstream.next_chunk()
    raise ResponseBodyTimeout("timeout awaiting response body")

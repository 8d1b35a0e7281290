"""The API listener's ASGI application: the completion routes in plain ASGI, the rest in Quart.

`POST /v1/chat/completions` and `POST /v1/completions` are the hot path, and Quart's request
and response objects, contexts and routing cost about a quarter of what hypercorn itself does
per small request (measured here). So they are answered here, straight from hypercorn's ASGI
messages: steps 1-3 of plinth's pipeline (read the body within the limit, parse only `model`
and `stream`, inject the default model), then the proxy (routing and the attempt loop), whose
`Reply` is sent as it is. Every other request goes to the Quart app (`dataplane.app`)
unchanged: `/health`, `/v1/models`, the 404s, and other methods on the completion paths (405).
Each request reads the control plane's snapshot once and keeps it throughout.

Two things hypercorn (trio) does shape `_completion`:
- A client that goes away makes no `send` fail: hypercorn drops what is sent after that and
  tells the app through `receive()` (`http.disconnect`). So a task waits for that while the
  request is routed and its reply sent, and cancels that work, which closes the upstream
  request (so the node stops generating). The same task drops the body messages an early 413
  leaves unread: hypercorn queues the body for the app (at most 10 messages) and must be able to
  queue the disconnect behind it when the exchange ends.
- hypercorn ends the exchange inside the app's last send: it queues `http.disconnect`, then
  closes or recycles the connection, which a cancellation would interrupt, leaving a
  `Connection: close` socket open. So the watch no longer cancels anything once the last send
  has begun.
"""

from __future__ import annotations

import enum
import os
import time

import msgspec
import trio

from dataplane.app import create_app
from dataplane.control import ControlPlaneView
from dataplane.errors import INVALID_BODY, NO_MODEL, REQUEST_TIMEOUT, REQUEST_TOO_LARGE, Reply, error_reply
from dataplane.proxy import (
    COMPLETION_PATHS,
    ConfigView,
    Exchange,
    Proxy,
    SnapshotView,
    SnapshotViews,
    forward_headers,
    request_id_header,
)


class CompletionFields(msgspec.Struct):
    """The only fields routing reads; the rest of the body is forwarded untouched. null is
    accepted where Go's encoding/json accepts it (as absent)."""

    model: str | None = None
    stream: bool | None = None


_decode_fields = msgspec.json.Decoder(CompletionFields | None)
_decode_members = msgspec.json.Decoder(dict[str, msgspec.Raw] | None)
_encode = msgspec.json.Encoder()


def with_model(body: bytes, model: str) -> bytes:
    """The JSON object `body` with `"model": model` set; every other member keeps its exact bytes
    (numbers included) and its place. Only called on a body that decoded as an object (or null)."""
    members = _decode_members.decode(body) or {}
    members["model"] = msgspec.Raw(_encode.encode(model))
    return _encode.encode(members)


class ApiApp:
    """The ASGI application of the API listener (`gateway.listen`)."""

    def __init__(self, control_plane: ControlPlaneView, proxy: Proxy, views: SnapshotViews, worker: int = 0) -> None:
        self._control_plane = control_plane
        self._proxy = proxy
        self._views = views
        self._quart = create_app(control_plane, views, worker)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in COMPLETION_PATHS:
            await self._completion(scope, receive, send)
        else:
            await self._quart(scope, receive, send)

    async def _completion(self, scope, receive, send) -> None:
        started = time.perf_counter()
        view = self._views.current()
        request_id = declared_length = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                request_id = request_id or value.decode("latin-1")
            elif name == b"content-length":
                declared_length = int(value)  # hypercorn (h11) accepts only digits here
        request_id = request_id or os.urandom(16).hex()
        try:
            body = await _read_body(receive, declared_length, view.config)
        except _ClientLeft:
            return
        async with trio.open_nursery() as nursery:
            watch = _DisconnectWatch(receive, nursery.cancel_scope)
            nursery.start_soon(watch.run)
            reply = await self._reply(scope, body, request_id, view, started)
            last = await _send_all_but_last(send, reply)
            if reply.truncated:
                # No last send: hypercorn then closes the connection without the body's end (the
                # terminating chunk), and the client sees the response cut short, as it was.
                nursery.cancel_scope.cancel()
                return
            watch.answered = True
            await send({"type": "http.response.body", "body": last, "more_body": False})

    async def _reply(self, scope, body: bytes | _Unread, request_id: str, view: SnapshotView, started: float) -> Reply:
        """Steps 1-3 of plinth's pipeline here, the rest in the proxy."""
        if body is _Unread.TOO_LARGE:
            return error_reply(REQUEST_TOO_LARGE, request_id_header(request_id), close=True)
        if body is _Unread.TIMED_OUT:
            return error_reply(REQUEST_TIMEOUT, request_id_header(request_id), close=True)
        try:
            fields = _decode_fields.decode(body)
        except msgspec.DecodeError:
            return error_reply(INVALID_BODY, request_id_header(request_id))
        model = fields.model if fields is not None else None
        stream = bool(fields.stream) if fields is not None else False
        if not model:
            model = view.config.default_model
            if not model:
                return error_reply(NO_MODEL, request_id_header(request_id))
            body = with_model(body, model)
        client = scope["client"]
        exchange = Exchange(
            request_id=request_id,
            path=scope["path"],
            model=model,
            stream=stream,
            body=body,
            headers=forward_headers(scope["headers"], client[0] if client else "", request_id),
            view=view,
            at=self._control_plane.now(),
            started=started,
        )
        return await self._proxy.forward(exchange)


class _ClientLeft(Exception):
    """The client went away before its request body was complete."""


class _Unread(enum.Enum):
    """Why `_read_body` left the rest of a body unread."""

    TOO_LARGE = enum.auto()
    TIMED_OUT = enum.auto()


async def _read_body(receive, declared_length: int | None, config: ConfigView) -> bytes | _Unread:
    """The request body, or why the rest of it was left unread: it is larger than the limit, or
    the client took longer than the body timeout to send it all, or than the idle timeout to
    send its next piece.

    hypercorn (trio) gives the app its queue's `receive`: a whole body already queued (most
    bodies, which come with their head) is taken at once, and only a body still arriving is
    read in a cancel scope with the deadlines (a scope costs more than the rest of this)."""
    limit = config.body_limit
    if declared_length is not None and declared_length > limit:
        return _Unread.TOO_LARGE
    queue = getattr(receive, "__self__", None)
    if isinstance(queue, trio.MemoryReceiveChannel):
        try:
            message = queue.receive_nowait()
        except trio.WouldBlock:
            pass
        else:
            if message["type"] != "http.request":
                raise _ClientLeft
            body = message["body"]
            if not message["more_body"]:
                return body if len(body) <= limit else _Unread.TOO_LARGE
            return await _read_rest(receive, [body], config)
    return await _read_rest(receive, [], config)


async def _read_rest(receive, pieces: list[bytes], config: ConfigView) -> bytes | _Unread:
    """The rest of a body that began with `pieces`, within the limit and the deadlines."""
    limit = config.body_limit
    size = sum(map(len, pieces))
    if size > limit:
        return _Unread.TOO_LARGE
    started = trio.current_time()
    give_up = started + config.body_timeout
    with trio.CancelScope(deadline=min(give_up, started + config.body_idle_timeout)) as deadline:
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise _ClientLeft
            piece = message["body"]
            if piece:
                size += len(piece)
                if size > limit:
                    return _Unread.TOO_LARGE
                pieces.append(piece)
            if not message["more_body"]:
                return b"".join(pieces)
            deadline.deadline = min(give_up, trio.current_time() + config.body_idle_timeout)
    return _Unread.TIMED_OUT


class _DisconnectWatch:
    """Cancels a request's work when its client goes away before the last send, and meanwhile
    drops the request body messages left unread.

    hypercorn queues `http.disconnect` during the last send at the latest, so the watch always
    ends by itself; once the request is `answered`, without cancelling anything (delivering a
    cancellation costs about 50 µs of CPU here, a fiftieth of a whole proxied request).
    """

    __slots__ = ("_receive", "_work", "answered")

    def __init__(self, receive, work: trio.CancelScope) -> None:
        self._receive = receive
        self._work = work
        self.answered = False

    async def run(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        if not self.answered:
            self._work.cancel()


async def _send_all_but_last(send, reply: Reply) -> bytes:
    """Send the status and headers and, for a flowing body, each piece as the node sends it;
    what is left for the last send (a complete body, or nothing after a flowing one)."""
    body = reply.body
    if isinstance(body, bytes):
        headers = [*reply.headers, (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        return body
    try:
        # The generator is started before anything else is awaited: closing a generator that
        # never ran would skip its cleanup (closing the upstream response, the bookkeeping).
        first = await anext(body, b"")
        await send({"type": "http.response.start", "status": reply.status, "headers": reply.headers})
        if first:
            await send({"type": "http.response.body", "body": first, "more_body": True})
        async for piece in body:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
    finally:
        await body.aclose()
    return b""

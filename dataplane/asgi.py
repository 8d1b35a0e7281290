"""The API listener's ASGI application: the routed endpoints in plain ASGI, the rest in Quart.

`POST` to a model-addressed endpoint (`dataplane.endpoints.ROUTED_PATHS`: `/v1/chat/completions`
and `/v1/completions`, the hot path, and the rest of what vLLM serves) is answered here, since
Quart's request and response objects, contexts and routing cost a good share of what hypercorn
itself does per small request (`bench/`'s two floor rows show how much). So they are answered
straight from hypercorn's ASGI messages: steps 1-3 of plinth's pipeline (read the body within the
limit, parse only `model` and `stream`, of a JSON body or of a multipart form's fields, inject the
default model), then the proxy (routing and the attempt loop), whose `Reply` is sent as it is.
Every other request goes to the Quart app (`dataplane.app`) unchanged: `/health`, `/ready`,
`/v1/models`, the 404s, and other methods on the routed paths (405).
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

import os
import time
from collections.abc import Awaitable, Callable

import msgspec
import trio

from dataplane.access import key_tenant, unauthorized_reply
from dataplane.app import create_app
from dataplane.control import ControlPlaneView
from dataplane.errors import (
    INVALID_BODY,
    MODEL_NAME_TOO_LONG,
    NO_MODEL,
    NOT_FOUND,
    REQUEST_TIMEOUT,
    REQUEST_TOO_LARGE,
    ApiError,
    Reply,
    error_reply,
)
from dataplane.endpoints import FORM_PATHS, ROUTED_PATHS, form_boundary, form_fields, with_form_model
from dataplane.exchange import Exchange
from dataplane.headers import forward_headers, request_id_header
from dataplane.hypercorn_private import queued_message
from dataplane.proxy import Proxy
from dataplane.views import ConfigView, SnapshotView, SnapshotViews
from events.config import DEFAULT_TENANT
from events.types import MAX_MODEL_NAME_LENGTH


class CompletionFields(msgspec.Struct):
    """The only fields routing reads; the rest of the body is forwarded untouched. null is
    accepted where Go's encoding/json accepts it (as absent)."""

    model: str | None = None
    stream: bool | None = None


MAX_REQUEST_ID_LENGTH = 200
"""A longer X-Request-Id is replaced by a new id (as Heroku's router does): the id goes into log
lines and decision records, which must not carry unbounded client text."""

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

    def end_streams(self) -> None:
        """End the completions still streaming (the shutdown grace is over): `Proxy.end_streams`."""
        self._proxy.end_streams()

    def __call__(self, scope, receive, send) -> Awaitable[None]:
        """The coroutine that answers the request. A plain function, so that the request's task
        resumes one frame fewer at each of its waits (`interlock.serve` tells hypercorn this
        is an ASGI app, which it would otherwise guess from `async def`)."""
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                return _refuse_websocket(send)
            return self._quart(scope, receive, send)
        view = self._views.current()
        tenant = DEFAULT_TENANT
        if view.config.api_key_digests and not (view.config.health_open and scope["path"] in ("/health", "/ready")):
            # With keys, every request but an open /health or /ready (a load balancer's check) needs one.
            tenant = key_tenant(scope["headers"], view.config.api_key_digests)
            if tenant is None:
                return _refuse(receive, send, unauthorized_reply())
        if scope["method"] == "POST" and scope["path"] in ROUTED_PATHS:
            return self._completion(scope, receive, send, view, tenant)
        if "://" in scope["path"] and not scope["path"].startswith("/"):
            return self(_origin_form(scope), receive, send)
        return self._quart(scope, receive, send)

    async def _completion(self, scope, receive, send, view: SnapshotView, tenant: str) -> None:
        started = time.perf_counter()
        request_id = declared_length = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                request_id = request_id or value.decode("latin-1")
            elif name == b"content-length":
                declared_length = int(value)  # hypercorn (h11) accepts only digits here
        if not request_id or len(request_id) > MAX_REQUEST_ID_LENGTH:
            request_id = os.urandom(16).hex()
        try:
            body = await _read_body(receive, declared_length, view.config)
        except _ClientLeft:
            return
        async with trio.open_nursery() as nursery:
            watch = _DisconnectWatch(receive, nursery.cancel_scope)
            nursery.start_soon(watch.run)
            reply = await self._reply(scope, body, request_id, view, started, tenant)
            last = reply.body
            if isinstance(last, bytes):
                await send(_start(reply))
            elif await last.relay(*_flowing(send, reply)):
                last = b""
            else:
                # No last send: hypercorn then closes the connection without the body's end (the
                # terminating chunk), and the client sees the response cut short, as it was.
                nursery.cancel_scope.cancel()
                return
            watch.answered = True
            await send({"type": "http.response.body", "body": last, "more_body": False})

    async def _reply(
        self, scope, body: bytes | ApiError, request_id: str, view: SnapshotView, started: float, tenant: str
    ) -> Reply:
        """Steps 1-3 of plinth's pipeline here, the rest in the proxy."""
        if isinstance(body, ApiError):
            return error_reply(body, request_id_header(request_id), close=True)
        config = view.config
        if scope["path"] in FORM_PATHS:
            read = _read_form(scope, body, config)
            if isinstance(read, ApiError):
                return error_reply(read, request_id_header(request_id))
            body, model, alias, stream = read
        else:
            try:
                fields = _decode_fields.decode(body)
            except (msgspec.DecodeError, RecursionError):  # RecursionError: nested too deep to skip
                return error_reply(INVALID_BODY, request_id_header(request_id))
            named = fields.model if fields is not None else None
            resolved = _resolve_model(named, config)
            if isinstance(resolved, ApiError):
                return error_reply(resolved, request_id_header(request_id))
            model, alias = resolved
            if model != named:
                body = with_model(body, model)
            stream = bool(fields.stream) if fields is not None else False
        client = scope["client"]
        exchange = Exchange(
            request_id=request_id,
            path=scope["path"],
            model=model,
            alias=alias,
            stream=stream,
            body=body,
            headers=forward_headers(scope["headers"], client[0] if client else "", request_id),
            view=view,
            at=self._control_plane.now(),
            started=started,
            tenant=tenant,
        )
        return await self._proxy.forward(exchange)


def _resolve_model(named: str | None, config: ConfigView) -> tuple[str, str] | ApiError:
    """The model a request is routed and forwarded as, from the one its body names (None: the
    default model), and the alias the client named ("" if none); or why the name will not do."""
    if named and len(named) > MAX_MODEL_NAME_LENGTH:
        return MODEL_NAME_TOO_LONG
    model = named or config.default_model
    if not model:
        return NO_MODEL
    target = config.aliases.get(model)
    return (model, "") if target is None else (target, model)


def _read_form(scope, body: bytes, config: ConfigView) -> tuple[bytes, str, str, bool] | ApiError:
    """Steps 2-3 for a multipart/form-data body (the audio endpoints): the body as forwarded, its
    model and alias (`_resolve_model`) and whether it asks for a stream. Only the `model` and
    `stream` fields are read; every other byte goes on unchanged."""
    content_type = next((value for name, value in scope["headers"] if name == b"content-type"), b"")
    boundary = form_boundary(content_type)
    fields = form_fields(body, boundary) if boundary is not None else None
    if fields is None:
        return INVALID_BODY
    resolved = _resolve_model(fields.model, config)
    if isinstance(resolved, ApiError):
        return resolved
    model, alias = resolved
    if model != fields.model:
        body = with_form_model(body, boundary, fields, model)
    return body, model, alias, fields.stream


def _origin_form(scope: dict) -> dict:
    """The scope of a request whose target is in absolute form (`POST http://host/v1/…`, which
    HTTP/1.1 servers must accept) as if it had been in origin form (`/v1/…`)."""
    _, _, authority_and_path = scope["path"].partition("://")
    path = "/" + authority_and_path.partition("/")[2]
    return {**scope, "path": path, "raw_path": path.encode()}


async def _refuse_websocket(send) -> None:
    """The API serves no WebSocket: the upgrade request gets the JSON 404 any unknown route gets
    (hypercorn's `websocket.http.response` extension sends it as a plain HTTP response)."""
    headers = [*NOT_FOUND.headers, (b"content-length", b"%d" % len(NOT_FOUND.body))]
    await send({"type": "websocket.http.response.start", "status": NOT_FOUND.status, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": NOT_FOUND.body})


class _ClientLeft(Exception):
    """The client went away before its request body was complete."""


async def _read_body(receive, declared_length: int | None, config: ConfigView) -> bytes | ApiError:
    """The request body; or, with the rest left unread, REQUEST_TOO_LARGE when it is larger
    than the limit, REQUEST_TIMEOUT when it takes longer than the body timeout in all or the
    idle timeout between two pieces.

    A whole body already queued by hypercorn (most bodies, which come with their head, and
    their end with them: `dataplane.hypercorn_private`) is taken without waiting, and only a
    body still arriving is read in a cancel scope with the deadlines (a scope costs more than
    the rest of this)."""
    if declared_length is not None and declared_length > config.body_limit:
        return REQUEST_TOO_LARGE
    pieces: list[bytes] = []
    while True:  # hypercorn queues at most a few
        message = queued_message(receive)
        if message is None:
            return await _read_rest(receive, pieces, config)
        if message["type"] != "http.request":
            raise _ClientLeft
        if message["body"]:
            pieces.append(message["body"])
        if not message["more_body"]:
            body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            return body if len(body) <= config.body_limit else REQUEST_TOO_LARGE


async def _read_rest(receive, pieces: list[bytes], config: ConfigView) -> bytes | ApiError:
    """The rest of a body that began with `pieces`, within the limit and the deadlines."""
    size = sum(map(len, pieces))
    if size > config.body_limit:
        return REQUEST_TOO_LARGE
    now = trio.current_time()
    give_up_at = now + config.body_timeout
    with trio.CancelScope(deadline=min(give_up_at, now + config.body_idle_timeout)) as waiting:
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise _ClientLeft
            piece = message["body"]
            if piece:
                size += len(piece)
                if size > config.body_limit:
                    return REQUEST_TOO_LARGE
                pieces.append(piece)
            if not message["more_body"]:
                return b"".join(pieces)
            waiting.deadline = min(give_up_at, trio.current_time() + config.body_idle_timeout)
    return REQUEST_TIMEOUT


async def _refuse(receive, send, reply: Reply) -> None:
    """Answer a request with a complete error reply without reading its body (the watch drops it)."""
    async with trio.open_nursery() as nursery:
        watch = _DisconnectWatch(receive, nursery.cancel_scope)
        watch.answered = True
        nursery.start_soon(watch.run)
        await send(_start(reply))
        await send({"type": "http.response.body", "body": reply.body, "more_body": False})


class _DisconnectWatch:
    """Cancels a request's work when its client goes away before the last send, and meanwhile
    drops the request body messages left unread.

    hypercorn queues `http.disconnect` during the last send at the latest, so the watch always
    ends by itself; once the request is `answered`, without cancelling anything (delivering a
    cancellation costs CPU that a request answered whole need not spend).
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


def _start(reply: Reply) -> dict:
    """The start message of a reply whose body is complete (bytes)."""
    headers = reply.headers
    if reply.status != 204 and reply.status != 304:  # they have no body, nor a length for one
        headers = [*headers, (b"content-length", b"%d" % len(reply.body))]
    return {"type": "http.response.start", "status": reply.status, "headers": headers}


def _flowing(send, reply: Reply) -> tuple[Callable[[], Awaitable[None]], Callable[[bytes], Awaitable[None]]]:
    """The head's send and a piece's for a flowing body's relay: plain functions that return
    hypercorn's `send` coroutine, which the relay awaits (no coroutine of ours per piece)."""

    def send_head() -> Awaitable[None]:
        return send({"type": "http.response.start", "status": reply.status, "headers": reply.headers})

    def send_piece(piece: bytes) -> Awaitable[None]:
        return send({"type": "http.response.body", "body": piece, "more_body": True})

    return send_head, send_piece

"""The API listener's Quart-trio app: plinth's four routes (§4).

`GET /health` and `GET /v1/models` describe the current snapshot. The two completion routes do
steps 1-3 of plinth's pipeline here (read the body within the limit, parse only `model` and
`stream`, inject the default model) and hand the request to the proxy for routing and the
attempt loop. Each request reads the control plane's snapshot once and keeps it throughout.
"""

from __future__ import annotations

import time
import uuid

import msgspec
import trio
from quart import Response, request
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import MethodNotAllowed, NotFound

from controlplane.runtime import ControlPlane
from controlplane.state import HEALTHY
from dataplane.errors import INVALID_BODY, METHOD_NOT_ALLOWED, NO_MODEL, NOT_FOUND, REQUEST_TOO_LARGE, error_response
from dataplane.proxy import COMPLETION_PATHS, Exchange, Proxy, SnapshotViews, forward_headers


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


class _HttpConnection(TrioASGIHTTPConnection):
    """quart-trio's connection handler, sending the end of each response shielded from cancellation.

    hypercorn finishes the exchange inside that last send: it tells the app the stream is closed,
    which makes quart-trio cancel the request's tasks, and then closes (or recycles) the
    connection, which a cancellation would interrupt, leaving a `Connection: close` socket open.
    """

    async def __call__(self, receive, send) -> None:
        async def send_end_shielded(message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        await super().__call__(receive, send_end_shielded)


def create_app(control_plane: ControlPlane, proxy: Proxy, views: SnapshotViews) -> QuartTrio:
    app = QuartTrio("interlock")
    app.asgi_http_class = _HttpConnection
    app.config.update(
        # Streams last as long as generation does: neither Quart timeout may cut them.
        RESPONSE_TIMEOUT=None,
        BODY_TIMEOUT=None,
        # The body limit is the snapshot's, applied below (a reload may change it).
        MAX_CONTENT_LENGTH=None,
        # Like plinth's mux: OPTIONS is a method like any other (405).
        PROVIDE_AUTOMATIC_OPTIONS=False,
    )

    @app.get("/health")
    async def health() -> Response:
        snapshot = control_plane.snapshot
        now = control_plane.now()
        nodes = snapshot.node_list()
        healthy = sum(1 for node in nodes if node.status == HEALTHY)
        if healthy and healthy == len(nodes):
            status = "ok"
        elif not healthy:
            status = "error"
        else:
            status = "degraded"
        # Key order as Go encodes it: a map's keys sorted, a struct's fields in declaration order.
        details = [
            {
                "ip": node.ip,
                "name": node.name,
                "status": node.status,
                "models": {
                    "state": node.models.state,
                    "names": node.models.names,
                    "age_seconds": node.models.age(now),
                    "fails": node.models.fails,
                    "last_error": node.models.last_error,
                },
            }
            for node in nodes
        ]
        body = {
            "details": details,
            "healthy": healthy,
            "models_ok": sum(1 for node in nodes if node.models.settled()),
            "nodes": len(nodes),
            "status": status,
        }
        return Response(_encode.encode(body), content_type="application/json")

    @app.get("/v1/models")
    async def models() -> Response:
        return Response(views.current().config.models_body, content_type="application/json")

    async def completions() -> Response:
        started = time.perf_counter()
        view = views.current()
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        id_header = {"X-Request-Id": request_id}

        body = await _read_body(view.config.body_limit)
        if body is None:
            return error_response(REQUEST_TOO_LARGE, close=True, headers=id_header)
        try:
            fields = _decode_fields.decode(body)
        except msgspec.DecodeError:
            return error_response(INVALID_BODY, headers=id_header)
        model = fields.model if fields is not None else None
        stream = bool(fields.stream) if fields is not None else False
        if not model:
            model = view.config.default_model
            if not model:
                return error_response(NO_MODEL, headers=id_header)
            body = with_model(body, model)

        scope = request.scope
        client = scope.get("client")
        exchange = Exchange(
            request_id=request_id,
            path=request.path,
            model=model,
            stream=stream,
            body=body,
            headers=forward_headers(scope["headers"], client[0] if client else "", request_id),
            view=view,
            at=control_plane.now(),
            started=started,
        )
        return await proxy.forward(exchange)

    for path in COMPLETION_PATHS:
        app.add_url_rule(path, f"completions {path}", completions, methods=["POST"])

    @app.errorhandler(NotFound)
    async def not_found(error: NotFound) -> Response:
        return error_response(NOT_FOUND, close=_has_body())

    @app.errorhandler(MethodNotAllowed)
    async def method_not_allowed(error: MethodNotAllowed) -> Response:
        allow = ", ".join(sorted(error.valid_methods or ()))
        return error_response(METHOD_NOT_ALLOWED, close=_has_body(), headers={"Allow": allow})

    return app


async def _read_body(limit: int) -> bytes | None:
    """The request body, or None when it is larger than `limit` (then left unread)."""
    length = request.content_length
    if length is not None:
        # hypercorn delivers exactly the declared length, no more.
        return None if length > limit else await request.body
    chunks = []
    size = 0
    async for chunk in request.body:
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _has_body() -> bool:
    return bool(request.content_length) or "chunked" in request.headers.get("Transfer-Encoding", "").lower()

"""The API listener's Quart-trio app: plinth's routes (§4) other than the routed POSTs, and `/ready`.

`GET /health`, `GET /ready`, `GET /v1/models` and `GET /v1/models/{id}` describe the current
snapshot; unknown paths and methods get plinth's 404 and 405. `POST` to the routed
endpoints (`dataplane.endpoints.ROUTED_PATHS`) never gets here: the API listener's ASGI application (`dataplane.asgi`) answers those
itself, and hands everything else to this app. The routed paths are declared here all the
same, so that other methods on them get 405.
"""

from __future__ import annotations

from typing import Any

import msgspec
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import MethodNotAllowed, NotFound

from controlplane.infrastructure.logs import clipped
from controlplane.rules.routing import rings_listing
from dataplane.control import ControlPlaneView
from dataplane.errors import METHOD_NOT_ALLOWED, NOT_FOUND, Reply, error_reply, model_not_found
from dataplane.endpoints import ROUTED_PATHS
from dataplane.quart_apps import new_quart_app
from dataplane.views import ConfigView, SnapshotView, SnapshotViews
from events.state import Health, NodeState

_encode = msgspec.json.Encoder()

NOTHING_ROUTABLE = "no model has a routable node"
"""`/ready`'s reason when no model it counts (`SnapshotView.routable_models`) has a node to route to."""


def create_app(control_plane: ControlPlaneView, views: SnapshotViews, worker: int = 0) -> QuartTrio:
    app = new_quart_app("interlock")
    # `/v1//models` is not a route (werkzeug would redirect to `/v1/models`, in HTML).
    app.url_map = app.url_map_class(merge_slashes=False)
    app.config.update(
        # No request body is read here (the 404 and 405 answers leave it unread): no limit.
        MAX_CONTENT_LENGTH=None,
    )

    @app.get("/health")
    async def health() -> Response:
        every_model = request.args.get("models") == "all"
        view = views.current()
        snapshot = view.snapshot
        now = control_plane.now()
        nodes = snapshot.node_list()
        healthy = sum(1 for node in nodes if node.status == Health.HEALTHY)
        if healthy and healthy == len(nodes):
            status = "ok"
        elif not healthy:
            status = "error"
        else:
            status = "degraded"
        # Key order as Go encodes it: a map's keys sorted, a struct's fields in declaration order.
        details = [_node_details(node, now, view.config, every_model) for node in nodes]
        body = {
            "details": details,
            "healthy": healthy,
            "models_ok": sum(1 for node in nodes if node.models.settled()),
            "nodes": len(nodes),
            "status": status,
        }
        return Response(_encode.encode(body), content_type="application/json", headers=state_headers(view))

    @app.get("/ready")
    async def ready() -> Response:
        """For a load balancer in front: 200 when this process routes on current state and some
        model has a node to route to, else 503; the reason in the body."""
        view = views.current()
        stale = control_plane.stale_reason()
        if stale:
            body: dict[str, Any] = {"ready": False, "reason": stale}
        elif routable := view.routable_models(control_plane.now()):
            body = {"ready": True, "models": routable}
        else:
            body = {"ready": False, "reason": NOTHING_ROUTABLE}
        status = 200 if body["ready"] else 503
        return Response(_encode.encode(body), status, content_type="application/json", headers=state_headers(view))

    def state_headers(view: SnapshotView) -> dict[str, str]:
        """Which process answered, and the state it answered from: processes that followed the
        same events agree on the digest at the same seq (plinth's bodies stay as they are)."""
        return {
            "X-Interlock-Worker": str(worker),
            "X-Interlock-Seq": str(view.snapshot.seq),
            "X-Interlock-State-Digest": view.state_digest,
            **control_plane.fleet_headers(),
        }

    @app.get("/v1/models")
    async def models() -> Response:
        """What is served (`SnapshotView.model_list`)."""
        body = views.current().model_list(control_plane.now()).body
        return Response(body, content_type="application/json")

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        """One model of the list (the SDKs' `models.retrieve`); vLLM's 404 for any other id."""
        body = views.current().model_list(control_plane.now()).cards.get(model_id)
        if body is None:
            rings = rings_listing(views.current().snapshot, model_id)
            return _response(error_reply(model_not_found(clipped(model_id), rings)))
        return Response(body, content_type="application/json")

    async def not_the_completion_path() -> Response:
        """A POST that werkzeug matched to a completion rule though its path differs from the
        rule's (werkzeug drops leading slashes: `//v1/chat/completions`)."""
        raise NotFound()

    for path in sorted(ROUTED_PATHS):
        # POSTs are answered by dataplane.asgi: the rule only makes other methods a 405.
        app.add_url_rule(path, f"completions {path}", not_the_completion_path, methods=["POST"])

    @app.errorhandler(NotFound)
    async def not_found(error: NotFound) -> Response:
        return _response(error_reply(NOT_FOUND, close=_has_body()))

    @app.errorhandler(MethodNotAllowed)
    async def method_not_allowed(error: MethodNotAllowed) -> Response:
        allow = ", ".join(sorted(error.valid_methods or ())).encode()
        return _response(error_reply(METHOD_NOT_ALLOWED, (b"allow", allow), close=_has_body()))

    return app


HEALTH_MODEL_NAMES = 20
"""The model names /health shows of a node that lists more (`names_total` says how many it
lists); `/health?models=all` shows every one. /health is open to load balancers' checks, which
need no node's whole list at every call."""


def _node_details(node: NodeState, now: float, config: ConfigView, every_model: bool) -> dict[str, Any]:
    """One node's entry in /health; its load only when load is scraped."""
    names = node.models.names
    models = {
        "state": node.models.state,
        "names": names,
        "age_seconds": node.models.age(now),
        "fails": node.models.fails,
        "last_error": _shown_error(node.models.last_error, config.health_hides_errors),
    }
    if names is not None and len(names) > HEALTH_MODEL_NAMES and not every_model:
        models["names"] = names[:HEALTH_MODEL_NAMES]
        models["names_total"] = len(names)
    details = {"ip": node.ip, "name": node.name, "status": node.status, "models": models}
    if config.health_shows_load:
        load = node.load
        details["load"] = {
            "known": load.known,
            "running": load.running,
            "waiting": load.waiting,
            "kv_cache_usage": load.kv_cache_usage,
            "seconds_per_token": load.seconds_per_token,
            "age_seconds": None if load.scraped_at is None else now - load.scraped_at,
            "fails": load.fails,
            "last_error": _shown_error(load.last_error, config.health_hides_errors),
        }
    return details


HIDDEN_ERROR = "(hidden: gateway.health_hides_errors)"


def _shown_error(error: str, hidden: bool) -> str:
    """A node's error text as /health shows it: replaced when hidden, so that a failing node
    still shows that it has an error."""
    return HIDDEN_ERROR if hidden and error else error


def _response(reply: Reply) -> Response:
    """A complete Reply as a Quart response."""
    headers = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in reply.headers]
    return Response(reply.body, status=reply.status, headers=headers)


def _has_body() -> bool:
    return bool(request.content_length) or "chunked" in request.headers.get("Transfer-Encoding", "").lower()

"""What the gateway answers a completion request with, and its error answers.

A `Reply` is a response as the ASGI fast path (dataplane.asgi) sends it: the proxy returns one
for a node's answer, and `error_reply` for the gateway's own errors.

Errors are OpenAI-style JSON, `{"error": {"message": …, "type": …, "code": …}}`, which keeps the
OpenAI SDKs' error handling working, and the message is the text plinth answered with (`no
healthy node available`, …), so alerts that match on it keep working too. Each error is a
constant with its body and headers built once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

import msgspec

from controlplane.rules import routing
from dataplane.headers import Headers, request_id_header
from events.types import MAX_MODEL_NAME_LENGTH


class FlowingBody(Protocol):
    """A body sent as the node sends it (`dataplane.relay.Relay`)."""

    async def relay(
        self, send_head: Callable[[], Awaitable[None]], send_piece: Callable[[bytes], Awaitable[None]]
    ) -> bool:
        """Send the head, then each piece; whether the body ended whole (False: the response
        must end without its last chunk, so that the client sees it cut short). Ends its
        attempt whatever happens, a cancellation (the client gone) included."""
        ...


class Reply:
    """A response: status, headers as (name, value) bytes, and the body, either complete (sent
    with its Content-Length) or flowing."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: Headers, body: bytes | FlowingBody) -> None:
        self.status = status
        self.headers = headers
        self.body = body


class Refusal:
    """The gateway's own answer in place of a node's, from a stage of the request path
    (admission, planning, the attempts): the request ends with it (`dataplane.finish`)."""

    __slots__ = ("reply",)

    def __init__(self, reply: Reply) -> None:
        self.reply = reply


class ApiError:
    """One kind of error answer: status, plinth's message, and a stable OpenAI-style code."""

    __slots__ = ("status", "message", "code", "body", "headers")

    def __init__(self, status: int, message: str, code: str, error_type: str = "") -> None:
        self.status = status
        self.message = message
        self.code = code
        error_type = error_type or ("invalid_request_error" if status < 500 else "server_error")
        self.body = msgspec.json.encode({"error": {"message": message, "type": error_type, "code": code}})
        self.headers: Headers = [(b"content-type", b"application/json"), (b"x-content-type-options", b"nosniff")]


NOT_FOUND = ApiError(404, "404 page not found", "not_found")
METHOD_NOT_ALLOWED = ApiError(405, "Method Not Allowed", "method_not_allowed")
REQUEST_TOO_LARGE = ApiError(413, "request body too large", "request_too_large")
REQUEST_TIMEOUT = ApiError(408, "request body not received in time", "request_timeout")
INVALID_BODY = ApiError(400, "invalid request body", "invalid_request_body")
MODEL_NAME_TOO_LONG = ApiError(
    400, f"model name longer than {MAX_MODEL_NAME_LENGTH} characters", "model_name_too_long"
)
NO_MODEL = ApiError(400, "model not specified and no default model is configured", "model_not_specified")
NO_HEALTHY_NODE = ApiError(503, routing.NO_HEALTHY_NODE, "no_healthy_node")
NO_REACHABLE_NODE = ApiError(503, routing.NO_REACHABLE_NODE, "no_reachable_node")
UPSTREAM_ERROR = ApiError(502, "upstream node error", "upstream_error")
UPSTREAM_TIMEOUT = ApiError(504, "upstream node did not answer in time", "upstream_timeout")
"""A node passed `first_byte_timeout` or `response_timeout`, and the request is not retried
(`gateway.retry_unanswered` is off)."""
PREFILL_WITHOUT_KV_TRANSFER_PARAMS = ApiError(
    502, "prefill answer without kv_transfer_params", "prefill_without_kv_transfer_params"
)
"""Every prefill node tried answered without what the decode leg needs (no KV connector on it)."""
STREAM_TERMINATED = ApiError(502, "stream terminated by upstream failure", "upstream_error")
"""Not a response: the error event that ends a stream the node cut short after commit."""
QUEUE_IS_FULL = ApiError(
    429, "too many requests waiting: every node is saturated and the gateway's queue is full", "rate_limit_exceeded",
    "requests",
)
"""The admission queue (`dataplane.admission.queue`) is full, in all or for the tenant: OpenAI's shape
of a rate limit, which the SDKs retry after `Retry-After`."""
QUEUE_DEADLINE_PASSED = ApiError(
    503, "every node is saturated: the request waited max_queue_seconds in the gateway's queue", "queue_timeout"
)
"""A request waited in the admission queue until its `max_queue_seconds`."""
RETRY_AFTER = (b"retry-after", b"1")
RETRY_AFTER_MS = (b"retry-after-ms", b"1000")
"""The same second as the OpenAI SDKs read it first (they retry a 503 after it)."""
"""Sent with the queue's refusals (it changes as fast as requests end) and with a 503 for an
adapter being loaded."""
SHUTTING_DOWN = ApiError(503, "stream ended: the gateway is shutting down", "gateway_shutting_down")
"""Not a response: the error event that ends a stream still open when the shutdown grace ends."""


def model_not_found(model: str, rings: tuple[str, ...] = ()) -> ApiError:
    """vLLM's answer for a model it does not serve (an error SDKs do not retry); with the `rings`
    whose nodes list it (`routing.rings_listing`), what routes it there."""
    message = f"The model `{model}` does not exist."
    if rings:
        listed = ", ".join(f"`{ring}`" for ring in rings)
        message += (
            f" Only nodes of ring {listed} list it, and a ring's nodes serve only the models"
            f" [[models.available]] routes to the ring (name = `{model}`, ring = `{rings[0]}`)."
        )
    return ApiError(404, message, "model_not_found", "NotFoundError")


def adapter_not_listed(model: str, node: str, ip: str) -> ApiError:
    """A request for a LoRA adapter that a node answered as loaded and then did not list (no
    node serves it): the gateway asks the load again after a back-off (`controlplane.rules.adapters`)."""
    return ApiError(
        503,
        f"LoRA adapter `{model}` was loaded onto node {node} ({ip}), which does not list it: the load is asked again",
        "adapter_not_listed",
    )


def adapter_loading(model: str) -> ApiError:
    """A request for a LoRA adapter no node serves yet while the gateway loads it onto one
    (`controlplane.rules.adapters`): a 503 the SDKs retry, after its Retry-After."""
    return ApiError(503, f"LoRA adapter `{model}` is being loaded onto a node", "adapter_loading")


def error_reply(error: ApiError, *extra: tuple[bytes, bytes], close: bool = False) -> Reply:
    """The JSON error reply, with the `extra` headers; `close` adds `Connection: close`, for
    errors answered before the request body was fully read (hypercorn wedges a keep-alive
    connection otherwise)."""
    headers = [*error.headers, *extra]
    if close:
        headers.append((b"connection", b"close"))
    return Reply(error.status, headers, error.body)


def refusal(error: ApiError, request_id: str, *extra: tuple[bytes, bytes]) -> Refusal:
    """The gateway's `error` for request `request_id`, as a stage's refusal."""
    return Refusal(error_reply(error, request_id_header(request_id), *extra))

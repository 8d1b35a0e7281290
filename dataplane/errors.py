"""The gateway's error responses: OpenAI-style JSON whose message is plinth's exact text.

`{"error": {"message": …, "type": …, "code": …}}` keeps the OpenAI SDKs' error handling working,
and the message is the text plinth answered with (`no healthy node available`, …), so alerts that
match on it keep working too. Each error is a constant with its body encoded once.
"""

from __future__ import annotations

import msgspec
from quart import Response

from controlplane import routing


class ApiError:
    """One kind of error answer: status, plinth's message, and a stable OpenAI-style code."""

    __slots__ = ("status", "message", "code", "body")

    def __init__(self, status: int, message: str, code: str) -> None:
        self.status = status
        self.message = message
        self.code = code
        error_type = "invalid_request_error" if status < 500 else "server_error"
        self.body = msgspec.json.encode({"error": {"message": message, "type": error_type, "code": code}})


NOT_FOUND = ApiError(404, "404 page not found", "not_found")
METHOD_NOT_ALLOWED = ApiError(405, "Method Not Allowed", "method_not_allowed")
REQUEST_TOO_LARGE = ApiError(413, "request body too large", "request_too_large")
INVALID_BODY = ApiError(400, "invalid request body", "invalid_request_body")
NO_MODEL = ApiError(400, "model not specified and no default model is configured", "model_not_specified")
NO_HEALTHY_NODE = ApiError(503, routing.NO_HEALTHY_NODE, "no_healthy_node")
NO_REACHABLE_NODE = ApiError(503, routing.NO_REACHABLE_NODE, "no_reachable_node")
UPSTREAM_ERROR = ApiError(502, "upstream node error", "upstream_error")


def error_response(error: ApiError, *, close: bool = False, headers: dict[str, str] | None = None) -> Response:
    """The JSON error response; `close` adds `Connection: close`, for errors answered before the
    request body was fully read (hypercorn wedges a keep-alive connection otherwise)."""
    response = Response(error.body, status=error.status, content_type="application/json")
    response.headers["X-Content-Type-Options"] = "nosniff"
    if close:
        response.headers["Connection"] = "close"
    if headers:
        response.headers.update(headers)
    return response

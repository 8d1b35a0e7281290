"""Client API keys: which requests the API listener serves (`gateway.api_key_hashes`).

A key is never kept: the config holds SHA-256 hex digests, and a presented key is hashed and
compared with every digest in constant time (`hmac.compare_digest`, no early exit), so neither
the answer's timing nor anything logged tells how close a wrong key came.
"""

from __future__ import annotations

import hashlib
import hmac

from dataplane.errors import ApiError, Reply, error_reply

UNAUTHORIZED = ApiError(
    401,
    "Incorrect or missing API key: send it as `Authorization: Bearer <key>`.",
    "invalid_api_key",
)
"""OpenAI's 401 shape (`invalid_request_error`, code `invalid_api_key`), which the SDKs raise as
AuthenticationError and do not retry."""


def unauthorized_reply() -> Reply:
    """The 401 with its challenge; the connection is closed, as the request body is left unread."""
    return error_reply(UNAUTHORIZED, (b"www-authenticate", b"Bearer"), close=True)

_BEARER = b"bearer "


def key_tenant(headers: list[tuple[bytes, bytes]], digests: tuple[tuple[bytes, str], ...]) -> str | None:
    """The tenant whose key the request's `Authorization: Bearer <key>` holds, None when it holds
    no accepted key. `digests` pairs each accepted digest with its tenant."""
    presented = None
    for name, value in headers:
        if name == b"authorization":
            presented = value
            break
    if presented is None or presented[: len(_BEARER)].lower() != _BEARER:
        return None
    digest = hashlib.sha256(presented[len(_BEARER) :].strip()).hexdigest().encode()
    tenant = None
    for candidate, owner in digests:
        if hmac.compare_digest(digest, candidate):
            tenant = owner
    return tenant

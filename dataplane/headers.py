"""The headers a proxied request carries: the client's as forwarded to the node, and the node's
as returned to the client, with the ones the gateway sets itself (X-Request-Id, X-Interlock-Node,
X-Interlock-Replica, X-Forwarded-For)."""

from __future__ import annotations

from events.config import NodeConfig
from transport.http11 import Response as UpstreamResponse

Headers = list[tuple[bytes, bytes]]

_HOP_BY_HOP = frozenset(
    (
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    )
)
_NOT_FORWARDED = _HOP_BY_HOP | {b"host", b"content-length", b"x-forwarded-for", b"x-request-id"}
"""Request headers that describe the client's connection, or that the gateway (or its HTTP
client: Host and Content-Length) sets itself."""
_NOT_RETURNED = _HOP_BY_HOP | {b"date", b"x-request-id", b"x-interlock-node", b"x-interlock-replica"}
"""Response headers that describe the node's connection, or that the gateway sets itself
(hypercorn writes the Date)."""
_NOT_RETURNED_WITH_BODY = _NOT_RETURNED | {b"content-length"}


def request_id_header(request_id: str) -> tuple[bytes, bytes]:
    """The X-Request-Id header, as forwarded to the node and returned to the client."""
    return (b"x-request-id", request_id.encode("latin-1"))


def served_by_headers(node: NodeConfig, replica: str) -> Headers:
    """`X-Interlock-Node`: the node's configured name, or its IP when the name is empty or not
    printable ASCII (which a header cannot carry as it is); and in a fleet `X-Interlock-Replica`,
    the replica's name (built once per config, never per request)."""
    named = node.name and node.name.isascii() and node.name.isprintable()
    headers = [(b"x-interlock-node", (node.name if named else node.ip).encode("ascii", "replace"))]
    if replica:
        headers.append((b"x-interlock-replica", replica.encode()))  # validated: letters, digits, ., -, _
    return headers


def forward_headers(raw: Headers, client_ip: str, request_id: str) -> Headers:
    """The client's headers as a reverse proxy forwards them: hop-by-hop ones (and those the
    Connection header names) removed, X-Forwarded-For extended, X-Request-Id set."""
    named = {token.strip().lower() for name, value in raw if name == b"connection" for token in value.split(b",")}
    headers = [(name, value) for name, value in raw if name not in _NOT_FORWARDED and name not in named]
    prior = [value for name, value in raw if name == b"x-forwarded-for"]
    forwarded_for = client_ip.encode()
    if prior:
        forwarded_for = b", ".join(prior) + b", " + forwarded_for
    headers.append((b"x-forwarded-for", forwarded_for))
    headers.append(request_id_header(request_id))
    return headers


def client_headers(upstream: UpstreamResponse, request_id: str, served_by: Headers, *, with_length: bool) -> Headers:
    """The node's headers (names lower-case) for the client, less those its Connection header
    names, with the request id and the node's and replica's names (`served_by_headers`); a
    complete body is sent with its own Content-Length."""
    dropped = _NOT_RETURNED if with_length else _NOT_RETURNED_WITH_BODY
    if upstream.connection_options:
        dropped = dropped.union(upstream.connection_options)
    headers = [(name, value) for name, value in upstream.headers if name not in dropped]
    headers.append(request_id_header(request_id))
    headers.extend(served_by)
    return headers

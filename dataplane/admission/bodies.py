"""The rewrites admission makes of a request's body: usage asked of a token-counted stream, a
`max_tokens` for a token-counted generation that names none, and the priority a node with
priority scheduling gets. Only the members named are rewritten; every other member keeps its
exact bytes. A body that is not a JSON object goes as it is (the node answers it)."""

from __future__ import annotations

import msgspec


class _StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


_decode_members = msgspec.json.Decoder(dict[str, msgspec.Raw])
_decode_stream_options = msgspec.json.Decoder(_StreamOptions | None)
_encode = msgspec.json.Encoder().encode


def with_include_usage(body: bytes) -> bytes | None:
    """The body with `stream_options.include_usage` true, or None when the client asked for
    usage itself (or the body is not one to rewrite)."""
    try:
        members = _decode_members.decode(body)
        options_raw = members.get("stream_options")
        options = _decode_stream_options.decode(options_raw) if options_raw is not None else None
        if options is not None and options.include_usage:
            return None
        option_members = _decode_members.decode(options_raw) if options is not None else {}
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    option_members["include_usage"] = msgspec.Raw(b"true")
    members["stream_options"] = msgspec.Raw(_encode(option_members))
    return _encode(members)


def with_max_tokens(body: bytes, max_tokens: int) -> bytes:
    """The body with `max_tokens` set (for a generation that names no bound)."""
    try:
        members = _decode_members.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return body
    members["max_tokens"] = msgspec.Raw(b"%d" % max_tokens)
    return _encode(members)


def with_priority(body: bytes, request_rank: int) -> bytes:
    """The body with vLLM's `priority` member set to the negated `request_rank` (twice the
    admission priority, one more ahead of its priority: `saturation.rank`; vLLM handles lower
    values first). A client's own integer `priority` stays when it is not ahead of that: a client
    may lower its priority, never raise it."""
    try:
        members = _decode_members.decode(body)
        asked = msgspec.json.decode(members["priority"]) if "priority" in members else None
    except (msgspec.DecodeError, RecursionError):
        return body
    node_priority = -request_rank
    if type(asked) is int and asked >= node_priority:
        return body
    members["priority"] = msgspec.Raw(_encode(node_priority))
    return _encode(members)

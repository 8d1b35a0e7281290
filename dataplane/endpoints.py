"""The model-addressed endpoints vLLM serves, which the gateway routes, and reading a body's
`model` where it is a form field (the audio endpoints take multipart/form-data).

Every routed endpoint is routed alike (ring, each node's model list, health, policy) by the
`model` its body names; the path is forwarded as it is. The set is fixed, so the path is a
bounded label wherever it is recorded.
"""

from __future__ import annotations

ROUTED_PATHS = frozenset(
    (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/score",
        "/score",
        "/v1/rerank",
        "/rerank",
        "/v2/rerank",
        "/pooling",
        "/classify",
        "/tokenize",
        "/detokenize",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
    )
)
"""Every path a POST is routed on: vLLM's model-addressed endpoints."""

FORM_PATHS = frozenset(("/v1/audio/transcriptions", "/v1/audio/translations"))
"""The endpoints whose body is multipart/form-data (an audio file and its fields)."""

MAX_BOUNDARY_LENGTH = 70
"""RFC 2046's limit on a multipart boundary."""

MAX_FIELD_LENGTH = 1024
"""Longer `model` or `stream` field values are not read as such (the model name limit is smaller)."""


class FormFields:
    """The form fields routing reads: `model` (None when absent) and where its value lies in the
    body (`span`), and `stream`."""

    __slots__ = ("model", "span", "stream")

    def __init__(self, model: str | None, span: tuple[int, int] | None, stream: bool) -> None:
        self.model = model
        self.span = span
        self.stream = stream


def form_boundary(content_type: bytes) -> bytes | None:
    """The boundary of a `multipart/form-data` Content-Type, None for any other type."""
    kind, _, parameters = content_type.partition(b";")
    if kind.strip().lower() != b"multipart/form-data":
        return None
    for parameter in parameters.split(b";"):
        name, _, value = parameter.strip().partition(b"=")
        if name.lower() == b"boundary":
            value = value.strip().strip(b'"')
            if 0 < len(value) <= MAX_BOUNDARY_LENGTH:
                return value
    return None


def form_fields(body: bytes, boundary: bytes) -> FormFields | None:
    """The `model` and `stream` fields of a multipart body, or None when it is not one. Only the
    parts' heads and those two values are read; a file part is skipped over, never copied."""
    delimiter = b"--" + boundary
    if not body.startswith(delimiter):
        return None
    model = span = None
    stream = False
    position = len(delimiter)
    separator = b"\r\n" + delimiter
    while True:
        if body.startswith(b"--", position):
            return FormFields(model, span, stream)  # the close delimiter
        head_end = body.find(b"\r\n\r\n", position)
        end = body.find(separator, head_end + 4) if head_end >= 0 else -1
        if end < 0:
            return None
        name = _part_name(body[position:head_end])
        value_start = head_end + 4
        if name in (b"model", b"stream") and end - value_start <= MAX_FIELD_LENGTH:
            value = body[value_start:end]
            if name == b"model":
                try:
                    model, span = value.decode(), (value_start, end)
                except UnicodeDecodeError:
                    return None
            else:
                stream = value.strip().lower() == b"true"
        position = end + len(separator)


def _part_name(head: bytes) -> bytes | None:
    """The `name` of a part's `Content-Disposition: form-data; name="…"` header."""
    for line in head.split(b"\r\n"):
        header, _, value = line.partition(b":")
        if header.strip().lower() != b"content-disposition":
            continue
        for parameter in value.split(b";")[1:]:
            key, _, quoted = parameter.strip().partition(b"=")
            if key.lower() == b"name":
                return quoted.strip().strip(b'"')
    return None


def with_form_model(body: bytes, boundary: bytes, fields: FormFields, model: str) -> bytes:
    """The multipart `body` with its `model` field's value set to `model`; every other byte kept
    (a body without the field gets it as a new first part)."""
    value = model.encode()
    if fields.span is not None:
        start, end = fields.span
        return body[:start] + value + body[end:]
    part = b'--%s\r\nContent-Disposition: form-data; name="model"\r\n\r\n%s\r\n' % (boundary, value)
    return part + body

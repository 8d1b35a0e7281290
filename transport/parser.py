"""The HTTP/1.1 response parser, sans-IO (as h11 is): it is fed the bytes a connection
delivers and says what they mean; it never reads a socket, so the async client
(`transport/http11.py`) and the probes' steps (`transport/steps.py`) read responses through the
same code.

- `HeadScanner` finds a response's final head in its first bytes (interim 1xx heads skipped).
- `framing` says how the body of that response ends (`Framing`, a `BodyEnd`), and whether its
  connection can carry another response.
- `BodyReader` turns the bytes after the head into the body's data, whatever the framing.

What it refuses (ProtocolError): a response that is not well-formed HTTP/1.1 (a status outside
100-999, a header name that is not a token, a control byte in the head, line ends of a bare
LF: refused as soon as one arrives), or whose body it cannot frame (a transfer-coding other than
`chunked`, Content-Length values that disagree). tests/test_http11_against_h11.py checks it
against h11, and names where it is stricter.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from transport.errors import BodyTooLarge, ConnectionLost, ProtocolError

MAX_HEAD_BYTES = 65536
"""Largest response head (status line and headers, or a chunked body's trailers)."""
MAX_CHUNK_LINE_BYTES = 4096
"""Largest chunk-size line, extensions included."""


class BodyEnd(enum.Enum):
    """How a response's body ends (RFC 9112 §6.3)."""

    NONE = "none"
    """There is no body (a HEAD's response, 204, 304)."""
    LENGTH = "length"
    """After Content-Length bytes."""
    CHUNKED = "chunked"
    """At the last chunk."""
    UNTIL_CLOSE = "until close"
    """When the server closes the connection."""


_NONE, _LENGTH, _CHUNKED, _UNTIL_CLOSE = BodyEnd.NONE, BodyEnd.LENGTH, BodyEnd.CHUNKED, BodyEnd.UNTIL_CLOSE


@dataclass(slots=True)
class Framing:
    """What a response's head says about its body and its connection."""

    body: BodyEnd
    length: int | None
    """The declared length of a Content-Length-delimited body, else None."""
    reusable: bool
    """Whether the connection can carry another response once this one has ended."""
    options: tuple[bytes, ...]
    """The (lower-case) names the Connection header lists: headers about this connection only,
    that a proxy does not pass on (RFC 9110 §7.6.1)."""


Head = tuple[bytes, int, bytes, list[tuple[bytes, bytes]]]
"""(version, status, reason, headers) of a response head."""


# --- the head ----------------------------------------------------------------------------------


class HeadScanner:
    """Finds the final head in a response's bytes, fed as they arrive (interim 1xx responses
    skipped)."""

    __slots__ = ("_data", "_searched")

    def __init__(self) -> None:
        self._data = b""
        self._searched = 0
        """Where the next search for CRLF CRLF starts: none ends before it."""

    def feed(self, more: bytes) -> tuple[Head, bytes] | None:
        """The final head once `more` completes it, with the bytes after it; None while more
        bytes are needed. Raises ProtocolError as soon as the bytes cannot be the start of a
        response this client accepts."""
        data = self._data + more if self._data else more
        searched = self._searched
        while True:
            end = data.find(b"\r\n\r\n", searched)
            if end < 0:
                if len(data) > MAX_HEAD_BYTES:
                    raise ProtocolError(f"response head exceeds {MAX_HEAD_BYTES} bytes")
                if data and data.count(b"\n") != data.count(b"\r\n"):  # at once: no CRLF CRLF will come
                    raise ProtocolError(f"bare LF in the response head {data[:100]!r}")
                self._data, self._searched = data, max(0, len(data) - 3)
                return None
            if end > MAX_HEAD_BYTES:
                raise ProtocolError(f"response head exceeds {MAX_HEAD_BYTES} bytes")
            head = parse_head(data[:end])
            status = head[1]
            if status >= 200:
                return head, data[end + 4 :]
            if status == 101:
                raise ProtocolError("unexpected 101 Switching Protocols")
            data, searched = data[end + 4 :], 0  # 100 Continue, 103 Early Hints…


_TOKEN_BYTES = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_CONTROL_BYTE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
"""What no status or field line may hold (RFC 9110 §5.5): a control byte other than HTAB."""
_CONTROL_BYTE_IN_HEAD = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
"""The same, in a head whose CR LF line ends are checked apart."""


def parse_head(head: bytes) -> Head:
    """(version, status, reason, headers) of a response head without its final CRLF CRLF;
    header names lower-cased, values stripped. Raises ProtocolError."""
    lines = head.split(b"\r\n")
    if head.count(b"\n") != len(lines) - 1 or head.count(b"\r") != len(lines) - 1:
        raise ProtocolError("bare CR or LF in the response head")
    control = _CONTROL_BYTE_IN_HEAD.search(head)
    if control:
        raise ProtocolError(f"control byte {control.group()!r} in the response head {head[:100]!r}")
    status_line = lines[0]
    version, _, rest = status_line.partition(b" ")
    code, _, reason = rest.partition(b" ")
    if (version != b"HTTP/1.1" and version != b"HTTP/1.0") or len(code) != 3 or not code.isdigit() or code < b"100":
        raise ProtocolError(f"malformed status line {status_line[:100]!r}")
    return version, int(code), reason, [_field_line(line) for line in lines[1:]]


def _field_line(line: bytes) -> tuple[bytes, bytes]:
    """(lower-case name, stripped value) of a header or trailer line whose bytes are checked
    already. Raises ProtocolError."""
    name, colon, value = line.partition(b":")
    if not colon or not name or name.translate(None, _TOKEN_BYTES):
        raise ProtocolError(f"malformed header line {line[:100]!r}")
    return name.lower(), value.strip(b" \t")


def framing(method: bytes, version: bytes, status: int, headers: list[tuple[bytes, bytes]]) -> Framing:
    """How the body of a response to `method` with this head ends, and what its connection can do next."""
    reusable = version == b"HTTP/1.1"
    lengths: list[bytes] = []
    codings: list[bytes] = []
    options: tuple[bytes, ...] = ()
    for name, value in headers:
        if name == b"content-length":
            lengths.append(value)
        elif name == b"transfer-encoding":
            codings.append(value)
        elif name == b"connection":
            tokens = tuple(token.strip().lower() for token in value.split(b","))
            options += tokens
            if b"close" in tokens:
                reusable = False
            elif b"keep-alive" in tokens and version == b"HTTP/1.0":
                reusable = True
    if codings and (len(codings) > 1 or codings[0].lower() != b"chunked"):
        # Any other coding would reach the caller still encoded.
        raise ProtocolError(f"unsupported Transfer-Encoding {b', '.join(codings)[:100]!r} (only chunked is)")
    length = _content_length(lengths) if lengths else None
    if method == b"HEAD" or status == 304:
        return Framing(_NONE, None, reusable, options)
    if status == 204:
        # It has no body; one that declares one may send it anyway, and its bytes would be read
        # as the next response on this connection.
        return Framing(_NONE, None, reusable and not codings and not length, options)
    if codings:
        # Transfer-Encoding overrides Content-Length; a message with both is one a request
        # smuggler could have built: its connection is not reused.
        return Framing(_CHUNKED, None, reusable and length is None, options)
    if length is not None:
        return Framing(_LENGTH, length, reusable, options)
    return Framing(_UNTIL_CLOSE, None, False, options)


def _content_length(values: list[bytes]) -> int:
    """The length Content-Length headers declare: repeated or listed values must agree (RFC 9110 §8.6)."""
    if len(values) == 1 and values[0].isdigit():
        return int(values[0])
    distinct = {part.strip() for value in values for part in value.split(b",")}
    length = distinct.pop()
    if distinct or not length.isdigit():
        raise ProtocolError(f"bad Content-Length {b', '.join(values)[:100]!r}")
    return int(length)


# --- the body ----------------------------------------------------------------------------------


class BodyReader:
    """A body's bytes, fed as they arrive, turned into its data whatever its framing.

    The loop that drives it: `read()`; if it returned data, hand it on; once `done`, the body is
    complete; otherwise `feed()` the next bytes from the connection (b"" when the server closed
    it) and `read()` again.
    """

    __slots__ = ("body", "length", "done", "stray", "_buffer", "_left", "_received", "_chunks", "_limit", "_read")

    def __init__(self, framing: Framing, data: bytes) -> None:
        """`data`: the bytes that came after the head."""
        self.body = framing.body
        self.length = framing.length
        self.done = False
        """The body is complete."""
        self.stray = False
        """Bytes came that the framing does not account for (after the body, or a body where
        none may be): the connection is out of step."""
        self._left = self.length or 0
        """The bytes of a Content-Length body not read yet."""
        self._received = 0
        self._limit: int | None = None
        self._read = 0
        """The body's bytes returned by `read` so far (counted only with a limit)."""
        self._chunks: _ChunkDecoder | None = None
        if self.body is _CHUNKED:
            self._chunks = _ChunkDecoder(data)
            data = b""
        elif self.body is _NONE or (self.body is _LENGTH and not self._left):
            self.done = True
            self.stray = bool(data)
            data = b""
        self._buffer = data

    def limit(self, limit: int) -> None:
        """Refuse (BodyTooLarge) a body larger than `limit` bytes: now if its Content-Length
        says so, else as soon as the data read, or a chunk's declared size, takes it past."""
        if self.length is not None and self.length > limit:
            raise BodyTooLarge(limit)
        self._limit = limit
        if self._chunks is not None:
            self._chunks.limit = limit

    def read(self) -> bytes:
        """The body's data among the bytes fed so far; b"" if there is none (then `done`, or
        more bytes are needed)."""
        chunks = self._chunks
        if chunks is not None:
            data = chunks.decode()
            if chunks.state is _END:
                self.done = True
                self.stray = chunks.position < len(chunks.buffer)
        else:
            data, self._buffer = self._buffer, b""
            if data and self.body is _LENGTH:
                if len(data) >= self._left:
                    if len(data) > self._left:
                        data = data[: self._left]
                        self.stray = True
                    self.done = True
                self._left -= len(data)
                self._received += len(data)
        if self._limit is not None and data:
            self._read += len(data)
            if self._read > self._limit:
                raise BodyTooLarge(self._limit)
        return data

    def feed(self, more: bytes) -> None:
        """The next bytes from the connection, once `read` has returned b"" and the body is not
        `done`; b"" when the server has closed it. Raises ConnectionLost if the body is cut short."""
        if more:
            if self._chunks is not None:
                self._chunks.feed(more)
            else:
                self._buffer = more
        elif self.body is _UNTIL_CLOSE:
            self.done = True
        elif self.body is _LENGTH:
            raise ConnectionLost(f"connection closed after {self._received} of {self.length} body bytes")
        else:
            raise ConnectionLost("connection closed in the middle of a chunked body")


class _ChunkPart(enum.Enum):
    """Where a chunked decoder is."""

    SIZE = "at a size line"
    DATA = "in a chunk's data"
    DATA_END = "at the CRLF after a chunk's data"
    TRAILERS = "in the trailers"
    END = "past the end"


_SIZE, _DATA, _DATA_END, _TRAILERS, _END = _ChunkPart
_HEX_DIGITS = b"0123456789abcdefABCDEF"


class _ChunkDecoder:
    """A chunked body's bytes, fed as they arrive, decoded into its data (RFC 9112 §7.1); the
    trailers are checked, then dropped."""

    __slots__ = ("buffer", "position", "state", "left", "trailer_bytes", "limit", "declared")

    def __init__(self, data: bytes) -> None:
        self.buffer = data
        self.position = 0
        """Where the bytes not decoded yet start in `buffer` (once `state` is END: the bytes after the body)."""
        self.state = _SIZE
        self.left = 0
        """The bytes of the current chunk's data not decoded yet."""
        self.trailer_bytes = 0
        self.limit: int | None = None
        """A size line that takes the body past it is refused (BodyTooLarge); None: no limit."""
        self.declared = 0
        """The sizes of the chunks read so far, added up."""

    def feed(self, more: bytes) -> None:
        rest = self.buffer[self.position :]
        self.buffer, self.position = (rest + more if rest else more), 0

    def decode(self) -> bytes:
        """Decode what the buffer holds; the data found (b"" if none: more bytes are needed,
        unless `state` is END)."""
        buffer, position, end = self.buffer, self.position, len(self.buffer)
        pieces = []
        state = self.state
        while position < end:
            if state is _DATA:
                taken = min(self.left, end - position)
                pieces.append(buffer[position : position + taken])
                position += taken
                self.left -= taken
                if not self.left:
                    state = _DATA_END
            elif state is _DATA_END:
                if end - position < 2:
                    break
                if not buffer.startswith(b"\r\n", position):
                    raise ProtocolError("chunk data not followed by CRLF")
                position += 2
                state = _SIZE
            elif state is _SIZE:
                line_end = buffer.find(b"\r\n", position, position + MAX_CHUNK_LINE_BYTES)
                if line_end < 0:
                    if end - position >= MAX_CHUNK_LINE_BYTES:
                        raise ProtocolError(f"chunk size line exceeds {MAX_CHUNK_LINE_BYTES} bytes")
                    break
                self.left = _chunk_size(buffer[position:line_end])
                self.declared += self.left
                if self.limit is not None and self.declared > self.limit:
                    raise BodyTooLarge(self.limit)
                position = line_end + 2
                state = _DATA if self.left else _TRAILERS
            elif state is _TRAILERS:
                line_end = buffer.find(b"\r\n", position)
                if line_end < 0:
                    if self.trailer_bytes + end - position > MAX_HEAD_BYTES:
                        raise ProtocolError(f"chunked trailers exceed {MAX_HEAD_BYTES} bytes")
                    break
                self.trailer_bytes += line_end + 2 - position
                if self.trailer_bytes > MAX_HEAD_BYTES:
                    raise ProtocolError(f"chunked trailers exceed {MAX_HEAD_BYTES} bytes")
                if line_end == position:
                    position += 2
                    state = _END
                    break
                trailer = buffer[position:line_end]
                if _CONTROL_BYTE.search(trailer):
                    raise ProtocolError(f"control byte in the chunked trailers {trailer[:100]!r}")
                _field_line(trailer)  # checked, then dropped
                position = line_end + 2
            else:
                break
        self.buffer, self.position, self.state = buffer, position, state
        if len(pieces) == 1:
            return pieces[0]
        return b"".join(pieces)


def _chunk_size(line: bytes) -> int:
    size, semicolon, extensions = line.partition(b";")  # extensions are ignored
    if not semicolon:
        size = size.rstrip(b" \t")
    elif extensions.find(b"\n") >= 0 or extensions.find(b"\r") >= 0:
        raise ProtocolError(f"bare CR or LF in chunk size line {line[:100]!r}")
    if not size or len(size) > 16 or size.strip(_HEX_DIGITS):
        raise ProtocolError(f"bad chunk size line {line[:100]!r}")
    return int(size, 16)

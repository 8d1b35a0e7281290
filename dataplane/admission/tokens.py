"""The tokens of a tenant with `tokens_per_minute`: what admission reserves, what the node says
it used, and what a stream relayed.

The reservation is the completion's bound plus the body's length over PROMPT_BYTES_PER_TOKEN
for the prompt. The bound is the body's `max_completion_tokens` or `max_tokens`; a generation
that names neither gets a `max_tokens` (`admission.bodies.with_max_tokens`) of
`[admission] default_max_tokens`, or less when the tenant's remaining tokens allow less
(`completion_bound`): so the reservation bounds what the node generates.

The request settles to the node's `usage` (`usage_tokens` for a whole answer, `UsageTap` for a
stream). A stream without the usage chunk (the client left, or the node sent none) is charged
what it relayed: the prompt's estimate and one token per event passed on, never less.
"""

from __future__ import annotations

import msgspec

PROMPT_BYTES_PER_TOKEN = 4
"""The prompt's estimate at admission: a token per this many bytes of body (English text and
JSON run near it; the settlement corrects it)."""

MAX_HELD_EVENT_BYTES = 1 << 20
"""An event of a token-counted stream is held back until it ends (to read its usage); one
longer than this cuts the stream (`EventTooLarge`), as a node failure does."""


class _TokenFields(msgspec.Struct):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


_decode_token_fields = msgspec.json.Decoder(_TokenFields)


def named_bound(body: bytes) -> int | None:
    """The completion's bound the body names (`max_completion_tokens`, else `max_tokens`);
    None when it names none (or is not a JSON object to read)."""
    try:
        fields = _decode_token_fields.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    return fields.max_completion_tokens or fields.max_tokens or None


def prompt_estimate(body: bytes) -> int:
    return len(body) // PROMPT_BYTES_PER_TOKEN


def completion_bound(body: bytes, default: int, remaining: int | None) -> int:
    """The `max_tokens` given to a generation that names none: `default`, or what the tenant's
    `remaining` tokens leave after the prompt's estimate, at least 1."""
    if remaining is None:
        return default
    return max(1, min(default, remaining - prompt_estimate(body)))


def reservation(body: bytes, completion: int, limit: int) -> int:
    """Tokens reserved at admission: the completion's bound and the prompt's estimate, at most
    the limit."""
    return max(1, min(limit, completion + prompt_estimate(body)))


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int | None = None

    def tokens(self) -> int:
        used = self.total_tokens if self.total_tokens is not None else self.prompt_tokens + self.completion_tokens
        return max(0, used)


class _WithUsage(msgspec.Struct):
    usage: _Usage | None = None


class _UsageChunk(msgspec.Struct):
    choices: list[msgspec.Raw] | None = None
    usage: _Usage | None = None


_decode_with_usage = msgspec.json.Decoder(_WithUsage)
_decode_usage_chunk = msgspec.json.Decoder(_UsageChunk)


def usage_tokens(body: bytes) -> int | None:
    """The prompt plus completion tokens of a complete answer's `usage`, if it has one."""
    try:
        usage = _decode_with_usage.decode(body).usage
    except (msgspec.DecodeError, RecursionError):
        return None
    return None if usage is None else usage.tokens()


class EventTooLarge(Exception):
    """A stream's event outgrew MAX_HELD_EVENT_BYTES unfinished: the relay ends it."""

    def __init__(self) -> None:
        super().__init__(f"stream event longer than {MAX_HELD_EVENT_BYTES} bytes")


_EVENT_END = b"\n\n"


class UsageTap:
    """Reads a stream's usage chunk (`choices` empty, `usage` set) as the events go by, and
    counts the events it lets through; with `strip`, leaves the usage chunk out of what the
    client gets (the gateway asked for it, not the client), and holds back only an event not
    yet complete. Every other byte goes on unchanged.

    The event held back is bounded (MAX_HELD_EVENT_BYTES) and each piece is scanned once: the
    search for an event's end starts where the previous piece ended."""

    __slots__ = ("strip", "tokens", "events", "_pending", "_cut")

    def __init__(self, strip: bool) -> None:
        self.strip = strip
        self.tokens: int | None = None
        """The usage chunk's total, once it has gone by."""
        self.events = 0
        """The events that went by complete (each at least one token, the last `[DONE]`)."""
        self._pending = bytearray()
        self._cut = False
        """An event outgrew its bound: what is held back is dropped, the rest goes on as it is
        (the relay's error event)."""

    def feed(self, piece: bytes) -> bytes:
        """What of `piece` goes to the client now; EventTooLarge when the event held back
        outgrows its bound."""
        if self._cut:
            return piece
        pending = self._pending
        if pending:
            start = len(pending) - 1  # an event's end may straddle the two
            pending += piece
            end = pending.find(_EVENT_END, start)
            if end < 0:
                if len(pending) > MAX_HELD_EVENT_BYTES:
                    raise self._too_large()
                return b"" if self.strip else piece
            end = pending.rfind(_EVENT_END, end) + len(_EVENT_END)
            complete = bytes(pending[:end])
            del pending[:end]
        else:
            end = piece.rfind(_EVENT_END)
            if end < 0:
                pending += piece
                if len(pending) > MAX_HELD_EVENT_BYTES:
                    raise self._too_large()
                return b"" if self.strip else piece
            end += len(_EVENT_END)
            if end == len(piece):
                complete = piece
            else:
                complete = piece[:end]
                pending += piece[end:]
        self.events += complete.count(_EVENT_END)
        if b'"prompt_tokens"' not in complete:
            return piece if not self.strip else complete
        kept = []
        for event in complete.split(_EVENT_END)[:-1]:
            if self._is_usage(event) and self.strip:
                continue
            kept.append(event + _EVENT_END)
        return piece if not self.strip else b"".join(kept)

    def finish(self) -> bytes:
        """What is left held back when the stream ends (an unfinished event, unchanged)."""
        rest = bytes(self._pending)
        self._pending.clear()
        return rest if self.strip else b""

    def relayed(self, prompt: int) -> int:
        """The tokens charged without a usage chunk: the prompt's estimate and one per event
        relayed."""
        return prompt + self.events

    def _too_large(self) -> EventTooLarge:
        self._cut = True
        self._pending.clear()
        return EventTooLarge()

    def _is_usage(self, event: bytes) -> bool:
        if b'"prompt_tokens"' not in event:
            return False
        data = event.partition(b"data:")[2].strip()
        try:
            chunk = _decode_usage_chunk.decode(data)
        except (msgspec.DecodeError, RecursionError):
            return False
        if chunk.usage is None:
            return False
        self.tokens = chunk.usage.tokens()
        return not chunk.choices

"""The prompt prefix `prefix_affinity` routes by, as a short hash.

A chat request's prefix is its first `prefix_messages` messages (0: all of them), each as its
role and its text (a content given as parts: the text parts, in order), joined by newlines and cut
to `prefix_bytes` bytes; a completion's is the first `prefix_bytes` bytes of its prompt (of a
batch: its first prompt; token ids: written out in decimal). Requests whose prompts start alike
(a shared system prompt, the earlier turns of a conversation) get the same hash, and vLLM's
prefix cache holds what they share. Only the hash goes further (decision records, the policy);
never the prompt. A body whose prompt has another shape has no prefix ("").
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec


class _Message(msgspec.Struct):
    role: Any = None
    content: Any = None


class _ChatPrompt(msgspec.Struct):
    messages: list[_Message] | None = None


class _CompletionPrompt(msgspec.Struct):
    prompt: Any = None


_decode_chat = msgspec.json.Decoder(_ChatPrompt)
_decode_completion = msgspec.json.Decoder(_CompletionPrompt)


def prompt_prefix(path: str, body: bytes, *, messages: int, limit: int) -> str:
    """The hash (16 hex digits) of the prompt's prefix, or "" when the body has no prompt we read."""
    try:
        if path == "/v1/chat/completions":
            text = _chat_text(_decode_chat.decode(body).messages or [], messages)
        else:
            text = _completion_text(_decode_completion.decode(body).prompt)
    except msgspec.DecodeError:  # ValidationError too: a shape for the node to reject, not us
        return ""
    if not text:
        return ""
    cut = text.encode("utf-8", "surrogatepass")[:limit]
    return hashlib.blake2b(cut, digest_size=8).hexdigest()


def _chat_text(chat: list[_Message], first: int) -> str:
    return "\n".join(f"{_text(message.role)}\n{_text(message.content)}" for message in chat[: first or None])


def _completion_text(prompt: Any) -> str:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, list):
        return " ".join(str(token) for token in prompt if isinstance(token, int))
    return prompt if isinstance(prompt, str) else ""


def _text(value: Any) -> str:
    """A role or a content as text: a string itself, a list of parts their `text` members."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(part["text"] for part in value if isinstance(part, dict) and isinstance(part.get("text"), str))
    return ""

"""Prefill/decode disaggregation, vLLM's NixlConnector protocol (the one vLLM's own
disaggregation proxy and vllm-router speak): the two legs' request bodies, and what the prefill
node's answer must give the decode leg.

- The prefill leg: the client's request with `stream: false`, `max_tokens: 1` (and
  `max_completion_tokens: 1` when it has one), no `stream_options`, and `kv_transfer_params`
  asking for a remote decode. The node computes the prompt's KV cache, keeps its blocks, and
  answers with the `kv_transfer_params` a decode node needs to fetch them.
- The decode leg: the client's request as it came, plus those `kv_transfer_params`. Its answer,
  streamed or not, is the client's.

Only the members named are rewritten; every other member keeps its exact bytes.
"""

from __future__ import annotations

import msgspec

from dataplane.errors import PREFILL_WITHOUT_KV_TRANSFER_PARAMS

GENERATION_PATHS = frozenset(("/v1/chat/completions", "/v1/completions"))
"""The endpoints served in two legs when a model's nodes are disaggregated; the others go whole
to a node that serves both (or either) leg."""

MAX_PREFILL_ANSWER_BYTES = 1 << 20
"""A prefill answer (one token) larger than this is a failure of the leg, not held in memory."""

_REMOTE_DECODE = msgspec.Raw(
    b'{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,'
    b'"remote_block_ids":null,"remote_host":null,"remote_port":null}'
)
_FALSE = msgspec.Raw(b"false")
_ONE = msgspec.Raw(b"1")

_decode_members = msgspec.json.Decoder(dict[str, msgspec.Raw] | None)
_encode = msgspec.json.Encoder()


class PrefillWithoutKvTransferParams(Exception):
    """The prefill node answered 200 without `kv_transfer_params` (a node run without the KV
    connector) or without JSON that gives them: its leg failed, and the next prefill node is
    tried."""

    def __init__(self, why: str = PREFILL_WITHOUT_KV_TRANSFER_PARAMS.message) -> None:
        super().__init__(why)


def prefill_body(body: bytes) -> bytes:
    """The prefill leg's body, from the client's (a JSON object: routing decoded it already)."""
    members = _decode_members.decode(body) or {}
    members.pop("stream_options", None)
    members["stream"] = _FALSE
    members["max_tokens"] = _ONE
    if "max_completion_tokens" in members:
        members["max_completion_tokens"] = _ONE
    members["kv_transfer_params"] = _REMOTE_DECODE
    return _encode.encode(members)


def decode_body(body: bytes, kv_transfer_params: msgspec.Raw) -> bytes:
    """The decode leg's body: the client's, with the prefill node's `kv_transfer_params`."""
    members = _decode_members.decode(body) or {}
    members["kv_transfer_params"] = kv_transfer_params
    return _encode.encode(members)


_NULL = msgspec.Raw(b"null")


class _PrefillAnswer(msgspec.Struct):
    kv_transfer_params: msgspec.Raw = _NULL  # msgspec takes no Raw in a union


_decode_answer = msgspec.json.Decoder(_PrefillAnswer)


def kv_transfer_params(answer: bytes) -> msgspec.Raw:
    """The `kv_transfer_params` object of a prefill node's 200 answer; PrefillWithoutKvTransferParams
    when it has none (absent, null, or not an object), or is not JSON, or is nested deeper than
    msgspec decodes (its depth bound is Python's recursion limit)."""
    try:
        params = _decode_answer.decode(answer).kv_transfer_params
    except msgspec.DecodeError:
        raise PrefillWithoutKvTransferParams() from None
    except RecursionError:
        raise PrefillWithoutKvTransferParams("prefill answer nested too deep to decode") from None
    if not bytes(params).startswith(b"{"):
        raise PrefillWithoutKvTransferParams()
    return params

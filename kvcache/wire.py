"""vLLM's KV events as they come over ZeroMQ (`vllm/distributed/kv_events.py`), decoded.

A node started with `--kv-events-config` publishes on a PUB socket, one multipart message per
batch: the topic, the batch's sequence number (8 bytes, big-endian, from 0 at the node's
start), and a msgpack `KVEventBatch`: `[ts, [event, …], data_parallel_rank]`. Each event is a
tagged msgspec struct, `BlockStored`, `BlockRemoved` or `AllBlocksCleared`: a tagged array
(`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, …]`)
up to vLLM 0.23, a map with its tag under "type" since (vLLM #42892). Both decode here (and a
batch sent as a map, as vLLM's `EventBatch` without `array_like` would), and fields a newer
vLLM adds are ignored (trailing array elements, unknown map keys).

Its ROUTER replay socket answers `[b"", start_seq]` (8 bytes, big-endian) with every batch it
still buffers from `start_seq` on, each `[b"", seq, payload]`, then `[b"", -1, b""]`.

Bounded: a batch is at most MAX_BATCH_BYTES, and what does not decode is a `WireError` (a
whole message) or counted in `KvBatch.undecoded` (one event among others): never a crash.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvcache.blocks import TOKEN_ID_LIMIT

MAX_BATCH_BYTES = 16 * 1024 * 1024
"""The largest batch accepted (vLLM's batches are one engine step's events)."""

SEQ_BYTES = 8
REPLAY_END = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
"""The sequence number frame of the replay socket's last answer to a request (with an empty
payload): -1, where batches are numbered from 0 up, unsigned."""

BlockHash = int | Annotated[bytes, msgspec.Meta(max_length=64)]
"""vLLM's hash of a block: an int, or (vLLM's `ExternalBlockHash` without
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`) its bytes."""
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=TOKEN_ID_LIMIT)]


class WireError(Exception):
    """A message that is not a KV event batch as vLLM sends it."""


class BlockStored(msgspec.Struct, tag="BlockStored", frozen=True):
    """Consecutive full blocks the node stored: `token_ids` fill `block_hashes`' blocks, the
    first a child of `parent_block_hash` (None: at a prompt's start)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[TokenId]
    block_size: Annotated[int, msgspec.Meta(ge=1)]
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", frozen=True):
    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", frozen=True):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class _BlockStoredArray(BlockStored, array_like=True, frozen=True):
    pass


class _BlockRemovedArray(BlockRemoved, array_like=True, frozen=True):
    pass


class _AllBlocksClearedArray(AllBlocksCleared, array_like=True, frozen=True):
    pass


class _Batch(msgspec.Struct, frozen=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _BatchArray(_Batch, array_like=True, frozen=True):
    pass


class KvBatch(msgspec.Struct, frozen=True):
    """One batch of a node's events, in the order the node applied them."""

    seq: int
    ts: float
    events: list[KvEvent]
    undecoded: int = 0
    """Events of the batch that did not decode (a type or a shape this gateway does not know):
    left out, counted."""


_decode_array_batch = msgspec.msgpack.Decoder(_BatchArray).decode
_decode_map_batch = msgspec.msgpack.Decoder(_Batch).decode
_decode_map_event = msgspec.msgpack.Decoder(KvEvent).decode
_decode_array_event = msgspec.msgpack.Decoder(_BlockStoredArray | _BlockRemovedArray | _AllBlocksClearedArray).decode

_ARRAY_HEADS = frozenset((*range(0x90, 0xA0), 0xDC, 0xDD))
"""msgpack's first bytes of an array (fixarray, array 16, array 32); a batch or an event that
is not one is read as a map."""


def decode_payload(seq: int, payload: bytes) -> KvBatch:
    """The batch numbered `seq` from its msgpack payload. Raises WireError when it is no batch."""
    if len(payload) > MAX_BATCH_BYTES:
        raise WireError(f"a batch of {len(payload)} bytes, over {MAX_BATCH_BYTES}")
    decode_batch = _decode_array_batch if payload and payload[0] in _ARRAY_HEADS else _decode_map_batch
    try:
        batch = decode_batch(payload)
    except msgspec.DecodeError as error:
        raise WireError(f"not a KV event batch: {error}") from None
    events: list[KvEvent] = []
    undecoded = 0
    for raw in batch.events:
        data = memoryview(raw)
        decode = _decode_array_event if data and data[0] in _ARRAY_HEADS else _decode_map_event
        try:
            events.append(decode(data))
        except msgspec.DecodeError:
            undecoded += 1
    return KvBatch(seq, batch.ts, events, undecoded)


def read_seq(frame: bytes) -> int:
    """A batch's sequence number from its frame. Raises WireError unless it is 8 bytes."""
    if len(frame) != SEQ_BYTES:
        raise WireError(f"a sequence number of {len(frame)} bytes, not {SEQ_BYTES}")
    return int.from_bytes(frame, "big")


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER socket sends the replay socket for every batch from `start_seq` on."""
    return [b"", start_seq.to_bytes(SEQ_BYTES, "big")]


def decode_replayed(frames: list[bytes]) -> KvBatch | None:
    """A replay answer as a DEALER socket receives it, `[b"", seq, payload]`: the batch, or
    None for the end of the replay."""
    if len(frames) != 3 or frames[0]:
        raise WireError(f"a replay answer of {len(frames)} frames, not 3 (empty, seq, payload)")
    if frames[1] == REPLAY_END:
        return None
    return decode_payload(read_seq(frames[1]), frames[2])

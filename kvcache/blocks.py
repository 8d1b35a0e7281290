"""The gateway's own hash of a prompt's token blocks: what the KV index is keyed by.

A block's hash covers its tokens and its parent's hash, so equal hashes mean equal prefixes up
to that block. It is the gateway's, never vLLM's (whose hash depends on its version, its hash
function and a seed): the index reaches it from a `BlockStored`'s token ids and parent, and a
prompt reaches it the same way, so both sides always agree. blake2b over fixed-width
little-endian token ids: the same value in every process, on every host and run (Python's
`hash()` is salted per process).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from hashlib import blake2b

HASH_BYTES = 8
TOKEN_ID_LIMIT = 1 << 32
"""Token ids are packed as 4-byte unsigned integers: every vocabulary fits (vLLM's own ids are
indexes into the model's vocabulary)."""


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """The hash of each FULL block of `token_ids` (a last partial block has none), each chained
    to the one before it and the first to `parent` (the hash of the block before `token_ids`,
    None at a prompt's start). Raises ValueError for a token id outside 0 to 2**32-1 or a block
    size below 1."""
    if block_size < 1:
        raise ValueError(f"block size {block_size} is not positive")
    blocks = len(token_ids) // block_size
    if not blocks:
        return []
    try:
        packed = struct.pack(f"<{blocks * block_size}I", *token_ids[: blocks * block_size])
    except struct.error:
        raise ValueError(f"a token id outside 0 to {TOKEN_ID_LIMIT - 1}") from None
    width = block_size * 4
    previous = b"" if parent is None else parent.to_bytes(HASH_BYTES, "big")
    hashes: list[int] = []
    append, as_int = hashes.append, int.from_bytes  # a prompt's blocks are hashed on each request
    for start in range(0, blocks * width, width):
        previous = blake2b(previous + packed[start : start + width], digest_size=HASH_BYTES).digest()
        append(as_int(previous, "big"))
    return hashes

"""Per node, the KV cache blocks it holds, as its KV events say, and the read side the routing
policy asks: how much of a prompt each node holds.

Blocks are keyed by the gateway's chained hash (`kvcache.blocks`), built from each
`BlockStored`'s token ids and its parent; vLLM's own block hashes only map to ours, so a child
chains to its parent and a `BlockRemoved` finds what to forget. Bounded per node: past
`capacity` blocks the oldest stored is forgotten first (a forgotten block only makes a match
shorter, never wrong).

One writer per node (its subscriber's thread) and readers on any thread: a reader only looks
keys up and reads attributes, which the GIL makes whole, and a clear swaps in new tables
instead of emptying the ones a reader may be looking at.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

import msgspec

from kvcache.blocks import chain_hashes
from kvcache.wire import BlockRemoved, BlockStored, KvBatch

DEFAULT_BLOCK_SIZE = 16
"""vLLM's default `--block-size`: what a prompt is cut by until the node's first `BlockStored`
says its own."""

_INT_BYTES = sys.getsizeof(1 << 63)
"""An int object of a hash's size: each block holds three (its vLLM hash, ours, a count)."""


class KvMatch(msgspec.Struct, frozen=True):
    """How much of a prompt a node holds, as its index knew at `seq`."""

    matched: int
    """The longest chain of the prompt's full blocks, from its start, that the node holds."""
    total: int
    """The prompt's full blocks (at the node's block size)."""
    seq: int
    """The index's position: the sequence number of the last batch applied (-1: none yet)."""
    flowing: bool
    """Events are arriving and no gap is left unrepaired: the index follows the node."""


class NodeBlocks:
    """One node's blocks. Written by one thread; `match` may run on any."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.block_size = DEFAULT_BLOCK_SIZE
        self.seq = -1
        self.flowing = False
        self._ours: OrderedDict[int | bytes, int] = OrderedDict()
        """vLLM's hash → ours, oldest stored first."""
        self._held: dict[int, int] = {}
        """Our hash → how many of vLLM's hashes stand for it (its tokens stored under more
        than one vLLM hash, e.g. with another cache salt)."""
        self.unindexed = 0
        """Blocks stored that the index left out: those of a LoRA adapter (a prompt's match is
        the base model's), and those whose parent it did not hold (missed, forgotten, an
        adapter's), which no prompt's chain from its start could reach."""

    def __len__(self) -> int:
        return len(self._ours)

    def memory_bytes(self) -> int:
        """The index's own memory for this node, tables and keys: what the bound keeps."""
        return sys.getsizeof(self._ours) + sys.getsizeof(self._held) + 3 * _INT_BYTES * len(self._ours)

    def match(self, hashes: Sequence[int]) -> KvMatch:
        """How much of a prompt, cut at this node's block size and hashed, the node holds."""
        return KvMatch(self.longest_chain(hashes), len(hashes), self.seq, self.flowing)

    def longest_chain(self, hashes: Sequence[int]) -> int:
        """How many of `hashes` (a prompt's chain) the node holds, from the first on."""
        held = self._held
        for count, block in enumerate(hashes):
            if block not in held:
                return count
        return len(hashes)

    def apply(self, batch: KvBatch) -> int:
        """A batch's events in order, and its seq as the index's position; returns how many
        events it could not apply (a `BlockStored` whose tokens do not fill its blocks)."""
        rejected = 0
        for event in batch.events:
            if isinstance(event, BlockStored):
                if event.lora_id is not None or event.lora_name is not None:
                    self.unindexed += len(event.block_hashes)
                    continue
                try:
                    self.store(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size)
                except ValueError:
                    rejected += 1
            elif isinstance(event, BlockRemoved):
                self.remove(event.block_hashes)
            else:
                self.clear()
        self.seq = batch.seq
        return rejected

    def store(
        self, their_hashes: Sequence[int | bytes], their_parent: int | bytes | None, token_ids: Sequence[int],
        block_size: int,
    ) -> None:  # fmt: skip
        """Blocks the node stored: `their_hashes` (vLLM's) for consecutive full blocks of
        `token_ids`, the first a child of `their_parent`. Raises ValueError when the tokens do
        not fill exactly those blocks."""
        if block_size < 1 or len(token_ids) != len(their_hashes) * block_size:
            raise ValueError(f"{len(token_ids)} token ids for {len(their_hashes)} blocks of {block_size}")
        parent = None
        if their_parent is not None:
            parent = self._ours.get(their_parent)
            if parent is None:
                self.unindexed += len(their_hashes)
                return
        self.block_size = block_size
        ours, held = self._ours, self._held
        for theirs, block in zip(their_hashes, chain_hashes(token_ids, block_size, parent), strict=True):
            previous = ours.get(theirs)
            if previous is not None:
                ours.move_to_end(theirs)
                if previous == block:
                    continue
                self._release(previous)
            ours[theirs] = block
            held[block] = held.get(block, 0) + 1
        while len(ours) > self.capacity:
            self._release(ours.popitem(last=False)[1])

    def remove(self, their_hashes: Iterable[int | bytes]) -> None:
        for theirs in their_hashes:
            block = self._ours.pop(theirs, None)
            if block is not None:
                self._release(block)

    def clear(self) -> None:
        self._held = {}
        self._ours = OrderedDict()

    def _release(self, block: int) -> None:
        count = self._held[block]
        if count == 1:
            del self._held[block]
        else:
            self._held[block] = count - 1


class KvIndex:
    """Every subscribed node's blocks; the policy's read side is `match`."""

    def __init__(self, nodes: Mapping[str, NodeBlocks] | None = None) -> None:
        self.nodes: Mapping[str, NodeBlocks] = dict(nodes or {})
        self._last_hashed: tuple[Sequence[int], int, list[int]] = ((), DEFAULT_BLOCK_SIZE, [])
        """The last prompt hashed, its block size and hashes: a pick asks for every candidate
        with the same prompt, which is hashed once."""

    def match(self, node: str, token_ids: Sequence[int]) -> KvMatch | None:
        """How much of `token_ids` (a prompt) `node` holds; None when the node has no KV events."""
        blocks = self.nodes.get(node)
        if blocks is None:
            return None
        block_size = blocks.block_size
        last_tokens, last_size, hashes = self._last_hashed
        if last_tokens is not token_ids or last_size != block_size:
            hashes = chain_hashes(token_ids, block_size)
            self._last_hashed = (token_ids, block_size, hashes)
        return blocks.match(hashes)

"""The KV index's pure parts: the gateway's chained block hash and the index a node's events
build, read as the routing policy reads it (`KvIndex.match`)."""

from __future__ import annotations

import pytest

from kvcache.blocks import chain_hashes
from kvcache.index import KvIndex, KvMatch, NodeBlocks

# Token ids of a real chat prompt, as vLLM (Qwen3-8B, block size 16) published them in a
# BlockStored: "<|im_start|>user\nWhere is the capital of China?<|im_end|>\n<|im_start|>assistant\n<think>".
QWEN3_CHAT_BLOCK = [151644, 872, 198, 9064, 374, 279, 6722, 315, 5616, 30, 151645, 198, 151644, 77091, 198, 151667]
# Its vLLM hash in that event (vLLM's own, opaque to the gateway).
QWEN3_CHAT_BLOCK_VLLM_HASH = 15760518052499183552
# Two more blocks of a longer conversation on the same start (ids from the same vocabulary).
FOLLOW_UP = [
    198, 151668, 271, 785, 6722, 315, 5616, 374, 26549, 13, 151645, 198, 151644, 872, 198, 3838,
    911, 279, 7513, 315, 6323, 30, 151645, 198, 151644, 77091, 198, 151667, 198, 151668, 271, 785,
]  # fmt: skip


def test_a_block_hash_chains_to_its_parent() -> None:
    whole = chain_hashes(QWEN3_CHAT_BLOCK + FOLLOW_UP, 16)
    assert len(whole) == 3
    assert chain_hashes(FOLLOW_UP, 16, parent=whole[0]) == whole[1:]
    assert chain_hashes(FOLLOW_UP, 16) != whole[1:]  # the same tokens after another prefix


def test_only_full_blocks_are_hashed() -> None:
    assert chain_hashes(QWEN3_CHAT_BLOCK[:15], 16) == []
    assert chain_hashes(QWEN3_CHAT_BLOCK + FOLLOW_UP[:5], 16) == chain_hashes(QWEN3_CHAT_BLOCK, 16)


def test_the_hash_is_the_same_in_every_process() -> None:
    """Fixed values: a change of the hash (or a salted one, as Python's `hash()`) fails here."""
    assert chain_hashes(QWEN3_CHAT_BLOCK, 16) == [0xC1C67B32780CFF19]
    assert chain_hashes([0, 1, 2, 3], 2) == [0x6E50704161BB5CEE, 0xAD0272A46521527A]


@pytest.mark.parametrize("token_ids", [[-1, 2], [1 << 32, 2]])
def test_a_token_id_out_of_range_is_refused(token_ids: list[int]) -> None:
    with pytest.raises(ValueError, match="token id"):
        chain_hashes(token_ids, 2)


def index_of(node: NodeBlocks) -> KvIndex:
    return KvIndex({"n1": node})


def test_a_stored_chain_matches_the_prompts_that_start_with_it() -> None:
    blocks = NodeBlocks(capacity=100)
    blocks.store([QWEN3_CHAT_BLOCK_VLLM_HASH], None, QWEN3_CHAT_BLOCK, 16)
    blocks.store([11, 12], QWEN3_CHAT_BLOCK_VLLM_HASH, FOLLOW_UP, 16)
    blocks.seq, blocks.flowing = 7, True
    index = index_of(blocks)
    assert index.match("n1", QWEN3_CHAT_BLOCK + FOLLOW_UP + [198, 3838]) == KvMatch(3, 3, 7, True)
    assert index.match("n1", QWEN3_CHAT_BLOCK + FOLLOW_UP[:16] + [0] * 16) == KvMatch(2, 3, 7, True)
    assert index.match("n1", FOLLOW_UP) == KvMatch(0, 2, 7, True)  # the same tokens, not at the start
    assert index.match("n1", QWEN3_CHAT_BLOCK[:10]) == KvMatch(0, 0, 7, True)
    assert index.match("n2", QWEN3_CHAT_BLOCK) is None  # a node without KV events


def test_a_removed_block_ends_the_chain_there() -> None:
    blocks = NodeBlocks(capacity=100)
    blocks.store([QWEN3_CHAT_BLOCK_VLLM_HASH, 11, 12], None, QWEN3_CHAT_BLOCK + FOLLOW_UP, 16)
    blocks.remove([11, 999])  # 999: never stored, nothing to do
    assert index_of(blocks).match("n1", QWEN3_CHAT_BLOCK + FOLLOW_UP).matched == 1
    assert len(blocks) == 2


def test_a_clear_forgets_every_block() -> None:
    blocks = NodeBlocks(capacity=100)
    blocks.store([QWEN3_CHAT_BLOCK_VLLM_HASH], None, QWEN3_CHAT_BLOCK, 16)
    blocks.clear()
    assert index_of(blocks).match("n1", QWEN3_CHAT_BLOCK).matched == 0
    assert len(blocks) == 0


def test_past_its_capacity_the_oldest_block_is_forgotten_first() -> None:
    blocks = NodeBlocks(capacity=2)
    blocks.store([QWEN3_CHAT_BLOCK_VLLM_HASH, 11], None, QWEN3_CHAT_BLOCK + FOLLOW_UP[:16], 16)
    blocks.store([QWEN3_CHAT_BLOCK_VLLM_HASH], None, QWEN3_CHAT_BLOCK, 16)  # stored again: the newest
    blocks.store([21], None, FOLLOW_UP[16:], 16)
    assert len(blocks) == 2
    index = index_of(blocks)
    assert index.match("n1", QWEN3_CHAT_BLOCK + FOLLOW_UP[:16]).matched == 1  # 11 was the oldest
    assert index.match("n1", FOLLOW_UP[16:]).matched == 1


def test_a_block_whose_parent_the_index_lacks_is_not_indexed() -> None:
    blocks = NodeBlocks(capacity=100)
    blocks.store([11, 12], QWEN3_CHAT_BLOCK_VLLM_HASH, FOLLOW_UP, 16)
    assert (len(blocks), blocks.unindexed) == (0, 2)


def test_tokens_that_do_not_fill_the_blocks_are_refused() -> None:
    blocks = NodeBlocks(capacity=100)
    with pytest.raises(ValueError, match="17 token ids for 1 blocks of 16"):
        blocks.store([1], None, QWEN3_CHAT_BLOCK + [1], 16)


def test_the_prompt_is_cut_at_the_nodes_own_block_size() -> None:
    small, large = NodeBlocks(capacity=100), NodeBlocks(capacity=100)
    small.store([1, 2], None, QWEN3_CHAT_BLOCK, 8)
    large.store([3], None, QWEN3_CHAT_BLOCK, 16)
    index = KvIndex({"small": small, "large": large})
    assert index.match("small", QWEN3_CHAT_BLOCK + FOLLOW_UP) == KvMatch(2, 6, -1, False)
    assert index.match("large", QWEN3_CHAT_BLOCK + FOLLOW_UP) == KvMatch(1, 3, -1, False)


def test_memory_follows_the_blocks_held() -> None:
    blocks = NodeBlocks(capacity=10_000)
    empty = blocks.memory_bytes()
    tokens = list(range(16 * 1000))
    blocks.store(list(range(1000)), None, tokens, 16)
    assert blocks.memory_bytes() > empty + 1000 * 3 * 28
    blocks.clear()
    assert blocks.memory_bytes() == empty

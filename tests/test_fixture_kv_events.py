"""The simulated node's block prefix cache and its KV events (fixtures/kv_cache.py): real HTTP
requests to the node, a real ZeroMQ SUB socket and a DEALER for replay, the frames read as raw
msgpack in vLLM's layout (not with the node's own structs), so a drift from vLLM's wire format
fails here; and the gateway's tokenizer (kvcache/tokenizer.py) against the tokens the node
caches."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import msgspec
import pytest
import trio
import zmq
from tokenizers import Tokenizer

from fixtures.node import Behaviour, NodeSpec, SimulatedNode, serve_node, specs_from_config
from fixtures.tokenizer_dir import write_tokenizer_dir
from kvcache.tokenizer import PromptTokens

PROJECT_ROOT = Path(__file__).resolve().parent.parent
MODEL = "kv-model"
BLOCK = 4
SYSTEM = "You are a helpful assistant. Answer the question of the user briefly and precisely."
WAIT = 60


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("tokenizer"))


def chat(question: str, system: str = SYSTEM) -> dict:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": 2}


@asynccontextmanager
async def kv_node(tokenizer_dir: Path, **spec) -> AsyncIterator[tuple[SimulatedNode, httpx.AsyncClient]]:
    options = {"kv_block_size": BLOCK, "kv_events": "tcp://127.0.0.1:0", "kv_events_replay": "tcp://127.0.0.1:0"}
    node_spec = NodeSpec(name="kv1", models=[MODEL], tokenizer=str(tokenizer_dir), **(options | spec))
    async with serve_node(node_spec) as node:
        async with httpx.AsyncClient(base_url=node.url, timeout=WAIT) as client:
            yield node, client


@asynccontextmanager
async def subscribed(node: SimulatedNode, topic: bytes = b"") -> AsyncIterator[zmq.Socket]:
    """A SUB socket on the node's events, once the node has its subscription."""
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVTIMEO, WAIT * 1000)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    try:
        seen = node.kv_events.subscriptions
        sub.connect(node.kv_events.endpoint)
        with trio.fail_after(WAIT):
            while node.kv_events.subscriptions == seen:
                await trio.sleep(0.005)
        yield sub
    finally:
        sub.close()
        context.term()


async def receive(sub: zmq.Socket) -> tuple[bytes, int, list]:
    """One published message: its topic, sequence number and the batch as raw msgpack."""
    topic, sequence, payload = await trio.to_thread.run_sync(sub.recv_multipart)
    assert len(sequence) == 8
    return topic, int.from_bytes(sequence, "big"), msgspec.msgpack.decode(payload)


async def replayed(endpoint: str, first: int) -> list[tuple[bytes, bytes]]:
    """The replay socket's answer to a request for the batches from `first` on: (sequence,
    payload) frames up to and with the end marker. A DEALER sends the REQ framing (an empty
    delimiter, then the number): a REQ socket takes one reply only, and the replay sends many."""
    context = zmq.Context()
    replay = context.socket(zmq.DEALER)
    replay.setsockopt(zmq.LINGER, 0)
    replay.setsockopt(zmq.RCVTIMEO, WAIT * 1000)
    frames: list[tuple[bytes, bytes]] = []
    try:
        replay.connect(endpoint)
        replay.send_multipart([b"", first.to_bytes(8, "big")])
        while not frames or frames[-1][1]:
            empty, sequence, payload = await trio.to_thread.run_sync(replay.recv_multipart)
            assert empty == b""
            frames.append((sequence, payload))
    finally:
        replay.close()
        context.term()
    return frames


def events_of(batch: list) -> list[list]:
    """vLLM's KVEventBatch is array-like: [ts, events, data_parallel_rank] (its publisher sets
    the rank, 0 without data parallelism)."""
    timestamp, events, rank = batch
    assert isinstance(timestamp, float) and rank == 0
    return events


async def test_a_chat_request_publishes_its_full_blocks_in_vllms_layout(tokenizer_dir):
    async with kv_node(tokenizer_dir, kv_events_topic="kv@kv1") as (node, client):
        async with subscribed(node, b"kv@") as sub:
            answer = await client.post("/v1/chat/completions", json=chat("What is the capital of France?"))
            assert answer.status_code == 200
            topic, sequence, batch = await receive(sub)
    assert (topic, sequence) == (b"kv@kv1", 0)
    [stored] = events_of(batch)
    tag, hashes, parent, token_ids, block_size, lora_id, medium, lora_name = stored
    assert (tag, parent, block_size, lora_id, medium, lora_name) == ("BlockStored", None, BLOCK, None, "GPU", None)
    assert len(token_ids) == len(hashes) * BLOCK and len(set(hashes)) == len(hashes)
    rendered = f"<s><|system|>\n{SYSTEM}</s>\n<|user|>\nWhat is the capital of France?</s>\n<|assistant|>\n"
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False).ids
    assert token_ids == prompt_ids[: len(prompt_ids) // BLOCK * BLOCK]  # only full blocks
    state = node.kv_state()
    assert (state["blocks"], state["prompt_blocks"], state["hit_blocks"], state["sequence"]) == (len(hashes),) * 2 + (0, 0)


async def test_a_shared_prefix_is_served_from_the_cache_and_only_the_new_blocks_are_stored(tokenizer_dir):
    async with kv_node(tokenizer_dir) as (node, client):
        async with subscribed(node) as sub:
            await client.post("/v1/chat/completions", json=chat("What is the capital of France?"))
            [[_, first_hashes, *_]] = events_of((await receive(sub))[2])
            await client.post("/v1/chat/completions", json=chat("Write a short poem about the sea."))
            _, sequence, batch = await receive(sub)
        [[tag, hashes, parent, *_]] = events_of(batch)
        shared = first_hashes.index(parent) + 1
        assert (tag, sequence) == ("BlockStored", 1) and 0 < shared < len(first_hashes)
        state = node.kv_state()
        assert state["hit_blocks"] == shared and state["blocks"] == len(first_hashes) + len(hashes)
        metrics = (await client.get("/metrics")).text
        assert f'vllm:prefix_cache_hits_total{{model_name="{MODEL}"}} {float(shared * BLOCK)}' in metrics


async def test_a_full_cache_evicts_the_least_recently_used_tail_first_and_publishes_block_removed(tokenizer_dir):
    async with kv_node(tokenizer_dir, kv_capacity_blocks=16) as (node, client):
        async with subscribed(node) as sub:
            await client.post("/v1/chat/completions", json=chat("Explain how a hash table works.", system="A"))
            [[_, first, *_]] = events_of((await receive(sub))[2])
            await client.post("/v1/chat/completions", json=chat("Translate: the weather is nice today." * 4, "B"))
            removed, stored = events_of((await receive(sub))[2])
        assert removed[0] == "BlockRemoved" and stored[0] == "BlockStored"
        evicted = removed[1]
        assert evicted and len(first) + len(stored[1]) - len(evicted) == 16 == node.kv_state()["blocks"]
        assert set(evicted) == set(first[-len(evicted) :])  # the chain's tail goes, its parents stay
        assert removed[2] == "GPU"


async def test_a_restart_clears_the_cache_and_publishes_all_blocks_cleared_as_sequence_zero(tokenizer_dir):
    async with kv_node(tokenizer_dir) as (node, client):
        async with subscribed(node) as sub:
            for question in ("one", "two"):
                await client.post("/v1/chat/completions", json=chat(question))
                await receive(sub)
            restarted = await client.post("/_control/kv/restart")
            _, sequence, batch = await receive(sub)
            assert (sequence, events_of(batch)) == (0, [["AllBlocksCleared"]])
            assert restarted.json()["blocks"] == 0
            await client.post("/v1/chat/completions", json=chat("one"))
            _, sequence, batch = await receive(sub)
        [[tag, *_]] = events_of(batch)
        assert (tag, sequence) == ("BlockStored", 1)  # nothing was left: all stored again


async def test_replay_returns_the_batches_a_late_subscriber_missed_then_the_end_marker(tokenizer_dir):
    async with kv_node(tokenizer_dir, kv_replay_batches=2) as (node, client):
        for question in ("one", "two", "three"):
            await client.post("/v1/chat/completions", json=chat(question))
        with trio.fail_after(WAIT):
            while node.kv_events.sequence < 2:  # published by the node's thread
                await trio.sleep(0.005)
        frames = await replayed(node.kv_events.replay_endpoint, 0)
    sequences = [int.from_bytes(sequence, "big", signed=True) for sequence, _ in frames]
    assert sequences == [1, 2, -1]  # the buffer keeps two batches; batch 0 is gone
    assert frames[-1][1] == b""
    for _, payload in frames[:-1]:
        [[tag, *_]] = events_of(msgspec.msgpack.decode(payload))
        assert tag == "BlockStored"


async def test_prefill_time_counts_only_the_uncached_tokens(tokenizer_dir):
    async with kv_node(tokenizer_dir, behaviour=Behaviour(prefill_per_token=0.001, tokens=1)) as (node, client):
        body = chat("What is the capital of France?")
        await client.post("/v1/chat/completions", json=body)
        first = node.kv_state()
        assert first["hit_blocks"] == 0 and first["prompt_blocks"] > 0
        await client.post("/v1/chat/completions", json=body)
        state = node.kv_state()
        assert state["hit_blocks"] == first["prompt_blocks"] and state["blocks"] == first["blocks"]
        ttft = node._time_to_first_token(MODEL, body, True, 0, node._prompt_token_ids(body, True))
        partial = len(node._prompt_token_ids(body, True)) % BLOCK
        assert ttft == pytest.approx(0.001 * partial)  # the partial last block is all that is computed


async def test_a_prompt_the_template_cannot_render_is_a_400_and_a_completion_prompt_is_cached_too(tokenizer_dir):
    async with kv_node(tokenizer_dir) as (node, client):
        refused = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": "hi"})
        assert refused.status_code == 400 and "messages" in refused.json()["message"]
        prompt = "The quick brown fox jumps over the lazy dog near the river bank."
        for _ in range(2):
            assert (await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})).status_code == 200
        state = node.kv_state()
        assert state["hit_blocks"] * 2 == state["prompt_blocks"] > 0


async def test_options_are_checked_and_named(tokenizer_dir):
    with pytest.raises(ValueError, match="kv_events needs a tokenizer"):
        async with serve_node(NodeSpec(name="n", kv_events="tcp://127.0.0.1:0")):
            pass
    with pytest.raises(ValueError, match="kv_capacity_blocks must be"):
        async with serve_node(NodeSpec(name="n", tokenizer=str(tokenizer_dir), kv_capacity_blocks=0)):
            pass
    async with serve_node(NodeSpec(name="plain")) as node, httpx.AsyncClient(base_url=node.url) as client:
        assert (await client.get("/_control/kv")).status_code == 404


def test_specs_from_config_bind_the_gateways_kv_events_endpoints(tmp_path, tokenizer_dir):
    path = tmp_path / "gateway.toml"
    path.write_text(
        f'[models]\ndefault = "{MODEL}"\n[[models.available]]\nname = "{MODEL}"\ntokenizer = "{tokenizer_dir}"\n'
        '[[nodes]]\nip = "127.0.0.2"\nkv_events = "tcp://127.0.0.2:5557"\nkv_events_replay = "tcp://127.0.0.2:5558"\n'
        'kv_events_topic = "kv"\n[[nodes]]\nip = "127.0.0.3"\n'
    )
    with_events, without = specs_from_config(str(path))
    assert (with_events.tokenizer, with_events.kv_events, with_events.kv_events_replay) == (
        str(tokenizer_dir), "tcp://127.0.0.2:5557", "tcp://127.0.0.2:5558"
    )  # fmt: skip
    assert (with_events.kv_events_topic, without.kv_events, without.tokenizer) == ("kv", "", str(tokenizer_dir))


async def test_cli_nodes_print_their_kv_event_endpoints_and_answer_replay(tokenizer_dir):
    command = [sys.executable, "-m", "fixtures.node", "--nodes", "1", "--base-port", "0", "--models", MODEL,
               "--tokenizer", str(tokenizer_dir), "--kv-events-base-port", "0", "--kv-block-size", "8"]  # fmt: skip
    process = await trio.lowlevel.open_process(command, cwd=PROJECT_ROOT, stdout=subprocess.PIPE)
    try:
        output = b""
        with trio.fail_after(WAIT):
            while b"\n" not in output:
                data = await process.stdout.receive_some()
                assert data, f"the CLI exited early: {output!r}"
                output += data
        fields = output.decode().split()
        url, replay_endpoint = fields[fields.index("vllm") + 1], fields[fields.index("replay") + 1]
        assert fields[fields.index("kv_events") + 1].startswith("tcp://127.0.0.1:")
        async with httpx.AsyncClient(base_url=url, timeout=WAIT) as client:
            assert (await client.post("/v1/chat/completions", json=chat("one"))).status_code == 200
            with trio.fail_after(WAIT):
                while (state := (await client.get("/_control/kv")).json())["sequence"] != 0:
                    await trio.sleep(0.01)
            assert state["block_size"] == 8
        frames = await replayed(replay_endpoint, 0)
        assert [int.from_bytes(sequence, "big", signed=True) for sequence, _ in frames] == [0, -1]
    finally:
        process.kill()
        await process.wait()


async def test_content_parts_render_as_their_joined_text_and_the_generation_prompt_is_the_requests(tokenizer_dir):
    async with kv_node(tokenizer_dir) as (node, client):
        parts = [{"type": "text", "text": "What is the capital"}, {"type": "image_url"}, {"type": "text", "text": "of France?"}]
        as_parts = {"model": MODEL, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]}
        as_text = chat("What is the capital\nof France?")
        assert (await client.post("/v1/chat/completions", json=as_parts)).status_code == 200
        first = node.kv_state()
        assert (await client.post("/v1/chat/completions", json=as_text)).status_code == 200
        state = node.kv_state()
        assert state["hit_blocks"] == first["prompt_blocks"] == state["prompt_blocks"] // 2  # the same tokens
        without = as_text | {"add_generation_prompt": False}
        rendered = node._prompt_tokenizer.render(without)
        assert rendered.endswith("of France?</s>\n") and node._prompt_tokenizer.render(as_text) == rendered + "<|assistant|>\n"


CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Grüße! What is the capital of France?"},
    {"role": "assistant", "content": "Hello from kv1. lorem ipsum"},
    {"role": "user", "content": [{"type": "text", "text": "And of"}, {"type": "text", "text": "Germany? 😀"}]},
]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": CONVERSATION[:2]}),
        ("/v1/chat/completions", {"messages": CONVERSATION}),
        ("/v1/chat/completions", {"messages": CONVERSATION, "add_generation_prompt": False}),
        ("/v1/completions", {"prompt": "The quick brown fox jumps over the lazy dog."}),
        ("/v1/completions", {"prompt": [5, 6, 7, 8, 9]}),
    ],
)
async def test_the_gateways_tokenizer_gives_the_tokens_the_node_caches(tokenizer_dir, path, body):
    """kv_aware matches the gateway's tokens against the blocks the node's events carry: both
    sides must tokenize a prompt alike (the node as vLLM does)."""
    body = {"model": MODEL, "max_tokens": 2} | body
    unusable: list[str] = []
    gateway_tokens = await PromptTokens(unusable.append).tokens(str(tokenizer_dir), path, msgspec.json.encode(body))
    assert unusable == []
    async with kv_node(tokenizer_dir, kv_block_size=1) as (node, client):
        async with subscribed(node) as sub:
            assert (await client.post(path, json=body)).status_code == 200
            [[_, _, _, node_tokens, *_]] = events_of((await receive(sub))[2])
    assert list(gateway_tokens) == node_tokens

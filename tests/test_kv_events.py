"""vLLM's KV events into the gateway's index: the frames decoded as vLLM's structs encode them
(both of vLLM's encodings), and the subscribers through real ZeroMQ sockets, fed by a publisher
written here with vLLM's own structs (copied, so a drift of the gateway's decoder from vLLM's
wire fails here): gaps repaired by replay or cleared and counted, restarts, garbage, a publisher
that is not there, and the threads gone at the end."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio
import zmq
from prometheus_client import CollectorRegistry

from controlplane.infrastructure.config import ConfigError, load_config
from events.config import Config, NodeConfig, RoutingConfig
from fixtures.node import NodeSpec, SimulatedNode, serve_nodes
from fixtures.tokenizer_dir import write_tokenizer_dir
from kvcache.blocks import chain_hashes
from kvcache.index import KvIndex
from kvcache.subscriptions import KvSubscriptions
from kvcache.wire import MAX_BATCH_BYTES, AllBlocksCleared, BlockRemoved, BlockStored, WireError, decode_payload

from harness import (
    MODEL, CapturedLog, config_text, free_port, node_specs, running_gateway, serve_process, write_config,
)  # fmt: skip

REPO_ROOT = Path(__file__).resolve().parent.parent
WAIT = 60
NODE = "10.0.0.1"

# --- vLLM's structs, as vllm/distributed/kv_events.py declares them ------------------------------
# Up to vLLM 0.23: every struct array_like (positional).


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VllmBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class VllmAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(EventBatch):
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]


# Since vLLM #42892 the events are tagged maps (the batch stays an array).


class MapBlockStored(VllmBlockStored, array_like=False):
    pass


class MapKVEventBatch(EventBatch):
    events: list[MapBlockStored]


# Real data: a Qwen3-8B chat prompt's first block as vLLM 0.26 published it (block size 16).
QWEN3_BLOCK = [151644, 872, 198, 9064, 374, 279, 6722, 315, 5616, 30, 151645, 198, 151644, 77091, 198, 151667]
QWEN3_HASH = 15760518052499183552
NEXT_BLOCK = [198, 151668, 271, 785, 6722, 315, 5616, 374, 26549, 13, 151645, 198, 151644, 872, 198, 3838]
PROMPT = QWEN3_BLOCK + NEXT_BLOCK + [911, 279]

encode = msgspec.msgpack.Encoder().encode


def stored(hashes: list[int], parent: int | None, tokens: list[int], **newer: Any) -> VllmBlockStored:
    return VllmBlockStored(hashes, parent, tokens, 16, None, "GPU", None, **newer)


# --- the wire -----------------------------------------------------------------------------------


def test_a_batch_of_vllm_0_23_decodes() -> None:
    payload = encode(
        KVEventBatch(
            1.5,
            [
                stored([QWEN3_HASH], None, QWEN3_BLOCK, extra_keys=[None], group_idx=0, kv_cache_spec_kind="full"),
                VllmBlockRemoved([7, b"\x01" * 32], "GPU", group_idx=0),
                VllmAllBlocksCleared(),
            ],
            0,
        )
    )
    batch = decode_payload(9, payload)
    assert (batch.seq, batch.ts, batch.undecoded) == (9, 1.5, 0)
    first, second, third = batch.events
    assert isinstance(first, BlockStored) and isinstance(second, BlockRemoved) and isinstance(third, AllBlocksCleared)
    assert (first.block_hashes, first.parent_block_hash, first.token_ids) == ([QWEN3_HASH], None, QWEN3_BLOCK)
    assert (first.block_size, first.lora_id, first.medium) == (16, None, "GPU")
    assert second.block_hashes == [7, b"\x01" * 32]


def test_a_batch_of_map_encoded_events_decodes() -> None:
    """vLLM after #42892, as a v0.26 node sent it (its fields by name, newer ones ignored)."""
    event = MapBlockStored([QWEN3_HASH], None, QWEN3_BLOCK, 16, None, "GPU", None, [None], 0, "full_attention")
    payload = encode(MapKVEventBatch(1789095808.8378847, [event], 0))
    assert msgspec.msgpack.decode(payload)[1][0]["type"] == "BlockStored"  # a map in an array
    batch = decode_payload(0, payload)
    [decoded] = batch.events
    assert isinstance(decoded, BlockStored)
    assert (decoded.block_hashes, decoded.token_ids, decoded.medium) == ([QWEN3_HASH], QWEN3_BLOCK, "GPU")


def test_an_event_of_an_unknown_type_is_counted_and_the_others_kept() -> None:
    payload = encode([2.0, [["BlockUpdated", [1]], ["AllBlocksCleared"], {"type": "BlockStored"}], 0])
    batch = decode_payload(3, payload)
    assert batch.undecoded == 2
    assert [type(event).__name__ for event in batch.events] == ["_AllBlocksClearedArray"]


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        (b"", "truncated"),
        (b"\xc1", "malformed"),
        (encode("a string"), "Expected `object`"),
        (encode([1.0, [["BlockStored", [1], None, [-5], 16]]]), None),  # a negative token id: one event
        (b"\x00" * (MAX_BATCH_BYTES + 1), "over"),
    ],
)
def test_what_is_no_batch_is_a_wire_error(payload: bytes, problem: str | None) -> None:
    if problem is None:
        assert decode_payload(0, payload).undecoded == 1
        return
    with pytest.raises(WireError, match=problem):
        decode_payload(0, payload)


# --- a publisher as vLLM's ZmqEventPublisher ----------------------------------------------------


class Publisher:
    """vLLM's PUB and replay ROUTER sockets. The PUB side is an XPUB (the same wire) so a test
    can wait for its subscriber; the ROUTER answers on a thread of its own, from `buffer`, which
    a test may thin out to make a gap the replay cannot fill."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:*", replay: str = "tcp://127.0.0.1:*", topic: bytes = b"kv"):
        self.context = zmq.Context()
        self.topic = topic
        self.pub = self.context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.IPV6, 1)
        self.pub.bind(endpoint)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.IPV6, 1)
        self.router.bind(replay)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: dict[int, bytes] = {}
        self.seq = -1
        self.replays = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def publish(self, events: list, *, send: bool = True, ts: float | None = None) -> int:
        """One batch, numbered next; `send=False` keeps it for replay only (lost on the way)."""
        self.seq += 1
        payload = encode(KVEventBatch(time.time() if ts is None else ts, events, 0))
        with self._lock:
            self.buffer[self.seq] = payload
        if send:
            self.pub.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload])
        return self.seq

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def restart(self) -> None:
        """As a vLLM started again: numbers from 0, nothing to replay."""
        with self._lock:
            self.buffer.clear()
        self.seq = -1

    def forget(self, seq: int) -> None:
        with self._lock:
            del self.buffer[seq]

    async def subscribed(self) -> None:
        """Wait for a subscription to arrive (XPUB passes it on)."""
        with trio.fail_after(WAIT):
            while True:
                try:
                    if self.pub.recv(zmq.NOBLOCK)[:1] == b"\x01":
                        return
                except zmq.Again:
                    await trio.sleep(0.01)

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            self.replays += 1
            first = int.from_bytes(start, "big")
            with self._lock:
                held = sorted(item for item in self.buffer.items() if item[0] >= first)
            for seq, payload in held:
                self.router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        if self.context.closed:
            return
        self._stop.set()
        self._thread.join()
        self.pub.close()
        self.router.close()
        self.context.term()


@asynccontextmanager
async def publisher(**kwargs: Any) -> AsyncIterator[Publisher]:
    published = Publisher(**kwargs)
    try:
        yield published
    finally:
        published.close()


def config_for(*nodes: NodeConfig, blocks: int = 1000) -> Config:
    return Config(nodes=nodes, routing=RoutingConfig(kv_index_blocks=blocks))


def node_of(published: Publisher, *, replay: bool = True, ip: str = NODE) -> NodeConfig:
    return NodeConfig(
        ip=ip,
        kv_events=published.endpoint,
        kv_events_replay=published.replay_endpoint if replay else "",
        kv_events_topic=published.topic.decode(),
    )


class Subscribed:
    def __init__(self, subscriptions: KvSubscriptions, registry: CollectorRegistry, log: CapturedLog) -> None:
        self.subscriptions = subscriptions
        self.registry = registry
        self.log = log

    @property
    def index(self) -> KvIndex:
        return self.subscriptions.index

    def sample(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, {"node": NODE, **labels})

    async def until(self, condition: Callable[[], bool]) -> None:
        with trio.fail_after(WAIT):
            while not condition():
                await trio.sleep(0.01)

    def matched(self, tokens: list[int] = PROMPT) -> int:
        found = self.index.match(NODE, tokens)
        assert found is not None
        return found.matched


@asynccontextmanager
async def subscribed(config: Config) -> AsyncIterator[Subscribed]:
    registry, log = CollectorRegistry(), CapturedLog()
    subscriptions = KvSubscriptions(registry, log)
    subscriptions.follow(config)
    try:
        yield Subscribed(subscriptions, registry, log)
    finally:
        await trio.to_thread.run_sync(subscriptions.close)
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("interlock kv events")]


async def test_stored_and_removed_blocks_reach_the_index() -> None:
    async with publisher() as published, subscribed(config_for(node_of(published))) as kv:
        await published.subscribed()
        await kv.until(lambda: kv.index.match(NODE, PROMPT).flowing)
        published.publish([stored([QWEN3_HASH], None, QWEN3_BLOCK)])
        published.publish([stored([22], QWEN3_HASH, NEXT_BLOCK)])
        await kv.until(lambda: kv.matched() == 2)
        assert kv.index.match(NODE, PROMPT).seq == 1
        published.publish([VllmBlockRemoved([22], "GPU")])
        await kv.until(lambda: kv.matched() == 1)
        assert kv.sample("interlock_kv_index_blocks") == 1
        assert kv.sample("interlock_kv_index_bytes") > 0
        assert kv.sample("interlock_kv_events_batches_total") == 3
        assert kv.sample("interlock_kv_events_flowing") == 1
        published.publish([VllmAllBlocksCleared()])
        await kv.until(lambda: kv.matched() == 0 and kv.sample("interlock_kv_index_blocks") == 0)
        assert kv.sample("interlock_kv_events_gaps_total", repair="replayed") is None


async def test_a_gap_is_filled_by_replay() -> None:
    async with publisher() as published, subscribed(config_for(node_of(published))) as kv:
        await published.subscribed()
        await kv.until(lambda: kv.index.match(NODE, PROMPT).flowing)
        published.publish([stored([QWEN3_HASH], None, QWEN3_BLOCK)])
        published.publish([stored([22], QWEN3_HASH, NEXT_BLOCK)], send=False)  # lost on the way
        published.publish([VllmBlockRemoved([999], "GPU")])
        await kv.until(lambda: kv.index.match(NODE, PROMPT).seq == 2)
        assert kv.matched() == 2
        assert kv.sample("interlock_kv_events_gaps_total", repair="replayed") == 1
        assert kv.sample("interlock_kv_events_gaps_total", repair="cleared") is None
        assert kv.index.match(NODE, PROMPT).flowing


async def test_a_gap_past_the_replay_clears_the_index_and_is_counted() -> None:
    async with publisher() as published, subscribed(config_for(node_of(published))) as kv:
        await published.subscribed()
        await kv.until(lambda: kv.index.match(NODE, PROMPT).flowing)
        published.publish([stored([QWEN3_HASH], None, QWEN3_BLOCK)])
        await kv.until(lambda: kv.matched() == 1)
        lost = published.publish([VllmBlockRemoved([QWEN3_HASH], "GPU")], send=False)
        published.forget(lost)  # the replay's buffer no longer holds it
        published.publish([stored([31], None, NEXT_BLOCK)])
        await kv.until(lambda: kv.index.match(NODE, PROMPT).seq == 2)
        assert kv.matched() == 0  # the removal was lost: nothing of before is vouched for
        assert kv.matched(NEXT_BLOCK) == 1  # what came after the gap is
        assert kv.sample("interlock_kv_events_gaps_total", repair="cleared") == 1
        cleared = "kv events: a gap the replay could not fill; the node's index was cleared"
        assert kv.log.messages(None).count(cleared) == 1
        assert kv.index.match(NODE, PROMPT).flowing


async def test_without_a_replay_socket_a_gap_clears_the_index() -> None:
    async with publisher() as published, subscribed(config_for(node_of(published, replay=False))) as kv:
        await published.subscribed()
        await kv.until(lambda: kv.index.match(NODE, PROMPT).flowing)
        published.publish([stored([QWEN3_HASH], None, QWEN3_BLOCK)])
        await kv.until(lambda: kv.matched() == 1)
        published.publish([VllmBlockRemoved([5], "GPU")], send=False)
        published.publish([VllmBlockRemoved([6], "GPU")])
        await kv.until(lambda: kv.sample("interlock_kv_events_gaps_total", repair="cleared") == 1)
        assert kv.matched() == 0
        assert published.replays == 0


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]"])
async def test_an_idle_node_is_learned_from_its_replay_at_connection(host: str) -> None:
    async with publisher(endpoint=f"tcp://{host}:*", replay=f"tcp://{host}:*") as published:
        published.publish([stored([QWEN3_HASH], None, QWEN3_BLOCK)])
        published.publish([stored([22], QWEN3_HASH, NEXT_BLOCK)])
        async with subscribed(config_for(node_of(published))) as kv:
            await kv.until(lambda: kv.matched() == 2)
            assert kv.index.match(NODE, PROMPT).seq == 1


async def test_a_restarted_node_clears_its_index() -> None:
    async with publisher() as published, subscribed(config_for(node_of(published))) as kv:
        await published.subscribed()
        await kv.until(lambda: kv.index.match(NODE, PROMPT).flowing)
        for _ in range(3):
            published.publish([stored([QWEN3_HASH], None, QWEN3_BLOCK)])
        await kv.until(lambda: kv.index.match(NODE, PROMPT).seq == 2)
        published.restart()
        published.publish([stored([31], None, NEXT_BLOCK)])
        await kv.until(lambda: kv.sample("interlock_kv_events_restarts_total") == 1)
        await kv.until(lambda: kv.index.match(NODE, PROMPT).seq == 0)
        assert (kv.matched(), kv.matched(NEXT_BLOCK)) == (0, 1)
        assert kv.sample("interlock_kv_events_gaps_total", repair="cleared") is None


async def test_a_node_restarted_while_the_connection_was_down_is_told_by_its_replay() -> None:
    """The node came back and numbered past the last batch applied before the subscriber saw
    any of its new batches: the replay's batch in the place of the last applied is another."""
    async with publisher() as before, subscribed(config_for(node_of(before))) as kv:
        await before.subscribed()
        await kv.until(lambda: kv.index.match(NODE, PROMPT).flowing)
        for _ in range(3):
            before.publish([stored([QWEN3_HASH], None, QWEN3_BLOCK)])
        await kv.until(lambda: kv.index.match(NODE, PROMPT).seq == 2)
        before.close()
        async with publisher(endpoint=before.endpoint, replay=before.replay_endpoint) as after:
            for _ in range(6):  # none reaches the subscriber but by the replay at its connection
                after.publish([stored([31], None, NEXT_BLOCK)], send=False)
            await kv.until(lambda: kv.index.match(NODE, PROMPT).seq == 5)
            assert (kv.matched(), kv.matched(NEXT_BLOCK)) == (0, 1)
            assert kv.sample("interlock_kv_events_restarts_total") == 1
            await kv.until(lambda: kv.index.match(NODE, PROMPT).flowing)


async def test_garbage_is_counted_and_the_events_after_it_applied() -> None:
    async with publisher() as published, subscribed(config_for(node_of(published))) as kv:
        await published.subscribed()
        await kv.until(lambda: kv.index.match(NODE, PROMPT).flowing)
        published.send_raw([b"kv", b"\x00\x01"])  # a sequence number of 2 bytes
        published.send_raw([b"kv"])
        published.publish([stored([QWEN3_HASH], None, QWEN3_BLOCK)])
        published.seq += 1
        published.send_raw([b"kv", published.seq.to_bytes(8, "big"), b"\xc1 not msgpack"])
        published.publish([stored([41], None, NEXT_BLOCK), ["BlockUpdated", 1]])
        await kv.until(lambda: kv.index.match(NODE, PROMPT).seq == 2)
        assert kv.sample("interlock_kv_events_garbage_total") == 4
        assert (kv.matched(), kv.matched(NEXT_BLOCK)) == (0, 1)  # the undecodable batch cleared the index
        assert kv.log.messages(None).count("kv events: a message that is not vLLM's KV events") == 1


async def test_a_publisher_not_there_is_counted_once_and_followed_once_it_is() -> None:
    probe = zmq.Context()
    placeholder = probe.socket(zmq.PUB)
    placeholder.bind("tcp://127.0.0.1:*")
    endpoint = placeholder.getsockopt_string(zmq.LAST_ENDPOINT)
    placeholder.close(linger=0)
    probe.term()
    config = config_for(NodeConfig(ip=NODE, kv_events=endpoint, kv_events_topic="kv"))
    async with subscribed(config) as kv:
        await kv.until(lambda: kv.sample("interlock_kv_events_disconnects_total") == 1)
        assert kv.index.match(NODE, PROMPT).flowing is False
        assert kv.sample("interlock_kv_events_flowing") == 0
        async with publisher(endpoint=endpoint) as published:
            await published.subscribed()
            await kv.until(lambda: kv.index.match(NODE, PROMPT).flowing)
            published.publish([stored([QWEN3_HASH], None, QWEN3_BLOCK)])
            await kv.until(lambda: kv.matched() == 1)
        await kv.until(lambda: not kv.index.match(NODE, PROMPT).flowing)
        assert kv.sample("interlock_kv_events_disconnects_total") == 2
        unreachable = "kv events: the node's publisher is not reachable; retrying"
        assert kv.log.messages(None).count(unreachable) == 1


async def test_the_index_is_bounded_per_node() -> None:
    async with publisher() as published, subscribed(config_for(node_of(published), blocks=2)) as kv:
        await published.subscribed()
        await kv.until(lambda: kv.index.match(NODE, PROMPT).flowing)
        tokens = list(range(16 * 5))
        published.publish([VllmBlockStored([1, 2, 3, 4, 5], None, tokens, 16, None, "GPU", None)])
        await kv.until(lambda: kv.index.match(NODE, PROMPT).seq == 0)
        assert kv.sample("interlock_kv_index_blocks") == 2
        assert kv.index.match(NODE, tokens).matched == 0  # the chain's start was forgotten first


async def test_a_new_config_starts_and_stops_subscribers() -> None:
    async with publisher() as first, publisher() as second, subscribed(config_for(node_of(first))) as kv:
        await first.subscribed()
        other = node_of(second, ip="10.0.0.2")
        kv.subscriptions.follow(config_for(other))
        await second.subscribed()
        assert kv.index.match(NODE, PROMPT) is None
        assert kv.sample("interlock_kv_index_blocks") is None  # the node's gauges went with it
        await kv.until(lambda: kv.index.match("10.0.0.2", PROMPT).flowing)
        kv.subscriptions.follow(config_for(NodeConfig(ip="10.0.0.2")))
        assert kv.index.nodes == {}


def test_without_kv_events_nothing_starts() -> None:
    registry = CollectorRegistry()
    subscriptions = KvSubscriptions(registry, CapturedLog())
    subscriptions.follow(config_for(NodeConfig(ip=NODE)))
    assert subscriptions.index.match(NODE, PROMPT) is None
    assert registry.get_sample_value("interlock_kv_index_blocks", {"node": NODE}) is None
    subscriptions.close()


def test_chain_hashes_of_the_prompt_match_the_stored_blocks() -> None:
    """The index keys a BlockStored by the gateway's hash of its tokens: the prompt's own."""
    assert chain_hashes(PROMPT, 16)[0] == chain_hashes(QWEN3_BLOCK, 16)[0]


# --- the config ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "key", "message"),
    [
        *[
            (f'kv_events = "{value}"', "nodes[0].kv_events", f'kv_events must be "tcp://HOST:PORT" (got "{value}")')
            for value in ("10.0.0.1:5557", "tcp://10.0.0.1:70000", "tcp://*:5557", "tcp://10.0.0.1")
        ],
        (
            'kv_events = "tcp://10.0.0.1:5557"\nkv_events_replay = "ipc:///tmp/replay"',
            "nodes[0].kv_events_replay",
            'kv_events_replay must be "tcp://HOST:PORT" (got "ipc:///tmp/replay")',
        ),
        (
            'kv_events_replay = "tcp://10.0.0.1:5558"',
            "nodes[0].kv_events_replay",
            "kv_events_replay is set but kv_events is not: set where the node publishes",
        ),
        (
            'kv_events_topic = "kv"',
            "nodes[0].kv_events_topic",
            "kv_events_topic is set but kv_events is not: set where the node publishes",
        ),
        (
            'kv_events = "tcp://10.0.0.1:5557"\nkv_events_replay = "tcp://10.0.0.1:5557"',
            "nodes[0].kv_events_replay",
            "kv_events_replay must be another socket than kv_events",
        ),
        (
            'kv_events = "tcp://10.0.0.1:5557"\n[routing]\nkv_index_blocks = 0',
            "routing.kv_index_blocks",
            "kv_index_blocks must be at least 1",
        ),
    ],
)  # fmt: skip
def test_kv_event_keys_are_checked_naming_file_and_key(tmp_path: Path, keys: str, key: str, message: str) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(f'[[nodes]]\nip = "10.0.0.1"\n{keys}\n')
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert (caught.value.path, caught.value.key, caught.value.message) == (str(path), key, message)
    assert str(path) in str(caught.value) and key in str(caught.value)


def test_kv_event_keys_load(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(
        '[[nodes]]\nip = "10.0.0.1"\nkv_events = "tcp://gpu-1.internal:5557"\n'
        'kv_events_replay = "tcp://[fd00::1]:5558"\nkv_events_topic = "kv@gpu-1"\n[routing]\nkv_index_blocks = 5000\n'
    )
    config = load_config(path)
    [node] = config.nodes
    assert (node.kv_events, node.kv_events_replay, node.kv_events_topic) == (
        "tcp://gpu-1.internal:5557", "tcp://[fd00::1]:5558", "kv@gpu-1",
    )  # fmt: skip
    assert config.routing.kv_index_blocks == 5000


# --- the gateway and a simulated vLLM node --------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("tokenizer"))


def kv_spec(tokenizer: Path) -> NodeSpec:
    return NodeSpec(
        name="kv1", models=[MODEL], tokenizer=str(tokenizer), kv_block_size=4,
        kv_events="tcp://127.0.0.1:0", kv_events_replay="tcp://127.0.0.1:0", kv_events_topic="kv@kv1",
    )  # fmt: skip


def kv_settings(node: SimulatedNode) -> dict[str, dict[str, object]]:
    assert node.kv_events is not None
    events = node.kv_events
    keys = {"kv_events": events.endpoint, "kv_events_replay": events.replay_endpoint, "kv_events_topic": "kv@kv1"}
    return {node.name: keys}


async def test_the_gateway_follows_a_nodes_kv_events(tmp_path: Path, tokenizer_dir: Path) -> None:
    async with serve_nodes([kv_spec(tokenizer_dir)]) as [node]:
        async with running_gateway(tmp_path, [node], node_settings=kv_settings(node)) as gateway:
            labels = f'{{node="{node.host}"}}'

            async def sample(name: str) -> float | None:
                return await gateway.metric(name + labels)

            with trio.fail_after(WAIT):
                while await sample("interlock_kv_events_flowing") != 1:
                    await trio.sleep(0.01)
            body = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
            assert (await gateway.http.post(gateway.url + "/v1/chat/completions", json=body)).status_code == 200
            async with httpx.AsyncClient(base_url=node.url, timeout=WAIT) as client:
                held = (await client.get("/_control/kv")).json()["blocks"]
                assert held > 1
                with trio.fail_after(WAIT):
                    while await sample("interlock_kv_index_blocks") != held:
                        await trio.sleep(0.01)
                assert await sample("interlock_kv_index_bytes") > 0
                assert (await client.post("/_control/kv/restart")).status_code == 200
            with trio.fail_after(WAIT):
                while await sample("interlock_kv_events_restarts_total") != 1:
                    await trio.sleep(0.01)
            assert await sample("interlock_kv_index_blocks") == 0

            write_config(tmp_path, [node])  # the node's kv_events gone: its subscriber stops
            assert await gateway.control_plane.reload()
            with trio.fail_after(WAIT):
                while await sample("interlock_kv_events_flowing") is not None:
                    await trio.sleep(0.01)
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("interlock kv events")]


async def test_without_kv_events_the_gateway_loads_no_zeromq(tmp_path: Path) -> None:
    """`serve` of a config without kv_events, in a process of its own: zmq is never imported."""
    async with serve_nodes(node_specs(1)) as nodes:
        config = write_config(tmp_path, nodes)
        script = (
            "import os, sys, trio\n"
            "from interlock.serve import serve\n"
            "def ready(listening):\n"
            "    print('zmq imported:', 'zmq' in sys.modules, flush=True)\n"
            "    os._exit(0)\n"
            f"trio.run(lambda: serve({str(config)!r}, version='test', ready=ready))\n"
        )
        done = await trio.run_process([sys.executable, "-c", script], capture_stdout=True, cwd=REPO_ROOT)
    assert done.stdout.decode().splitlines()[-1] == "zmq imported: False"


async def test_each_worker_subscribes_itself(tmp_path: Path, tokenizer_dir: Path) -> None:
    """`serve --workers 2`: both workers subscribe to the node, each builds its index, and the
    leader's /metrics shows the node's (the largest a worker holds; flowing in every worker);
    after a SIGHUP that drops the node's kv_events, the workers' subscribers stop (a worker's
    gauges cannot be removed: they stay at 0)."""
    async with serve_nodes([kv_spec(tokenizer_dir)]) as [node]:
        assert node.kv_events is not None
        api_port, metrics_port = free_port(), free_port()

        def gateway_toml(node_settings: dict[str, dict[str, object]]) -> str:
            text = config_text([node], node_settings=node_settings, workers=2)
            text = text.replace('listen = "127.0.0.1:0"', f'listen = "127.0.0.1:{api_port}"', 1)
            return text.replace('metrics_listen = "127.0.0.1:0"', f'metrics_listen = "127.0.0.1:{metrics_port}"')

        config = tmp_path / "gateway.toml"
        config.write_text(gateway_toml(kv_settings(node)))
        async with serve_process(config) as gateway, httpx.AsyncClient(timeout=WAIT, trust_env=False) as http:
            await gateway.wait_for_log("api server listening")
            metrics = f"http://127.0.0.1:{metrics_port}/metrics"
            flowing = f'interlock_kv_events_flowing{{node="{node.host}"}} 1.0'
            with trio.fail_after(WAIT):
                while node.kv_events.subscriptions < 2 or flowing not in (await http.get(metrics)).text:
                    await trio.sleep(0.05)
            body = {"model": MODEL, "prompt": "The capital of France is the city of", "max_tokens": 2}
            assert (await http.post(f"http://127.0.0.1:{api_port}/v1/completions", json=body)).status_code == 200
            held = (await http.get(node.url + "/_control/kv")).json()["blocks"]
            assert held > 1
            blocks = f'interlock_kv_index_blocks{{node="{node.host}"}} {float(held)}'
            with trio.fail_after(WAIT):
                while blocks not in (await http.get(metrics)).text:
                    await trio.sleep(0.05)
            config.write_text(gateway_toml({}))
            gateway.process.send_signal(signal.SIGHUP)  # the workers follow the leader's reload
            stopped = f'interlock_kv_events_flowing{{node="{node.host}"}} 0.0'
            with trio.fail_after(WAIT):
                while stopped not in (await http.get(metrics)).text:
                    await trio.sleep(0.05)
            gateway.process.send_signal(signal.SIGTERM)
            code, _, errors = await gateway.exit()
        assert (code, errors) == (0, "")

"""The bounded channel from nats-py's asyncio loop to trio (`fleet.bridge.Delivery`) against a
real nats-server: while the trio thread is busy the loop goes on receiving, drops what the
channel has no room for and counts it; the follower then reads the stream again from its last
whole message and applies every event, in order, once; the export's reader does the same. The
replicas' observations, sent at most once, go through a lossy one, which goes on after a drop."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import nats
import pytest
import trio

from controlplane.infrastructure.config import load_config
from controlplane.effects.control_plane import open_control_plane
from events.config import Config, FleetConfig
from events.log import decode_event, encode_event
from events.types import RunStarted, UpstreamRecovered
from fixtures.node import serve_nodes
from fleet.bridge import DeliveryOverflowed, open_asyncio_thread
from fleet.jetstream import READ_BATCH, FleetLink
from fleet.replica import FOLLOW_BUFFER, FleetControlPlane

from harness import CapturedLog, config_text, node_specs
from nats_cluster import nats_servers, stream_info

FLEET = FleetConfig(nats=(), name="delivery", replica="writer", lease=60.0, lease_renewal=1.0)
WAIT = 60.0


def unexpected(error: BaseException) -> None:
    raise AssertionError(f"unexpected asyncio failure: {error!r}")


def publish_from_another_thread(url: str, subject: str, messages: list[bytes], stream: str = "") -> threading.Thread:
    """Publish `messages` in order from a thread with its own client: to `stream`, each
    acknowledged, or (no stream) as core NATS messages."""

    async def publish() -> None:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            for data in messages:
                if stream:
                    await js.publish(subject, data, stream=stream)
                else:
                    await nc.publish(subject, data)
            await nc.flush()
        finally:
            await nc.close()

    thread = threading.Thread(target=lambda: asyncio.run(publish()))
    thread.start()
    return thread


def block_trio_until(condition, what: str) -> None:
    """Keep the trio thread busy (no trio task runs) until `condition()`, polled."""
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT}s: {what}"
        time.sleep(0.01)


def recovered(first_seq: int, count: int) -> list[bytes]:
    """`count` messages of one event each, numbered from `first_seq`."""
    seqs = range(first_seq, first_seq + count)
    return [encode_event(UpstreamRecovered(at=1.0, node="10.0.0.1", seq=seq)) for seq in seqs]


async def test_a_full_delivery_drops_counts_and_tells_the_receiver(tmp_path):
    dropped = []
    async with nats_servers(tmp_path) as [server], open_asyncio_thread(unexpected) as bridge:
        link = FleetLink(bridge, msgspec.structs.replace(FLEET, nats=(server.url,)))
        await link.connect()
        delivery = link.delivery(4, on_drop=lambda: dropped.append(threading.current_thread()))
        subscription = await link.follow_events(1, delivery)
        events = link.names.subject("events")
        thread = publish_from_another_thread(server.url, events, recovered(1, 20), link.names.events)
        block_trio_until(lambda: len(dropped) == 16, "16 of 20 messages dropped")  # the loop went on meanwhile
        thread.join()
        assert {thread.name for thread in dropped} == {"interlock-asyncio"}
        received = [(await delivery.receive()).seq for _ in range(4)]
        assert received == [1, 2, 3, 4]
        with pytest.raises(DeliveryOverflowed):
            await delivery.receive()
        delivery.close()
        await link.unsubscribe(subscription)
        await link.close()


async def test_a_follower_fallen_behind_reads_the_stream_again_and_loses_nothing(tmp_path):
    """The replica's trio thread is kept busy while more messages than its delivery holds
    arrive: it drops the rest, then reads on from its last whole message."""
    count = FOLLOW_BUFFER * 4
    log = CapturedLog()
    async with (
        nats_servers(tmp_path) as [server],
        serve_nodes(node_specs(1)) as nodes,
        open_asyncio_thread(unexpected) as bridge,
    ):
        fleet = msgspec.structs.replace(FLEET, nats=(server.url,))
        writer = FleetLink(bridge, fleet)
        await writer.connect()
        await writer.take_lease("writer")  # held for the test: the replica follows
        run_started = RunStarted(at=1.0, version="test", config_path="g", config=Config(), seq=1)
        assert await writer.append(encode_event(run_started), 0) == 1
        config_path = tmp_path / "gateway.toml"
        config_path.write_text(
            config_text(nodes, health_interval="1s")
            + f'[fleet]\nnats = ["{server.url}"]\nname = "{FLEET.name}"\nreplica = "follower"\nlease = "60s"\n'
        )
        config = load_config(config_path)
        async with open_control_plane(
            config_path, kind=FleetControlPlane, config=config, version="test", log=log
        ) as replica:
            with trio.fail_after(WAIT):
                while replica.view.snapshot.seq < 1:
                    await trio.sleep(0.01)
            dropped = "interlock_fleet_deliveries_dropped_total"
            events = writer.names.subject("events")
            thread = publish_from_another_thread(server.url, events, recovered(2, count), writer.names.events)
            block_trio_until(lambda: replica.registry.get_sample_value(dropped) > 0, "a message dropped")
            thread.join()
            with trio.fail_after(WAIT):
                while replica.view.snapshot.seq < count + 1:
                    await trio.sleep(0.01)
            assert replica.view.snapshot.seq == count + 1
        await writer.close()
    messages = log.messages()
    assert "fleet: the follower fell behind its deliveries; reading the stream again" in messages
    assert "fleet: gap in the event stream; resubscribing" not in messages



async def test_the_export_reader_fallen_behind_reads_on_from_its_last_message(tmp_path):
    count = READ_BATCH * 4
    dropped = []
    async with nats_servers(tmp_path) as [server], open_asyncio_thread(unexpected) as bridge:
        link = FleetLink(bridge, msgspec.structs.replace(FLEET, nats=(server.url,)))
        await link.connect()
        read: list[list[tuple[int, bytes]]] = []
        async with trio.open_nursery() as nursery:

            async def read_all() -> None:
                read.append(await link.read_messages(1, count, on_drop=lambda: dropped.append(1)))

            nursery.start_soon(read_all)
            with trio.fail_after(WAIT):
                while (await stream_info(server.url, link.names.events)).state.consumer_count == 0:
                    await trio.sleep(0.01)
            events = link.names.subject("events")
            thread = publish_from_another_thread(server.url, events, recovered(1, count), link.names.events)
            block_trio_until(lambda: dropped, "a message dropped")
            thread.join()
        await link.close()
    assert [seq for seq, _ in read[0]] == list(range(1, count + 1))
    assert [decode_event(data).seq for _, data in read[0]] == list(range(1, count + 1))


async def test_a_lossy_delivery_drops_what_finds_no_room_and_goes_on(tmp_path):
    """The replicas' observations (core NATS, sent at most once) reach the leader through a
    lossy delivery: a full one drops and counts, and the next message with room arrives."""
    dropped = []
    async with nats_servers(tmp_path) as [server], open_asyncio_thread(unexpected) as bridge:
        link = FleetLink(bridge, msgspec.structs.replace(FLEET, nats=(server.url,)))
        await link.connect()
        delivery = link.delivery(4, on_drop=lambda: dropped.append(1), lossy=True)
        subscription = await link.receive_observations(delivery)
        subject = link.names.subject("observations")
        thread = publish_from_another_thread(server.url, subject, [b"%d" % n for n in range(20)])
        block_trio_until(lambda: len(dropped) == 16, "16 of 20 observations dropped")
        thread.join()
        assert [await delivery.receive() for _ in range(4)] == [b"0", b"1", b"2", b"3"]
        publish_from_another_thread(server.url, subject, [b"after"]).join()
        with trio.fail_after(WAIT):
            assert await delivery.receive() == b"after"
        delivery.close()
        await link.unsubscribe(subscription)
        await link.close()

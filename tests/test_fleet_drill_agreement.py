"""A replica whose state disagrees with the fleet's says so, with one nats-server and three
replicas (`interlock serve` subprocesses with `[fleet]`): a checkpoint on the fleet's
checkpoint subject whose seq, or whose state, is not what a replica holds after the message it
names makes every replica degraded (`X-Interlock-Degraded` on `/ready`, which stays 200, and
`interlock_fleet_state_disagrees` 1), until the next leader's checkpoint agrees again. NATS
back without its store after an outage long enough for every replica to be in a partition: the
replicas leave their partitions, the new stream starts a new epoch from the leader's state, and
every replica follows it on one state, agreeing with the leader's checkpoints.
"""

from __future__ import annotations

import asyncio
import shutil
import signal

import httpx
import nats
import trio

from events.log import encode_event
from events.types import Checkpoint
from fleet.jetstream import CHECKPOINT_MESSAGE_HEADER, CHECKPOINT_STREAM_HEADER
from nats_cluster import nats_servers, stream_info
from fixtures.node import serve_nodes
from harness import node_specs
from test_fleet import Observed, Replica, _seq_passed, agreed, events_in, fleet_events, fleet_of, named, until
from test_fleet_messages import one_server_fleet


async def publish_checkpoint(url: str, checkpoint: Checkpoint, message_seq: int) -> None:
    """Publish `checkpoint` as of message `message_seq` of the fleet's event stream, as any
    client of the NATS server may (on a thread)."""
    created = (await stream_info(url, "interlock-events")).created
    headers = {CHECKPOINT_MESSAGE_HEADER: str(message_seq), CHECKPOINT_STREAM_HEADER: str(created)}

    async def send() -> None:
        nc = await nats.connect(url)
        try:
            await nc.publish("interlock.checkpoints", encode_event(checkpoint), headers=headers)
            await nc.flush()
        finally:
            await nc.close()

    await trio.to_thread.run_sync(lambda: asyncio.run(send()))


async def last_message(url: str) -> tuple[int, int]:
    """The event stream's last message and the seq of its last event."""
    messages = await fleet_events(url)
    return messages[-1][0], events_in(messages[-1:])[-1].seq


async def disagreement(http: httpx.AsyncClient, replica: Replica) -> tuple[int, str, float]:
    """`/ready`'s status and X-Interlock-Degraded, and `interlock_fleet_state_disagrees`."""
    ready = await http.get(replica.url + "/ready", timeout=5)
    disagrees = await replica.metric(http, "interlock_fleet_state_disagrees")
    return ready.status_code, ready.headers.get("X-Interlock-Degraded", ""), disagrees


async def test_a_replica_whose_seq_or_digest_disagrees_with_a_checkpoint_says_so(tmp_path):
    async with one_server_fleet(tmp_path) as (server, nodes, replicas, http):
        observed = Observed()
        before = await agreed(http, replicas, observed)
        for replica in replicas:
            assert await disagreement(http, replica) == (200, "", 0)

        # the fleet at one seq less than every replica holds after that message
        message, seq = await last_message(server.url)
        behind = Checkpoint(seq=seq - 1, at=1.0, version="", config_path="", config=None, nodes=())
        await publish_checkpoint(server.url, behind, message)
        said = (
            f"after message {message} of the fleet's event stream this replica is at seq {seq}, "
            f"the fleet's checkpoint at seq {seq - 1}"
        )

        async def every_replica_says(what: str) -> bool:
            return [await disagreement(http, replica) for replica in replicas] == [(200, what, 1)] * len(replicas)

        await until(lambda: every_replica_says(said), "every replica saying its seq disagrees")

        # the fleet at the same seq in another state
        message, seq = await last_message(server.url)
        other = Checkpoint(seq=seq, at=1.0, version="not the fleet's", config_path="", config=None, nodes=())
        await publish_checkpoint(server.url, other, message)

        async def every_replica_says_its_digest_disagrees() -> bool:
            answers = [await disagreement(http, replica) for replica in replicas]
            return all(
                (status, disagrees) == (200, 1) and degraded.startswith(f"at seq {seq} this replica's state digest is ")
                and degraded.endswith(f", the fleet's checkpoint's {other.digest()}")
                for status, degraded, disagrees in answers
            )

        await until(every_replica_says_its_digest_disagrees, "every replica saying its digest disagrees")

        # a new leader's first checkpoint agrees with every replica's state
        leader = named(replicas, before.leader)
        leader.signal(signal.SIGKILL)
        survivors = [replica for replica in replicas if replica is not leader]
        await until(lambda: every_survivor_agrees(http, survivors), "the survivors agreeing again")
        after = await agreed(http, survivors, observed, excluding=leader.name)
        assert after.seq > before.seq
        assert observed.disagreements() == {}


async def every_survivor_agrees(http: httpx.AsyncClient, survivors: list[Replica]) -> bool:
    return [await disagreement(http, replica) for replica in survivors] == [(200, "", 0)] * len(survivors)


async def test_a_store_lost_during_a_partition_starts_a_new_epoch_on_one_state(tmp_path):
    async with (
        nats_servers(tmp_path) as [server],
        serve_nodes(node_specs(2)) as nodes,
        fleet_of(tmp_path, nodes, [server], fleet_keys='partition_after = "1s"\n') as replicas,
        httpx.AsyncClient() as http,
    ):
        observed = Observed()
        before = await agreed(http, replicas, observed)
        await server.kill()

        async def all_partitioned() -> bool:
            return all([(await replica.health(http)).partition for replica in replicas])

        await until(all_partitioned, "every replica in a partition")
        shutil.rmtree(server.store)
        await server.start()

        async def all_following_one_stream() -> bool:
            answers = [await replica.health(http) for replica in replicas]
            return all(answer.partition == answer.degraded == "" for answer in answers) and all(
                [await disagreement(http, replica) == (200, "", 0) for replica in replicas]
            )

        await until(all_following_one_stream, "every replica out of its partition, on the new stream")
        await until(lambda: _seq_passed(http, replicas, before.seq + 5), "the new epoch applied everywhere")
        after = await agreed(http, replicas, observed)
        assert observed.disagreements() == {}
        for replica in replicas:
            assert "fleet: the event stream is new (NATS lost its store); following it from its first checkpoint" in (
                replica.messages()
            ), replica.name
        seqs = [event.seq for event in events_in(await fleet_events(server.url))]
        assert seqs[0] > before.seq  # the new epoch numbers on from the leader's state
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[-1] >= after.seq

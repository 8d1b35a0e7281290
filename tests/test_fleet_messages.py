"""No message stops the fleet: one nats-server, three replicas (`interlock serve` subprocesses
with `[fleet]`), simulated nodes, and messages published by an outsider on the fleet's own
subjects. A message on the event stream that does not decode, or whose event is out of
sequence, is named in every replica's log, counted and set aside: every replica keeps serving
and ready, the leader numbers on after it, a replica restarted after it starts again, and the
export is the log of the fleet's events without it."""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import nats
import trio

from events.config import FleetConfig
from events.log import decode_event, encode_event
from events.types import UpstreamRecovered
from fixtures.node import SimulatedNode, serve_nodes
from fleet.export import export_events
from fleet.replica import OUT_OF_SEQUENCE_RETRIES
from harness import node_specs
from nats_cluster import NatsServer, nats_servers
from test_fleet import (
    WAIT,
    Observed,
    Replica,
    _seq_passed,
    agreed,
    events_in,
    fleet_events,
    fleet_of,
    steady_load,
    until,
)


async def publish(url: str, subject: str, data: bytes) -> None:
    """Publish `data` on `subject` as any client of the NATS server may (on a thread)."""

    async def send() -> None:
        nc = await nats.connect(url)
        try:
            await nc.publish(subject, data)
            await nc.flush()
        finally:
            await nc.close()

    await trio.to_thread.run_sync(lambda: asyncio.run(send()))


async def set_aside_count(http: httpx.AsyncClient, replica: Replica, subject: str, reason: str) -> float:
    response = await http.get(f"http://127.0.0.1:{replica.metrics_port}/metrics", timeout=5)
    prefix = f'interlock_fleet_messages_set_aside_total{{reason="{reason}",subject="{subject}"}} '
    return sum(float(line.split()[-1]) for line in response.text.splitlines() if line.startswith(prefix))


@asynccontextmanager
async def one_server_fleet(
    tmp_path: Path,
) -> AsyncIterator[tuple[NatsServer, list[SimulatedNode], list[Replica], httpx.AsyncClient]]:
    """One NATS server, two simulated nodes, three replicas and an HTTP client."""
    async with (
        nats_servers(tmp_path) as [server],
        serve_nodes(node_specs(2)) as nodes,
        fleet_of(tmp_path, nodes, [server]) as replicas,
        httpx.AsyncClient() as http,
    ):
        yield server, nodes, replicas, http


@asynccontextmanager
async def serving_and_ready(http: httpx.AsyncClient, replicas: list[Replica]) -> AsyncIterator[list[str]]:
    """Requests through every replica and every replica's `/ready` polled, for the block;
    yields the list of failed requests and answers but 200 (none expected)."""

    async def ready_all_along() -> None:
        while True:
            for replica in replicas:
                status, body = await replica.ready(http)
                if status != 200:
                    failures.append(f"{replica.name}: /ready {status} {body}")
            await trio.sleep(0.05)

    async with steady_load(http, replicas) as failures, trio.open_nursery() as nursery:
        nursery.start_soon(ready_all_along)
        yield failures
        nursery.cancel_scope.cancel()


async def test_a_message_that_does_not_decode_is_set_aside_and_the_fleet_numbers_on(tmp_path):
    async with one_server_fleet(tmp_path) as (server, nodes, replicas, http):
        observed = Observed()
        before = await agreed(http, replicas, observed)
        async with serving_and_ready(http, replicas) as failures:
            await publish(server.url, "interlock.events", b"\x00not an event\xff at all")

            async def every_replica_set_them_aside() -> bool:
                events = [await set_aside_count(http, replica, "events", "undecodable") for replica in replicas]
                observations = [await set_aside_count(http, replica, "observations", "undecodable") for replica in replicas]
                if sum(observations) == 0:  # sent at most once, to whoever leads now: again until one has
                    await publish(server.url, "interlock.observations", b"[1, 2, 3]")
                return events == [1.0] * len(replicas) and sum(observations) >= 1  # the leader's

            await until(every_replica_set_them_aside, "every replica setting the message aside")
            await until(lambda: _seq_passed(http, replicas, before.seq + 5), "every replica applying events after it")
        assert failures == []
        for replica in replicas:
            assert replica.process.returncode is None, replica.name
            assert "fleet: a message of the event stream set aside" in replica.messages()

        # a replica started after it, and after a checkpoint that is not one, starts again
        follower = next(replica for replica in replicas if replica.name != before.leader)
        follower.signal(signal.SIGKILL)
        await follower.process.wait()
        await publish(server.url, "interlock.checkpoints", b"{not a checkpoint")
        await follower.start()
        after = await agreed(http, replicas, observed)
        assert after.seq > before.seq + 5
        assert follower.messages().count("fleet: the newest checkpoint set aside") == 1
        assert observed.disagreements() == {}

        # the export is the log of the fleet's events, the message set aside and named
        named: list[tuple[int, str]] = []
        fleet = FleetConfig(nats=(server.url,), name="interlock", replica="export", lease=1.0, lease_renewal=0.5)
        path, written = await export_events(fleet, tmp_path / "export", lambda seq, why: named.append((seq, why)))
        messages = await fleet_events(server.url)
        garbage = [seq for seq, data in messages if data.startswith(b"\x00")]
        assert [seq for seq, _ in named] == garbage and "does not decode" in named[0][1]
        exported = [decode_event(line).seq for line in path.read_bytes().splitlines()]
        assert exported == list(range(1, written + 1)) and written >= after.seq


async def test_an_event_out_of_sequence_is_read_again_a_few_times_then_set_aside(tmp_path):
    """A well-formed event whose seq skips far ahead: every follower reads it again
    OUT_OF_SEQUENCE_RETRIES times (pausing longer each time, never a tight loop), serving and
    ready all the while, then sets it aside; the leader appends after it, numbering on from the
    events it applied, and every replica applies those."""
    async with one_server_fleet(tmp_path) as (server, nodes, replicas, http):
        observed = Observed()
        before = await agreed(http, replicas, observed)
        async with serving_and_ready(http, replicas) as failures:
            ahead = encode_event(UpstreamRecovered(at=1.0, node=nodes[0].host, seq=before.seq + 1000))
            await publish(server.url, "interlock.events", ahead)

            async def every_replica_set_it_aside() -> bool:
                counts = [await set_aside_count(http, replica, "events", "out_of_sequence") for replica in replicas]
                return counts == [1.0] * len(replicas)

            await until(every_replica_set_it_aside, "every replica setting the event aside")
            await until(lambda: _seq_passed(http, replicas, before.seq + 5), "every replica applying events after it")
        assert failures == []
        for replica in replicas:
            reads = replica.messages().count("fleet: a message of the event stream is out of sequence; reading it again")
            assert reads == OUT_OF_SEQUENCE_RETRIES, replica.name
        assert any(
            "fleet: the event stream has a message the leader did not append; numbering on after it" in replica.messages()
            for replica in replicas
        )
        await agreed(http, replicas, observed)
        assert observed.disagreements() == {}
        seqs = [event.seq for event in events_in(await fleet_events(server.url))]
        seqs.remove(before.seq + 1000)
        assert seqs == list(range(1, len(seqs) + 1))


async def test_a_replica_whose_name_a_live_replica_holds_does_not_start(tmp_path):
    """A second replica named as a running one exits at start naming the one that holds the
    name; a replica restarted on its host takes its name back at once (its process is gone)."""
    async with one_server_fleet(tmp_path) as (server, nodes, replicas, http):
        await agreed(http, replicas, Observed())
        live = replicas[0]
        directory = tmp_path / "second-r1"
        directory.mkdir()
        (directory / "gateway.toml").write_text(live.config_path.read_text())
        second = Replica("r1", directory / "gateway.toml", directory / "log.jsonl")
        await second.start()
        with trio.fail_after(WAIT):
            assert await second.process.wait() == 1
        [fatal] = [line for line in second.log_path.read_text().splitlines() if line.startswith("fatal:")]
        assert fatal == (
            f"fatal: fleet: the replica name 'r1' is held by a live replica (pid {live.process.pid} on "
            f"{socket.gethostname()}, listening on 127.0.0.1:{live.api_port}); give each replica its own [fleet] replica"
        )
        assert (await live.health(http)).replica == "r1"  # the live one serves on

        live.signal(signal.SIGKILL)
        await live.process.wait()
        await live.start()
        await agreed(http, replicas, Observed())
        assert "fleet: claiming this replica's name failed" not in live.messages()


async def test_a_store_that_comes_back_empty_is_created_again_and_the_fleet_goes_on(tmp_path):
    """NATS restarted without its store: the replicas create the streams and buckets again,
    one leads, its state is the new epoch's start (a checkpoint, then its events numbered on),
    every replica follows it to the same state at the same seq, and a replica restarted then
    catches up from the new stream."""
    async with one_server_fleet(tmp_path) as (server, nodes, replicas, http):
        observed = Observed()
        before = await agreed(http, replicas, observed)
        await server.kill()
        shutil.rmtree(server.store)
        await server.start()
        await until(lambda: _seq_passed(http, replicas, before.seq + 5), "every replica applying events again")
        after = await agreed(http, replicas, observed)
        assert any(
            "fleet: the fleet's streams are gone (NATS lost its store); creating them" in replica.messages()
            for replica in replicas
        )
        follower = next(replica for replica in replicas if replica.name != after.leader)
        follower.signal(signal.SIGKILL)
        await follower.process.wait()
        await follower.start()
        restarted = await agreed(http, replicas, observed)
        assert restarted.seq > after.seq
        assert observed.disagreements() == {}

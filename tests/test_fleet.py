"""The fleet with real processes: three `nats-server`s clustered on loopback (streams kept three
times), three replicas (`interlock serve` subprocesses with `[fleet]`), simulated nodes.

Every replica reaches the same state digest at the same seq; one leader probes; a leader killed
is replaced and the seqs go on without gap or duplicate; an append after a stale message is
refused, a batch of events whole;
a leader paused past its lease steps down and follows. The NATS server leading the event
stream killed under load loses no request and no event; a replica cut off from NATS serves on
its last state, ready and degraded (X-Interlock-Degraded), and catches up when its server is
back; with all of NATS gone the replicas serve on their last state, ready and degraded, and
catch up when it is back; a restarted replica catches up from a checkpoint; a
node killed is avoided through every replica. The export reads a long stream in order; the
streams are kept once per server of the cluster, whatever URLs a replica lists.
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import nats
import nats.errors
import pytest
import trio

from controlplane.infrastructure.config import fleet_wide, load_config
from controlplane.rules.reducer import INITIAL_STATE, reduce
from events.config import Config, FleetConfig
from events.log import decode_event, encode_event
from events.types import Checkpoint, ConfigReloaded, Event, HealthProbed, RunStarted, UpstreamRecovered
from fixtures.node import SimulatedNode, serve_nodes
from fleet.bridge import open_asyncio_thread
from fleet.export import export_events
from fleet.jetstream import AppendRefused, FleetLink, StoredCheckpoint
from harness import MODEL, PROJECT_ROOT, chat, config_text, free_port, node_specs
from nats_cluster import NatsServer, nats_servers, stream_info

LEASE = "2s"
LEASE_RENEWAL = "500ms"
HEALTH_INTERVAL = "1s"
WAIT = 60.0
"""The deadline of each wait (generous: the machine is shared; no assertion is on time)."""


@dataclass
class Replica:
    """One `interlock serve` replica; its JSON log goes to `log_path`."""

    name: str
    config_path: Path
    log_path: Path
    api_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    process: trio.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    async def start(self) -> None:
        self.process = await trio.lowlevel.open_process(
            [
                sys.executable, "-m", "interlock.cli", "serve", "--config", str(self.config_path),
                "--listen", f"127.0.0.1:{self.api_port}", "--metrics-listen", f"127.0.0.1:{self.metrics_port}",
            ],  # fmt: skip
            stdout=self.log_path.open("ab"),
            stderr=subprocess.STDOUT,
            cwd=PROJECT_ROOT,
        )

    def lines(self) -> list[dict]:
        lines = self.log_path.read_bytes().splitlines()
        return [msgspec.json.decode(line) for line in lines if line.startswith(b"{")]

    def messages(self) -> list[str]:
        return [line.get("msg", "") for line in self.lines()]

    async def health(self, http: httpx.AsyncClient) -> Health | None:
        try:
            response = await http.get(self.url + "/health", timeout=2)
        except httpx.HTTPError:
            return None
        headers = response.headers
        return Health(
            replica=headers["X-Interlock-Replica"],
            leader=headers["X-Interlock-Leader"],
            seq=int(headers["X-Interlock-Seq"]),
            digest=headers["X-Interlock-State-Digest"],
            stale=headers.get("X-Interlock-Stale", ""),
            degraded=headers.get("X-Interlock-Degraded", ""),
            partition=headers.get("X-Interlock-Partition", ""),
        )

    async def ready(self, http: httpx.AsyncClient) -> tuple[int, dict]:
        response = await http.get(self.url + "/ready", timeout=5)
        return response.status_code, response.json()

    async def metric(self, http: httpx.AsyncClient, name: str) -> float:
        response = await http.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5)
        [value] = [line.split()[-1] for line in response.text.splitlines() if line.startswith(name + " ")]
        return float(value)

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signum)


@dataclass(frozen=True)
class Health:
    replica: str
    leader: str
    seq: int
    digest: str
    stale: str
    degraded: str
    partition: str
    """The partition the replica is in (`fleet.partition`: its seqs are its own), "" when none."""


@asynccontextmanager
async def fleet_of(
    tmp_path: Path,
    nodes: Sequence[SimulatedNode],
    servers: Sequence[NatsServer],
    count: int = 3,
    gateway: Sequence[dict[str, object]] = (),
    one_server_each: bool = False,
    fleet_keys: str = "",
) -> AsyncIterator[list[Replica]]:
    """`count` replicas r1, r2, … of one fleet on `servers`, killed at the end; `gateway[i]`
    adds [gateway] keys to the config of replica i + 1, `fleet_keys` TOML lines to every
    replica's [fleet] (each writes its partitions in its directory's `partitions`). With
    `one_server_each`, replica i lists server i alone, and the streams are kept once per server
    (`stream_replicas`)."""
    replicas = []
    for index in range(1, count + 1):
        directory = tmp_path / f"r{index}"
        directory.mkdir()
        listed = [servers[index - 1]] if one_server_each else servers
        urls = ", ".join(f'"{server.url}"' for server in listed)
        fleet = f'[fleet]\nnats = [{urls}]\nreplica = "r{index}"\nlease = "{LEASE}"\nlease_renewal = "{LEASE_RENEWAL}"\n'
        fleet += f'partition_dir = "{directory / "partitions"}"\n'
        fleet += fleet_keys
        if one_server_each:
            fleet += f"stream_replicas = {len(servers)}\n"
        config_path = directory / "gateway.toml"
        settings = gateway[index - 1] if index <= len(gateway) else {}
        config_path.write_text(config_text(nodes, health_interval=HEALTH_INTERVAL, **settings) + fleet)
        replicas.append(Replica(f"r{index}", config_path, directory / "log.jsonl"))
    try:
        for replica in replicas:
            await replica.start()
        yield replicas
    finally:
        with trio.CancelScope(shield=True):
            for replica in replicas:
                replica.signal(signal.SIGCONT)
                replica.signal(signal.SIGKILL)
                if replica.process is not None:
                    await replica.process.wait()


@asynccontextmanager
async def running_fleet(
    tmp_path: Path, nats_count: int, *, upstream_key: str = ""
) -> AsyncIterator[tuple[list[NatsServer], list[SimulatedNode], list[Replica], httpx.AsyncClient]]:
    """`nats_count` NATS servers, two simulated nodes, three replicas and an HTTP client. With
    `upstream_key`, the nodes run with vLLM's `--api-key` and every replica names its key file."""
    specs = [dataclasses.replace(spec, api_key=upstream_key) for spec in node_specs(2)]
    gateway = ()
    if upstream_key:
        key_file = tmp_path / "upstream-key"
        key_file.write_text(upstream_key)
        gateway = [{"upstream_api_key_file": str(key_file)}] * 3
    async with (
        nats_servers(tmp_path, nats_count) as servers,
        serve_nodes(specs) as nodes,
        fleet_of(tmp_path, nodes, servers, gateway=gateway) as replicas,
        httpx.AsyncClient() as http,
    ):
        yield servers, nodes, replicas, http


@asynccontextmanager
async def steady_load(http: httpx.AsyncClient, replicas: Sequence[Replica]) -> AsyncIterator[list[str]]:
    """Requests through every replica, one after another on each, for the block; yields the
    list of failures (none expected), each naming the replica and what went wrong."""
    failures: list[str] = []

    async def through(replica: Replica) -> None:
        while True:
            try:
                response = await http.post(replica.url + "/v1/chat/completions", json=chat(MODEL), timeout=10)
            except httpx.HTTPError as error:
                failures.append(f"{replica.name}: {error!r}")
            else:
                if response.status_code != 200:
                    failures.append(f"{replica.name}: {response.status_code} {response.text}")
            await trio.sleep(0.02)

    async with trio.open_nursery() as nursery:
        for replica in replicas:
            nursery.start_soon(through, replica)
        yield failures
        nursery.cancel_scope.cancel()


async def until(condition, what: str) -> None:
    """Wait (WAIT at most) until the async `condition()` is true."""
    with trio.move_on_after(WAIT):
        while not await condition():
            await trio.sleep(0.1)
        return
    raise AssertionError(f"not within {WAIT}s: {what}")


def named(replicas: Sequence[Replica], name: str) -> Replica:
    return next(replica for replica in replicas if replica.name == name)


class Observed:
    """Every (seq, digest) any replica answered with outside a partition: one seq must never
    have two digests."""

    def __init__(self) -> None:
        self.digests: dict[int, set[str]] = {}

    async def poll(self, http: httpx.AsyncClient, replicas: Sequence[Replica]) -> list[Health | None]:
        answers = [await replica.health(http) for replica in replicas]
        for answer in answers:
            if answer is not None and answer.seq > 0 and not answer.partition:
                self.digests.setdefault(answer.seq, set()).add(answer.digest)
        return answers

    def disagreements(self) -> dict[int, set[str]]:
        return {seq: digests for seq, digests in self.digests.items() if len(digests) > 1}


async def agreed(http, replicas: Sequence[Replica], observed: Observed, *, excluding: str = "") -> Health:
    """Wait until every replica answers with the same seq, digest and leader (not `excluding`)."""
    with trio.fail_after(WAIT):
        while True:
            answers = await observed.poll(http, replicas)
            first = answers[0]
            if (
                first is not None
                and first.seq > 0
                and first.leader not in ("", excluding)
                and all(
                    answer is not None and (answer.seq, answer.digest, answer.leader) == (first.seq, first.digest, first.leader)
                    for answer in answers
                )
            ):
                return first
            await trio.sleep(0.05)


async def fleet_events(url: str, name: str = "interlock") -> list[tuple[int, bytes]]:
    """Every message of the fleet's event stream as (stream seq, data), read with nats-py."""
    import asyncio

    async def read() -> list[tuple[int, bytes]]:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            info = await js.stream_info(f"{name}-events")
            return [
                (seq, (await js.get_msg(f"{name}-events", seq)).data)
                for seq in range(info.state.first_seq, info.state.last_seq + 1)
            ]
        finally:
            await nc.close()

    return await trio.to_thread.run_sync(lambda: asyncio.run(read()))


def events_in(messages: list[tuple[int, bytes]]) -> list[Event]:
    """The events of the stream's messages (each a batch of JSON Lines), in order."""
    return [decode_event(line) for _, data in messages for line in data.splitlines()]


def assert_gapless(messages: list[tuple[int, bytes]]) -> None:
    """The messages are numbered 1, 2, …, and their events, read in order, too."""
    assert [seq for seq, _ in messages] == list(range(1, len(messages) + 1))
    event_seqs = [event.seq for event in events_in(messages)]
    assert event_seqs == list(range(1, len(event_seqs) + 1))


async def test_every_replica_reaches_the_same_state_at_the_same_seq(tmp_path):
    async with running_fleet(tmp_path, 3, upstream_key="vllm-fleet-key") as (servers, nodes, replicas, http):
        observed = Observed()
        state = await agreed(http, replicas, observed)
        assert state.leader in {"r1", "r2", "r3"}
        for replica in replicas:  # a request through each replica reaches a node, with the key it read
            response = await http.post(replica.url + "/v1/chat/completions", json=chat(MODEL), timeout=10)
            assert response.status_code == 200, response.text
            assert response.headers["X-Interlock-Replica"] == replica.name  # which replica proxied it
            streamed = await http.post(replica.url + "/v1/chat/completions", json=chat(MODEL, stream=True), timeout=10)
            assert (streamed.status_code, streamed.headers["X-Interlock-Replica"]) == (200, replica.name)
        state = await agreed(http, replicas, observed)
        assert observed.disagreements() == {}
        assert_gapless(await fleet_events(servers[0].url))
        # the stream, exported, is an event log the tools read
        export = await trio.run_process(
            [sys.executable, "-m", "interlock.cli", "fleet", "export", str(tmp_path / "export"), "--fleet", servers[1].url],
            capture_stdout=True,
            cwd=PROJECT_ROOT,
        )
        assert export.stdout.decode().startswith("wrote ")
        replay = await trio.run_process(
            [sys.executable, "-m", "interlock.cli", "replay", str(tmp_path / "export" / "events.jsonl"), "--json"],
            capture_stdout=True,
            cwd=PROJECT_ROOT,
        )
        assert msgspec.json.decode(replay.stdout)["seq"] >= state.seq


async def test_a_killed_leader_is_replaced_and_the_seqs_go_on(tmp_path):
    async with running_fleet(tmp_path, 3) as (servers, nodes, replicas, http):
        observed = Observed()
        before = await agreed(http, replicas, observed)
        leader = named(replicas, before.leader)
        leader.signal(signal.SIGKILL)
        survivors = [replica for replica in replicas if replica is not leader]
        after = await agreed(http, survivors, observed, excluding=leader.name)
        assert after.seq > before.seq
        await agreed(http, survivors, observed)
        assert observed.disagreements() == {}
        messages = await fleet_events(servers[0].url)
        assert_gapless(messages)
        assert any(isinstance(event, ConfigReloaded) for event in events_in(messages))  # the new term


def batch(first_seq: int, count: int, node: str) -> bytes:
    """`count` events numbered from `first_seq` as one message of the event stream."""
    seqs = range(first_seq, first_seq + count)
    return b"".join(encode_event(UpstreamRecovered(at=1.0, node=node, seq=seq)) for seq in seqs)


async def test_an_append_against_a_stale_last_message_is_refused_whole(tmp_path):
    """The fence itself: of two replicas appending after the same message, the second is
    refused, and a deposed leader's batch after a stale message lands not one of its events,
    though a later message's expected sequence would match the stream's."""
    fleet = FleetConfig(nats=(), name="fence", replica="r", lease=2.0, lease_renewal=0.5)
    async with nats_servers(tmp_path) as [server], open_asyncio_thread(failing_bridge) as bridge:
        fleet = msgspec.structs.replace(fleet, nats=(server.url,))
        leader, deposed = FleetLink(bridge, fleet), FleetLink(bridge, fleet)
        await leader.connect()
        await deposed.connect()
        assert await leader.append(batch(1, 2, "leader"), 0) == 1
        with pytest.raises(AppendRefused):
            await deposed.append(batch(1, 3, "deposed"), 0)
        assert await leader.append(batch(3, 4, "leader"), 1) == 2
        with pytest.raises(AppendRefused):  # the deposed leader's next batch, after its refused one
            await deposed.append(batch(4, 5, "deposed"), 1)
        messages = await fleet_events(server.url, "fence")
        assert_gapless(messages)
        assert [event.node for event in events_in(messages)] == ["leader"] * 6
        assert await deposed.message_seqs() == (1, 2)
        await leader.close()
        await deposed.close()


async def test_a_leader_paused_past_its_lease_steps_down_and_follows(tmp_path):
    """Its lease ran out while it was stopped: on SIGCONT it ends its term before it appends
    (were it to append, the fence above refuses it), and follows the new leader."""
    async with running_fleet(tmp_path, 3) as (servers, nodes, replicas, http):
        observed = Observed()
        before = await agreed(http, replicas, observed)
        paused = named(replicas, before.leader)
        paused.signal(signal.SIGSTOP)
        others = [replica for replica in replicas if replica is not paused]
        await agreed(http, others, observed, excluding=paused.name)
        paused.signal(signal.SIGCONT)
        with trio.fail_after(WAIT):
            while "fleet: following" not in paused.messages():
                await trio.sleep(0.05)
        state = await agreed(http, replicas, observed)
        assert state.leader != paused.name
        assert observed.disagreements() == {}
        assert_gapless(await fleet_events(servers[0].url))


async def test_each_node_is_probed_by_the_leader_alone(tmp_path):
    """Every health check a node answered is one health_probe event on the fleet's stream: the
    followers send none (three replicas probing on their own would make three per event)."""
    async with running_fleet(tmp_path, 1) as (servers, nodes, replicas, http):
        await agreed(http, replicas, Observed())

        def probes_on_the_stream(messages, node: SimulatedNode) -> int:
            return sum(1 for event in events_in(messages) if isinstance(event, HealthProbed) and event.node == node.host)

        with trio.fail_after(WAIT):
            while True:
                messages = await fleet_events(servers[0].url)
                if min(probes_on_the_stream(messages, node) for node in nodes) >= 5:
                    break
                await trio.sleep(0.2)
        checks = [sum(1 for request in node.requests if request.path == "/health") for node in nodes]
        messages = await fleet_events(servers[0].url)
        for node, answered in zip(nodes, checks):
            assert probes_on_the_stream(messages, node) <= answered <= probes_on_the_stream(messages, node) + 1


def failing_bridge(error: BaseException) -> None:
    raise AssertionError(error)


async def test_the_export_reads_a_long_stream_in_order(tmp_path):
    """A few thousand events in a few batched messages, exported through one consumer, are
    the log `replay` reads."""
    count, per_message = 3000, 256
    async with nats_servers(tmp_path) as [server], open_asyncio_thread(failing_bridge) as bridge:
        fleet = FleetConfig(nats=(server.url,), name="long", replica="r", lease=2.0, lease_renewal=0.5)
        link = FleetLink(bridge, fleet)
        await link.connect()
        await link.append(encode_event(RunStarted(at=1.0, version="test", config_path="gateway.toml", config=Config(), seq=1)), 0)
        message_seq = 1
        for first_seq in range(2, count + 1, per_message):
            events = batch(first_seq, min(per_message, count + 1 - first_seq), "10.0.0.1")
            message_seq = await link.append(events, message_seq)
        assert message_seq == 1 + -(-(count - 1) // per_message)
        await link.close()
        path, written = await export_events(fleet, tmp_path / "export")
    assert written == count
    assert [decode_event(line).seq for line in path.read_bytes().splitlines()] == list(range(1, count + 1))


async def test_a_stream_is_kept_by_every_server_of_the_cluster_and_found_by_any_url_list(tmp_path):
    """The first replica creates the streams with one copy per server it learns of (three
    here, though it lists one URL); a replica listing other URLs uses them as they are."""
    async with nats_servers(tmp_path, 3) as servers, open_asyncio_thread(failing_bridge) as bridge:
        fleet = FleetConfig(nats=(servers[0].url,), name="sized", replica="r1", lease=2.0, lease_renewal=0.5)
        with trio.fail_after(WAIT):
            while True:  # the cluster's routes form, and JetStream elects its leader, after the servers start
                first = FleetLink(bridge, fleet)
                try:
                    await first.connect(create=False)
                    if first.derived_stream_replicas() == 3:
                        await first.connect()
                        break
                except (nats.errors.Error, trio.TooSlowError):
                    pass
                await first.close()
                await trio.sleep(0.2)
        second = FleetLink(bridge, msgspec.structs.replace(fleet, nats=(servers[1].url, servers[2].url), replica="r2"))
        await second.connect()
        assert await first.append(b'{"type":"run_stopped","at":1.0,"seq":1}', 0) == 1
        assert await second.message_seqs() == (1, 1)
        info = await first._call(first._js.stream_info, first.names.events)
        assert info.config.num_replicas == 3
        await first.close()
        await second.close()


async def stream_leader(url: str, stream: str) -> str:
    """The name of the NATS server leading `stream`'s copies (where its appends land first)."""
    return (await stream_info(url, stream)).cluster.leader


async def test_the_event_streams_leading_server_killed_under_load_loses_no_request_and_no_event(tmp_path):
    async with running_fleet(tmp_path, 3) as (servers, nodes, replicas, http):
        observed = Observed()
        before = await agreed(http, replicas, observed)
        leading = await stream_leader(servers[0].url, "interlock-events")
        killed = next(server for server in servers if server.name == leading)
        async with steady_load(http, replicas) as failures:
            await killed.kill()
            # the two servers left (a quorum of three) elect a new leader of the stream, and the
            # fleet's leader goes on appending there
            await until(
                lambda: _seq_passed(http, replicas, before.seq + 10), "every replica applying events past the kill"
            )
        after = await agreed(http, replicas, observed)
        assert failures == []
        assert after.seq > before.seq
        assert observed.disagreements() == {}
        survivor = next(server for server in servers if server is not killed)
        assert await stream_leader(survivor.url, "interlock-events") != leading
        assert_gapless(await fleet_events(survivor.url))


async def test_a_replica_cut_off_from_nats_serves_on_its_last_state_and_catches_up(tmp_path):
    """Each replica lists one server of the cluster, which tells it of no other: the one whose
    server is killed is cut off (the others go on, a quorum of the stream's three copies left).
    It serves on its last state and stays ready (a balancer keeps it in rotation), degraded:
    /ready's and /health's X-Interlock-Degraded say why, interlock_fleet_degraded is 1, its
    seconds since an applied event grow; it catches up once its server is back. (Its partition,
    which would follow, is test_fleet_partition's.)"""
    async with (
        nats_servers(tmp_path, 3, advertise=False) as servers,
        serve_nodes(node_specs(2)) as nodes,
        fleet_of(tmp_path, nodes, servers, one_server_each=True, fleet_keys='partition_after = "1h"\n') as replicas,
        httpx.AsyncClient() as http,
    ):
        observed = Observed()
        before = await agreed(http, replicas, observed)
        cut_off = next(replica for replica in replicas if replica.name != before.leader)
        others = [replica for replica in replicas if replica is not cut_off]
        async with steady_load(http, replicas) as failures:
            await servers[replicas.index(cut_off)].kill()

            async def says_so() -> bool:
                ready = await http.get(cut_off.url + "/ready", timeout=5)
                health = await cut_off.health(http)
                degraded = ready.headers.get("X-Interlock-Degraded", "")
                return ready.status_code == 200 and degraded == health.degraded == "not connected to NATS"

            await until(says_so, "/ready 200 and X-Interlock-Degraded on the replica cut off")
            assert await cut_off.metric(http, "interlock_fleet_degraded") == 1
            last_state = await cut_off.health(http)
            since = await cut_off.metric(http, "interlock_fleet_seconds_since_applied")
            await until(lambda: _seq_passed(http, others, last_state.seq + 5), "the others going on")
            assert (await cut_off.health(http)).seq == last_state.seq
            assert await cut_off.metric(http, "interlock_fleet_seconds_since_applied") > since
            await servers[replicas.index(cut_off)].start()
            await until(lambda: _seq_passed(http, [cut_off], last_state.seq + 5), "the replica cut off catching up")
            await until(lambda: _is_ready(http, cut_off), "/ready 200 on the replica cut off")

            async def current_again() -> bool:
                return (await cut_off.health(http)).degraded == ""

            await until(current_again, "the replica cut off no longer degraded")
        assert failures == []
        after = await agreed(http, replicas, observed)
        assert (after.stale, after.degraded) == ("", "")
        assert await cut_off.metric(http, "interlock_fleet_degraded") == 0
        assert observed.disagreements() == {}
        assert_gapless(await fleet_events(servers[0].url))


async def _is_ready(http: httpx.AsyncClient, replica: Replica) -> bool:
    return (await replica.ready(http))[0] == 200


async def _seq_passed(http: httpx.AsyncClient, replicas: Sequence[Replica], seq: int) -> bool:
    answers = [await replica.health(http) for replica in replicas]
    return all(answer is not None and answer.seq > seq for answer in answers)


async def test_without_nats_the_replicas_serve_on_their_last_state_and_catch_up(tmp_path):
    async with running_fleet(tmp_path, 3) as (servers, nodes, replicas, http):
        observed = Observed()
        before = await agreed(http, replicas, observed)
        async with steady_load(http, replicas) as failures:
            for server in servers:
                await server.kill()

            async def all_ready_and_degraded() -> bool:
                answers = [await http.get(replica.url + "/ready", timeout=5) for replica in replicas]
                return all(
                    answer.status_code == 200
                    and answer.headers.get("X-Interlock-Degraded", "").startswith("not connected to NATS")
                    for answer in answers
                )

            await until(all_ready_and_degraded, "/ready 200 on every replica, degraded: not connected to NATS")

            async def no_leader_named() -> bool:  # the lease has run out: nobody renews it
                return [(await replica.health(http)).leader for replica in replicas] == [""] * len(replicas)

            await until(no_leader_named, "no replica naming a leader")
            cut_off = [await replica.metric(http, "interlock_fleet_seconds_since_applied") for replica in replicas]

            async def growing() -> bool:
                now = [await replica.metric(http, "interlock_fleet_seconds_since_applied") for replica in replicas]
                return all(later > earlier + 1 for earlier, later in zip(cut_off, now))

            await until(growing, "seconds since applied growing on every replica")
            for server in servers:
                await server.start()
            await until(lambda: _seq_passed(http, replicas, before.seq + 5), "every replica applying events again")

            async def none_degraded() -> bool:
                return [(await replica.health(http)).degraded for replica in replicas] == [""] * len(replicas)

            await until(none_degraded, "no replica degraded")
        assert failures == []
        await agreed(http, replicas, observed)
        assert observed.disagreements() == {}
        assert_gapless(await fleet_events(servers[0].url))


async def test_a_restarted_replica_catches_up_from_a_checkpoint(tmp_path):
    async with running_fleet(tmp_path, 3) as (servers, nodes, replicas, http):
        observed = Observed()
        before = await agreed(http, replicas, observed)
        follower = next(replica for replica in replicas if replica.name != before.leader)
        follower.signal(signal.SIGKILL)
        await follower.process.wait()
        starts = follower.messages().count("fleet: starting from a checkpoint")
        others = [replica for replica in replicas if replica is not follower]
        await until(lambda: _seq_passed(http, others, before.seq + 5), "the others going on")
        await follower.start()
        after = await agreed(http, replicas, observed)
        assert after.seq > before.seq + 5
        assert follower.messages().count("fleet: starting from a checkpoint") == starts + 1
        assert observed.disagreements() == {}


async def test_a_replica_starts_from_a_checkpoint_taken_inside_a_message(tmp_path):
    """A checkpoint names the last message whose events it includes all of (message 2 here)
    and includes part of the next (events 11 to 15 of message 3's 11 to 20): a replica
    starting from it follows from message 3, skips what the checkpoint includes, and goes on
    without a gap (a wrong start stalls it: the leader it becomes waits for event 20). The
    stream's config, which the replica keeps (the fleet has no config document: it seeds one
    from the state), names the node it then probes."""
    async with nats_servers(tmp_path) as servers, serve_nodes(node_specs(1)) as nodes:
        written = tmp_path / "written.toml"
        written.write_text(config_text(nodes))
        config = fleet_wide(load_config(written))
        events: list[Event] = [RunStarted(at=1.0, version="test", config_path=str(written), config=config, seq=1)]
        events += [UpstreamRecovered(at=float(seq), node="10.0.0.1", seq=seq) for seq in range(2, 21)]
        state = INITIAL_STATE
        for event in events[:15]:
            state, _ = reduce(state, event)
        fleet = FleetConfig(nats=(servers[0].url,), name="interlock", replica="writer", lease=2.0, lease_renewal=0.5)
        async with open_asyncio_thread(failing_bridge) as bridge:
            link = FleetLink(bridge, fleet)
            await link.connect()
            for message, (first, last) in enumerate([(1, 1), (2, 10), (11, 20)]):
                lines = b"".join(encode_event(event) for event in events[first - 1 : last])
                assert await link.append(lines, message) == message + 1
            await link.publish_checkpoint(StoredCheckpoint(encode_event(Checkpoint.of(state)), message_seq=2))
            await link.close()
        async with fleet_of(tmp_path, nodes, servers, count=1) as [replica], httpx.AsyncClient() as http:
            await until(lambda: _seq_passed(http, [replica], 21), "the replica applying its own events after 20")
            [start] = [line for line in replica.lines() if line.get("msg") == "fleet: starting from a checkpoint"]
            assert start["message_seq"] == "2" and "message" not in start  # one `msg` a line, no `message`
            assert not any("out of sequence" in message or "set aside" in message for message in replica.messages())
        assert_gapless(await fleet_events(servers[0].url))


async def test_a_checkpoint_written_before_batches_names_its_events_message(tmp_path):
    """A checkpoint without the message header was written when each message held one event,
    its sequence the event's: the message it names is its event seq."""
    fleet = FleetConfig(nats=(), name="older", replica="r", lease=2.0, lease_renewal=0.5)
    async with nats_servers(tmp_path) as [server], open_asyncio_thread(failing_bridge) as bridge:
        link = FleetLink(bridge, msgspec.structs.replace(fleet, nats=(server.url,)))
        await link.connect()
        state, _ = reduce(INITIAL_STATE, RunStarted(at=1.0, version="test", config_path="g", config=Config(), seq=7))
        line = encode_event(Checkpoint.of(state))
        await link._call(link._js.publish, link.names.subject("checkpoints"), line)
        assert await link.newest_checkpoint() == StoredCheckpoint(line, message_seq=7)
        await link.close()


async def test_a_killed_node_is_avoided_by_every_replica(tmp_path):
    async with running_fleet(tmp_path, 3) as (servers, nodes, replicas, http):
        observed = Observed()
        await agreed(http, replicas, observed)
        nodes[0].behaviour.refuse = True
        await agreed(http, replicas, observed)
        served_before = len(nodes[1].requests)
        for _ in range(5):
            for replica in replicas:
                response = await http.post(replica.url + "/v1/chat/completions", json=chat(MODEL), timeout=10)
                assert response.status_code == 200, (replica.name, response.text)
        completions = [request for request in list(nodes[1].requests)[served_before:] if request.path == "/v1/chat/completions"]
        assert len(completions) == 15
        assert observed.disagreements() == {}

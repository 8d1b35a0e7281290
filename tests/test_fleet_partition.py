"""A NATS outage longer than `[fleet] partition_after`, with real processes: a `nats-server`
stopped and started again, three replicas (`interlock serve` subprocesses), two simulated nodes.

Each replica enters a partition (`fleet.partition`): it probes the nodes itself, so a node killed
during the outage is excluded by every replica; its decision records wait in its spool. When
NATS is back each replica leaves its partition and follows the stream again (no event of a
partition is on it), and the spooled records reach the decision stream. `fleet export
--partitions` writes each partition's events beside the stream's; `verify` passes over the
stream's records and, with `--partition`, over each partition's, and `explain` traces a request
routed in a partition to the partition's own events. A spool bounded below what the outage
brings drops the newest records, counted, and sends the others.
"""

from __future__ import annotations

import sys
import time

import httpx
import msgspec
import prometheus_client
import trio
import trio.testing

from controlplane.effects.applier import Applier
from controlplane.effects.held_state import HeldState
from controlplane.effects.metrics import ControlPlaneMetrics
from controlplane.effects.probes import ProbeClient
from controlplane.infrastructure.config import load_config
from events.config import FleetConfig
from events.decisions import read_decisions
from events.log import read_events
from events.types import Checkpoint, HealthProbed, RunStarted, UpstreamFailed
from fleet.partition import PARTITION_SEQ_GAP, Partitions
from fixtures.node import serve_nodes
from harness import MODEL, PROJECT_ROOT, CapturedLog, chat, node_specs, write_config
from nats_cluster import nats_servers
from test_fleet import Observed, Replica, agreed, assert_gapless, events_in, fleet_events, fleet_of, until

PARTITION_AFTER = "2s"


async def health(http: httpx.AsyncClient, replica: Replica) -> httpx.Response:
    return await http.get(replica.url + "/health", timeout=5)


async def node_status(http: httpx.AsyncClient, replica: Replica, ip: str) -> tuple[str, str]:
    """The worker that answered (a new connection each time, so any of a replica's workers may)
    and the status of node `ip` in its `/health`."""
    response = await http.get(replica.url + "/health", headers={"Connection": "close"}, timeout=5)
    [status] = [node["status"] for node in response.json()["details"] if node["ip"] == ip]
    return response.headers["X-Interlock-Worker"], status


async def cli(*arguments: str) -> trio.CompletedProcess:
    return await trio.run_process(
        [sys.executable, "-m", "interlock.cli", *arguments],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        cwd=PROJECT_ROOT,
    )


async def served(http: httpx.AsyncClient, replica: Replica, request_id: str) -> str:
    """Send a request through `replica`; the node that answered it."""
    response = await http.post(
        replica.url + "/v1/chat/completions", json=chat(MODEL), headers={"X-Request-Id": request_id}, timeout=10
    )
    assert response.status_code == 200, (replica.name, response.text)
    return response.headers["X-Interlock-Node"]


async def left_by_its_client(http: httpx.AsyncClient, replica: Replica, request_id: str) -> None:
    """A request whose answer never ends, until this task is cancelled (its client leaves)."""
    await http.post(
        replica.url + "/v1/chat/completions", json=chat(MODEL), headers={"X-Request-Id": request_id}, timeout=None
    )


async def test_a_partition_probes_excludes_a_dead_node_and_is_exported_and_verified(tmp_path):
    async with (
        nats_servers(tmp_path) as [server],
        serve_nodes(node_specs(2)) as nodes,
        fleet_of(
            tmp_path, nodes, [server], gateway=[{}, {}, {"workers": 2}], fleet_keys=f'partition_after = "{PARTITION_AFTER}"\n'
        ) as replicas,
        httpx.AsyncClient() as http,
    ):
        killed, alive = nodes
        observed = Observed()
        await agreed(http, replicas, observed)
        for replica in replicas:
            await served(http, replica, f"before-{replica.name}")

        await server.kill()

        async def all_partitioned() -> bool:
            return all(["X-Interlock-Partition" in (await health(http, replica)).headers for replica in replicas])

        await until(all_partitioned, "every replica in a partition")
        for replica in replicas:
            status, body = await replica.ready(http)
            assert status == 200, body  # a partition serves, and stays in the balancer's rotation
            headers = (await health(http, replica)).headers
            assert headers["X-Interlock-Partition"].startswith(f"{replica.name} from fleet seq ")
            assert "partitioned" in headers["X-Interlock-Degraded"]
            assert await replica.metric(http, "interlock_fleet_partitioned") == 1

        killed.behaviour.refuse = True

        processes = {("r1", "0"), ("r2", "0"), ("r3", "1"), ("r3", "2")}  # r3's API is served by its two workers
        dead_in: set[tuple[str, str]] = set()

        async def excluded_everywhere() -> bool:
            for replica in replicas:
                worker, status = await node_status(http, replica, killed.host)
                if status == "dead":
                    dead_in.add((replica.name, worker))
            return dead_in == processes

        await until(excluded_everywhere, "the node killed during the outage dead in every process of every replica")
        for replica in replicas:
            assert await served(http, replica, f"during-{replica.name}") == alive.name

        async def spooled() -> bool:  # a record is made as its request ends, after the answer
            return all([await replica.metric(http, "interlock_fleet_decision_spool_records") > 0 for replica in replicas])

        await until(spooled, "the records made during the outage in every replica's spool")

        alive.behaviour.completion = "stall_mid_body"  # a request routed in r1's partition, answered in part
        received = len(alive.requests)

        async def reached_the_node() -> bool:
            return len(alive.requests) > received

        async def all_back() -> bool:
            answers = [(await health(http, replica)).headers for replica in replicas]
            return all("X-Interlock-Partition" not in answer and "X-Interlock-Last-Partition" in answer for answer in answers)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(left_by_its_client, http, replicas[0], "across-r1")
            await until(reached_the_node, "the stalled request at the node")
            alive.behaviour.completion = "ok"
            await server.start()
            await until(all_back, "every replica out of its partition, following the stream")
            nursery.cancel_scope.cancel()  # its client leaves now: its record is made after the partition
        await agreed(http, replicas, observed)

        async def spools_sent() -> bool:
            return all([await replica.metric(http, "interlock_fleet_decision_spool_records") == 0 for replica in replicas])

        await until(spools_sent, "every replica's spooled records sent")
        for replica in replicas:
            assert await replica.metric(http, "interlock_fleet_decisions_dropped_total") == 0
            assert await replica.metric(http, "interlock_fleet_partitioned") == 0
        stream = await fleet_events(server.url)
        assert_gapless(stream)  # nothing of the partitions was published as the fleet's
        fleet_seqs = [event.seq for event in events_in(stream)]

        export = tmp_path / "export"
        exported = await cli(
            "fleet", "export", str(export), "--fleet", server.url,
            "--partitions", *(str(replica.config_path.parent / "partitions") for replica in replicas),
        )  # fmt: skip
        assert exported.returncode == 0, exported.stderr.decode()
        assert exported.stderr == b""  # every partition the records name is in the export
        records = {record.request_id: record for record in read_decisions(export / "decisions.jsonl")}
        partitions = {}
        for replica in replicas:
            assert records[f"before-{replica.name}"].partition == ""
            during = records[f"during-{replica.name}"]
            assert during.partition.startswith(f"{replica.name}-from-")
            directory = export / "partitions" / during.partition
            partition = msgspec.json.decode((directory / "partition.json").read_bytes())
            assert partition["replica"] == replica.name
            assert partition["ended_at"] > partition["started_at"]
            assert partition["from_seq"] in fleet_seqs
            events = list(read_events([directory / "events.jsonl"]))
            first, last = partition["first_seq"], partition["last_seq"]
            assert first > max(fleet_seqs)  # seqs the fleet's do not reach: a record's seq says where it was routed
            assert isinstance(events[0], Checkpoint) and events[0].seq == first
            assert [event.seq for event in events[1:]] == list(range(first + 1, last + 1))
            assert any(isinstance(event, HealthProbed) for event in events)  # probed by the replica itself
            assert first <= during.seq <= last
            partitions[replica.name] = during.partition
            assert f"wrote partition {during.partition}" in exported.stdout.decode()
        across = records["across-r1"]  # routed in the partition, recorded after it: its seq says where
        assert (across.partition, across.status) == (partitions["r1"], None)

        without = await cli("fleet", "export", str(tmp_path / "without"), "--fleet", server.url)
        assert without.returncode == 0
        for name in partitions.values():  # records of a partition whose events were not given
            assert f"records were routed in partition {name}, whose events are not in the export" in without.stderr.decode()

        decisions = str(export / "decisions.jsonl")
        verified = await cli("verify", str(export / "events.jsonl"), "--decisions", decisions, "--json")
        assert verified.returncode == 0, verified.stdout.decode()
        report = msgspec.json.decode(verified.stdout)
        assert report["passed"] and report["verified"] >= len(replicas)
        assert report["routed_elsewhere"] == {name: records_in(records, name) for name in partitions.values()}
        for name in partitions.values():
            partition_events = str(export / "partitions" / name / "events.jsonl")
            verified = await cli("verify", partition_events, "--decisions", decisions, "--partition", name, "--json")
            assert verified.returncode == 0, verified.stdout.decode()
            report = msgspec.json.decode(verified.stdout)
            assert report["passed"] and report["verified"] == records_in(records, name)
            assert report["numbering"]["missing"] == 0  # the records of every routing process whole

        name = partitions["r1"]
        partition_events = str(export / "partitions" / name / "events.jsonl")
        result = await cli("explain", partition_events, "--request-id", "during-r1", "--decisions", decisions,
                           "--partition", name, "--json")  # fmt: skip
        assert result.returncode == 0, result.stderr.decode()
        explained = msgspec.json.decode(result.stdout)
        assert [attempt["node"] for attempt in explained["attempts"]] == [alive.host]
        [cause] = explained["causes"]
        assert cause["node"] == killed.host and cause["reason"] in ("dead", "expired")  # its health or its listing
        partition = msgspec.json.decode((export / "partitions" / name / "partition.json").read_bytes())
        assert int(cause["last_change"]["seq"]) > partition["first_seq"]  # excluded by the partition's own probes

        wrong = await cli("explain", str(export / "events.jsonl"), "--request-id", "during-r1", "--decisions", decisions)
        assert wrong.returncode != 0
        assert f"routed in partition {name} of replica r1" in wrong.stderr.decode()


def records_in(records: dict, partition: str) -> int:
    return sum(1 for record in records.values() if record.partition == partition)



async def test_a_full_spool_drops_the_newest_records_and_counts_them(tmp_path):
    """`decision_spool_bytes` bounds the records waiting for the stream while NATS is away: the
    ones beyond it are dropped and counted, every one within it reaches the stream once NATS is
    back, and the records' numbers show exactly the ones dropped."""
    spool = 4096
    async with (
        nats_servers(tmp_path) as [server],
        serve_nodes(node_specs(1)) as nodes,
        fleet_of(
            tmp_path, nodes, [server], count=1, fleet_keys=f'decision_spool_bytes = {spool}\npartition_after = "1h"\n'
        ) as [replica],
        httpx.AsyncClient() as http,
    ):
        await agreed(http, [replica], Observed())
        await server.kill()

        async def cut_off() -> bool:
            return (await health(http, replica)).headers.get("X-Interlock-Degraded") == "not connected to NATS"

        await until(cut_off, "the replica cut off from NATS")
        made = 0

        async def every_record_spooled_or_dropped() -> bool:
            spooled = await replica.metric(http, "interlock_fleet_decision_spool_records")
            return spooled + await replica.metric(http, "interlock_fleet_decisions_dropped_total") == made

        while made < 200 and await replica.metric(http, "interlock_fleet_decisions_dropped_total") < 3:
            await served(http, replica, f"outage-{made}")
            made += 1
            await until(every_record_spooled_or_dropped, "the request's record spooled or dropped")
        dropped = await replica.metric(http, "interlock_fleet_decisions_dropped_total")
        spooled = await replica.metric(http, "interlock_fleet_decision_spool_records")
        assert dropped == 3 and spooled > 0
        assert await replica.metric(http, "interlock_fleet_decision_spool_bytes") <= spool
        assert await replica.metric(http, "interlock_fleet_decision_spool_limit_bytes") == spool

        await server.start()

        async def spool_sent() -> bool:
            return await replica.metric(http, "interlock_fleet_decision_spool_records") == 0

        await until(spool_sent, "the spooled records sent")
        await served(http, replica, "after")  # numbered after the ones dropped: they show as missing
        export = tmp_path / "export"
        with trio.fail_after(60):
            while True:
                exported = await cli("fleet", "export", str(export), "--fleet", server.url)
                assert exported.returncode == 0, exported.stderr.decode()
                ids = [record.request_id for record in read_decisions(export / "decisions.jsonl")]
                if "after" in ids:
                    break
                await trio.sleep(0.2)
        assert ids == [f"outage-{index}" for index in range(int(spooled))] + ["after"]  # every one within the bound
        verified = await cli(
            "verify", str(export / "events.jsonl"), "--decisions", str(export / "decisions.jsonl"), "--json"
        )
        report = msgspec.json.decode(verified.stdout)
        assert report["numbering"]["missing"] == dropped  # the ones dropped, named by their numbers
        assert report["numbering"]["gaps"] == [
            {"process": "r1/0", "first": int(spooled) + 1, "last": int(spooled + dropped)}
        ]
        assert not report["passed"]


async def test_an_observation_handed_over_as_the_partition_ends_stays_out_of_the_fleets_state(tmp_path):
    """The partition's task may have been handed an event of its queue when the fleet's events
    flow again: `end` puts the fleet's state back, and that event must not be numbered on it
    (the replica's state would then differ from the fleet's at the same seq for good)."""
    async with serve_nodes(node_specs(1)) as nodes:
        config = load_config(write_config(tmp_path, nodes, health_interval="1h"))
        view = HeldState(now=time.time, observe=lambda event: None, stale_reason=lambda: "")
        registry = prometheus_client.CollectorRegistry()
        applier = Applier(view, CapturedLog(), ControlPlaneMetrics(registry))
        applier.apply(RunStarted(at=time.time(), seq=1, version="test", config_path="gateway.toml", config=config))
        fleet_state = view.snapshot
        fleet = FleetConfig(replica="r1", lease_renewal=0.05, partition_after=0.05, partition_dir=str(tmp_path))
        partitions = Partitions(
            fleet, view=view, applier=applier, log=CapturedLog(), registry=registry, may_partition=lambda: True
        )
        async with ProbeClient() as client, trio.open_nursery() as nursery:
            nursery.start_soon(partitions.run, client)
            while partitions.current() is None or view.snapshot.seq <= PARTITION_SEQ_GAP + 1:
                await trio.sleep(0.01)  # partitioned, and its first probe numbered
            await trio.testing.wait_all_tasks_blocked()
            assert partitions.observe(UpstreamFailed(at=time.time(), node=nodes[0].host, error="refused"))
            partitions.end()
            await trio.testing.wait_all_tasks_blocked()
            assert view.snapshot.seq == fleet_state.seq
            assert Checkpoint.of(view.snapshot).digest() == Checkpoint.of(fleet_state).digest()
            nursery.cancel_scope.cancel()

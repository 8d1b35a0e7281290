"""The outage drill (issue 33 item 7), run as an operator would: three nats-servers clustered,
three replicas (`interlock serve` subprocesses with `[fleet]`) behind Debian's HAProxy on the
shipped `deploy/haproxy/interlock.cfg`, and three simulated nodes, each a process of its own.

Under steady load through HAProxy (plain and streamed completions, each with its own request
id), every NATS server is stopped for OUTAGE_SECONDS; once every replica is in a partition
(probing the nodes itself) a node is SIGKILLed; then NATS is started again. No request through
HAProxy fails (but a stream the killed node was sending when it died: it is cut mid-body, past
what any gateway can send again; the drill allows at most one per streamed client, and only
from that node); every replica excludes the dead node before NATS is back (by its own probes:
the health rules, not only its failed connections); afterwards the event stream is contiguous,
every replica follows it again on one state, and every answered request's decision record is
in the fleet's export.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio

from events.decisions import read_decisions
from harness import MODEL, PROJECT_ROOT, chat, node_processes
from nats_cluster import nats_servers
from test_fleet import Observed, Replica, agreed, assert_gapless, fleet_events, fleet_of, until
from test_fleet_partition import health, node_status
from test_haproxy import CHAT, address, running_haproxy

OUTAGE_SECONDS = 30.0
"""How long every NATS server stays stopped (the issue's drill)."""
CLIENTS = {"plain": 2, "streamed": 2}
"""Clients sending one completion after another through HAProxy, by kind."""
NODE_FLAGS = ("--ttft", "0.005", "--tpot", "0.002", "--tokens", "4")


@dataclass
class Load:
    """What the drill's clients saw: the request ids answered in full, the failures (any
    answer but a whole 200), the streams cut mid-body (by the node named, `X-Interlock-Node`),
    and the replicas that answered."""

    answered: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    cut_by: dict[str, str] = field(default_factory=dict)
    replicas: set[str] = field(default_factory=set)


@asynccontextmanager
async def steady_load_through(http: httpx.AsyncClient, url: str) -> AsyncIterator[Load]:
    """CLIENTS sending completions through `url` for the block, each with a request id of its
    own (`plain-1-17`); a streamed answer is whole when it ends with `data: [DONE]`."""
    load = Load()

    async def client(kind: str, number: int) -> None:
        sent = 0
        while True:
            sent += 1
            request_id = f"{kind}-{number}-{sent}"
            body = chat(MODEL, stream=kind == "streamed")
            try:
                async with http.stream("POST", url + CHAT, json=body, headers={"X-Request-Id": request_id}) as response:
                    try:
                        await response.aread()
                    except httpx.RemoteProtocolError:
                        if kind == "streamed" and response.status_code == 200:
                            load.cut_by[request_id] = response.headers["X-Interlock-Node"]
                            continue
                        raise
            except httpx.HTTPError as error:
                load.failures.append(f"{request_id}: {error!r}")
                continue
            whole = kind == "plain" or response.text.rstrip().endswith("data: [DONE]")
            if response.status_code == 200 and whole:
                load.answered.append(request_id)
                load.replicas.add(response.headers["X-Interlock-Replica"])
            else:
                load.failures.append(f"{request_id}: {response.status_code} {response.text[-300:]}")
            await trio.sleep(0.05)

    async with trio.open_nursery() as nursery:
        for kind, count in CLIENTS.items():
            for number in range(1, count + 1):
                nursery.start_soon(client, kind, number)
        yield load
        nursery.cancel_scope.cancel()


async def metric_on_all(http: httpx.AsyncClient, replicas: list[Replica], name: str) -> list[float]:
    return [await replica.metric(http, name) for replica in replicas]


async def test_all_of_nats_stopped_under_load_with_a_node_killed_loses_no_request_and_no_record(tmp_path):
    async with (
        nats_servers(tmp_path, 3) as servers,
        node_processes(3, *NODE_FLAGS) as nodes,
        fleet_of(tmp_path, nodes, servers, gateway=[{"retry_unanswered": True}] * 3) as replicas,
        httpx.AsyncClient(timeout=30, trust_env=False) as http,
    ):
        observed = Observed()
        await agreed(http, replicas, observed)
        haproxy_started = running_haproxy(tmp_path, [address(replica.url) for replica in replicas])
        async with haproxy_started as haproxy, steady_load_through(http, haproxy.url) as load:

            async def every_replica_serving() -> bool:
                return load.replicas == {replica.name for replica in replicas}

            await until(every_replica_serving, "HAProxy sending requests to every replica")
            for server in servers:
                await server.kill()
            nats_back_at = trio.current_time() + OUTAGE_SECONDS

            async def all_partitioned() -> bool:
                return all(["X-Interlock-Partition" in (await health(http, replica)).headers for replica in replicas])

            await until(all_partitioned, "every replica in a partition, probing the nodes itself")
            killed = nodes[0]
            killed.kill()
            killed_at = trio.current_time()
            excluded_after: dict[str, float] = {}
            with trio.move_on_at(nats_back_at):
                while len(excluded_after) < len(replicas):
                    for replica in replicas:
                        if replica.name in excluded_after:
                            continue
                        if (await node_status(http, replica, killed.host))[1] == "dead":
                            excluded_after[replica.name] = trio.current_time() - killed_at
                    await trio.sleep(0.1)
            assert len(excluded_after) == len(replicas), f"excluded before NATS is back only by {excluded_after}"
            await trio.sleep_until(nats_back_at)  # the outage lasts its whole length
            answered_in_the_outage = len(load.answered)
            for server in servers:
                await server.start()

            async def all_following_the_stream() -> bool:
                answers = [await replica.health(http) for replica in replicas]
                return all(answer is not None and (answer.partition, answer.degraded) == ("", "") for answer in answers)

            await until(all_following_the_stream, "every replica out of its partition, following the stream")

            async def load_after_the_outage() -> bool:
                return len(load.answered) > answered_in_the_outage + 50

            await until(load_after_the_outage, "requests answered after NATS is back")
        assert load.failures == []
        assert len(load.cut_by) <= CLIENTS["streamed"]
        assert set(load.cut_by.values()) <= {killed.name, killed.host}, load.cut_by
        assert await metric_on_all(http, replicas, "interlock_fleet_partitioned") == [0] * len(replicas)

        async def spools_sent() -> bool:
            return await metric_on_all(http, replicas, "interlock_fleet_decision_spool_records") == [0] * len(replicas)

        await until(spools_sent, "every replica's spooled records sent")
        assert await metric_on_all(http, replicas, "interlock_fleet_decisions_dropped_total") == [0] * len(replicas)
        after = await agreed(http, replicas, observed)
        assert after.degraded == ""
        assert observed.disagreements() == {}
        assert_gapless(await fleet_events(servers[0].url))
        export = tmp_path / "export"
        partitions = [str(replica.config_path.parent / "partitions") for replica in replicas]
        exported = await trio.run_process(
            [sys.executable, "-m", "interlock.cli", "fleet", "export", str(export), "--fleet", servers[1].url,
             "--partitions", *partitions],
            capture_stdout=True, capture_stderr=True, cwd=PROJECT_ROOT,
        )  # fmt: skip
        assert exported.stderr == b""  # every partition the records name is in the export
        recorded = {record.request_id for record in read_decisions(Path(export / "decisions.jsonl"))}
        assert set(load.answered) <= recorded

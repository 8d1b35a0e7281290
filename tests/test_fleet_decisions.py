"""Decision records across a fleet: three `nats-server`s clustered on loopback, three replicas
(r3 with two worker processes), simulated nodes. A request served by a follower, and one served
by a worker of a replica, are explained from the fleet's exported streams alone: the record
names the replica, the worker and the seq it routed on, that seq is an event of the fleet's
stream, and the excluded node's state is traced to the fleet's events."""

from __future__ import annotations

import re
import signal
import sys

import httpx
import msgspec
import prometheus_client
import trio

from events.config import FleetConfig
from events.decisions import read_decisions
from events.log import decode_event
from fixtures.node import serve_nodes
from fleet.bridge import open_asyncio_thread
from fleet.decisions import FleetDecisions
from fleet.jetstream import FleetLink
from harness import MODEL, PROJECT_ROOT, CapturedLog, chat, decision_records, node_specs
from nats_cluster import nats_servers
from test_fleet import WAIT, Observed, Replica, agreed, fleet_of, until
from test_fleet_delivery import unexpected


async def node_statuses(http: httpx.AsyncClient, replica: Replica) -> dict[str, list[str]]:
    """The node statuses `/health` shows, by the worker number of the process that answered (a
    new connection each time, so that any of a replica's workers may answer)."""
    try:
        response = await http.get(replica.url + "/health", headers={"Connection": "close"}, timeout=2)
    except httpx.HTTPError:
        return {}
    return {response.headers["X-Interlock-Worker"]: [node["status"] for node in response.json()["details"]]}


async def explain(*arguments: str) -> trio.CompletedProcess:
    return await trio.run_process(
        [sys.executable, "-m", "interlock.cli", "explain", *arguments], capture_stdout=True, cwd=PROJECT_ROOT
    )


async def test_a_request_served_by_a_follower_or_a_worker_is_explained_from_the_fleets_streams(tmp_path):
    local_logs = [tmp_path / f"decisions-r{index}.jsonl" for index in (1, 2, 3)]
    settings = [{"decision_log": str(path)} for path in local_logs]
    settings[2]["workers"] = 2
    async with (
        nats_servers(tmp_path, 3) as servers,
        serve_nodes(node_specs(2)) as nodes,
        fleet_of(tmp_path, nodes, servers, gateway=settings) as replicas,
        httpx.AsyncClient() as http,
    ):
        r1, r2, r3 = replicas
        nodes[1].behaviour.health = "fail"  # n2 fails its probes: every replica excludes it as dead
        seen = ["healthy", "dead"]
        expected = {r1.name: {"0": seen}, r2.name: {"0": seen}, r3.name: {"1": seen, "2": seen}}
        answered: dict[str, dict[str, list[str]]] = {replica.name: {} for replica in replicas}
        with trio.fail_after(WAIT):  # until every process of every replica has seen n2 dead
            while answered != expected:
                for replica in replicas:
                    answered[replica.name].update(await node_statuses(http, replica))
                await trio.sleep(0.1)
        state = await agreed(http, [r1, r2], Observed())
        follower = r2 if state.leader == "r1" else r1
        served = {}
        for replica, request_id in ((follower, "via-follower"), (r3, "via-worker")):
            response = await http.post(
                replica.url + "/v1/chat/completions", json=chat(MODEL), headers={"X-Request-Id": request_id}, timeout=10
            )
            assert response.status_code == 200, response.text
            assert response.headers["X-Interlock-Replica"] == replica.name  # a worker's answer names its replica
            served[request_id] = replica

        export_dir = tmp_path / "export"
        urls = ",".join(server.url for server in servers)
        with trio.fail_after(WAIT):  # records are sent in batches: export until both are in
            while True:
                export = await trio.run_process(
                    [sys.executable, "-m", "interlock.cli", "fleet", "export", str(export_dir), "--fleet", urls],
                    capture_stdout=True,
                    cwd=PROJECT_ROOT,
                )
                ids = {decision.request_id for decision in read_decisions(export_dir / "decisions.jsonl")}
                if {"via-follower", "via-worker"} <= ids:
                    break
                await trio.sleep(0.2)
        assert "decision records to" in export.stdout.decode()
        events = export_dir / "events.jsonl"
        event_seqs = {decode_event(line).seq for line in events.read_bytes().splitlines()}

        decisions = str(export_dir / "decisions.jsonl")
        for request_id, replica in served.items():
            result = await explain(str(events), "--request-id", request_id, "--decisions", decisions, "--json")
            explained = msgspec.json.decode(result.stdout)
            worker = explained["worker"]
            assert explained["replica"] == replica.name
            assert worker in ((1, 2) if replica is r3 else (0,))  # r3's API is served by its two workers
            assert explained["seq"] in event_seqs  # routed on an event of the fleet's stream
            assert [attempt["node"] for attempt in explained["attempts"]] == [nodes[0].host]
            [cause] = explained["causes"]
            assert (cause["node"], cause["reason"]) == (nodes[1].host, "dead")
            assert int(cause["last_change"]["seq"]) in event_seqs  # traced to the fleet's events
            assert int(cause["last_change"]["seq"]) <= explained["seq"]

            text = (await explain(str(events), "--request-id", request_id, "--decisions", decisions)).stdout.decode()
            routed_by = f"{replica.name}, worker {worker}" if worker else replica.name
            assert re.search(rf"routed by +{re.escape(routed_by)}\n", text), text
            assert f"seq {explained['seq']}" in text
            assert nodes[0].host in text

        # the local decision log of the replica that served each request has the record too
        with trio.fail_after(WAIT):
            for request_id, replica in served.items():
                local = local_logs[replicas.index(replica)]
                while request_id not in {decision.request_id for decision in decision_records(local)}:
                    await trio.sleep(0.1)


async def test_a_batch_sent_again_after_an_unknown_outcome_holds_the_same_records(tmp_path):
    """NATS stops answering (its process SIGSTOPped) with a batch of decision records on the
    wire: the send fails, and is made again while a new record waits behind it. Once NATS
    resumes it stores the first send, and JetStream's duplicate window drops the sends made
    again under that id: they held the first batch's records alone, so the new record goes
    in a batch of its own and reaches the stream."""
    first, second = b'{"request_id":"first"}\n', b'{"request_id":"second"}\n'
    registry = prometheus_client.CollectorRegistry()
    fleet = FleetConfig(nats=(), name="resend", replica="r1", lease=60.0, lease_renewal=1.0)
    async with nats_servers(tmp_path) as [server], open_asyncio_thread(unexpected) as bridge:
        link = FleetLink(bridge, msgspec.structs.replace(fleet, nats=(server.url,)))
        await link.connect()
        decisions = FleetDecisions("r1", CapturedLog(), registry, spool_bytes=1 << 20)

        def sample(name: str) -> float:
            return registry.get_sample_value(name)

        decisions.submit(first)
        server.process.send_signal(signal.SIGSTOP)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(decisions.run, link)
                failed = "interlock_fleet_decision_publish_errors_total"

                async def first_send_failed() -> bool:
                    return sample(failed) >= 1

                await until(first_send_failed, "the first batch's send failed")
                decisions.submit(second)
                failures = sample(failed)

                async def sent_again_since() -> bool:  # the next send starts after the record's submit
                    return sample(failed) > failures

                await until(sent_again_since, "a send failed after the second record was submitted")
                server.process.send_signal(signal.SIGCONT)

                async def all_sent() -> bool:
                    return sample("interlock_fleet_decision_spool_records") == 0

                await until(all_sent, "both records sent")
                nursery.cancel_scope.cancel()
        finally:
            server.process.send_signal(signal.SIGCONT)
        assert b"".join([batch async for batch in link.read_decision_batches()]) == first + second
        await link.close()

"""The fleet under load: HAProxy in front of three replicas, the leader SIGKILLed mid-run, and
all of NATS stopped with a node killed meanwhile.

    python -m bench.fleet [--parts failover,follower-cpu,outage] [--requests 4000] [--clients 16]
                          [--kill-after 1000] [--probe-seconds 10] [--cpu-nodes 1000]
                          [--cpu-seconds 20] [--outage-seconds 30] [--out bench/results]

On loopback, every process its own process group (stopped at the end, also on Ctrl-C or an
error): three `nats-server`s clustered (JetStream on, streams kept three times), three
simulated nodes (`fixtures.node` processes on 127.0.0.2-4), three replicas (`interlock serve`
with `[fleet]`, lease 2 s renewed every 0.5 s, `retry_unanswered = true`, probes every second)
and Debian's `haproxy` on `deploy/haproxy/interlock.cfg` in front of them. Measured:

- probes per node per interval: each node's recorded `GET /health` requests over
  `--probe-seconds`, divided by the intervals (the fleet's target 1; three independent replicas
  make 3);
- failed requests: `--requests` non-streaming completions through HAProxy from `--clients`
  clients, the leader SIGKILLed after `--kill-after` of them; any answer but 200 fails (with
  the seconds after the kill at which each failed: a request in flight on the killed replica
  has no answer, and HAProxy resends only what no replica accepted);
- time to a new leader: from the SIGKILL to the first `/health` of a surviving replica naming
  another leader (polled every 20 ms);
- event fan-out: a follower's `interlock_fleet_apply_delay_seconds` histogram over the load
  (per message, a batch of events: from JetStream's timestamp of the append to the follower's
  apply of its last event; one host, one clock),
  p50/p99 interpolated within its buckets as Prometheus' `histogram_quantile` does;
- a follower's control-plane CPU at `--cpu-nodes` nodes: a second fleet of two replicas (a
  leader, then a follower) over that many simulated nodes (`bench.control_plane_load`'s node
  process), the follower's CPU time from /proc over `--cpu-seconds` (it does not probe; it
  applies the leader's events), the leader's beside it, and the events and messages it applied
  a second (its `interlock_snapshot_seq` and apply-delay count over the run);
- the outage (issue 33's drill): a third fleet of three replicas (`[fleet]` name
  `bench-outage`) over three more simulated nodes behind another HAProxy, `--clients` clients
  (half plain, half streamed completions, each request with an id of its own) through it; every
  NATS server stopped (SIGTERM) for `--outage-seconds`; once every replica is in a partition
  (`X-Interlock-Partition`), a node SIGKILLed; then NATS started again. Measured: failed requests
  (any answer but a whole 200); per replica, the seconds from the kill to its `/health` calling
  the node dead (polled every 50 ms); the decision records spooled (the largest
  `interlock_fleet_decision_spool_records` seen on each replica during the outage, summed) and
  published (the export's records routed in a partition, and every answered request's record in
  the export, `fleet export --partitions`); catch-up: from NATS started to every replica out of
  its partition and not degraded, and to every spool back to what it held under load before
  the outage (under load a spool always holds the records of a send or two).

`--parts` runs some of the fleets alone (`failover`: the first four figures; `follower-cpu`:
the follower's CPU; `outage`: the outage's). Prints a table with PASS/MISS against the targets
of issues 21 and 33 and writes the figures to `bench/results/<UTC timestamp>-fleet.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from bench.control_plane_load import raise_file_limit
from bench.processes import NamedProcess, Processes, cpu_seconds, free_port, group_pids, read_json_line
from bench.report import busy_note, command_line, load_average, utc_now, write_results
from bench.servers import PROJECT_ROOT, SimulatedNodeProcess, gateway_config, start_simulated_nodes
from events.decisions import read_decisions

MODEL = "fleet-model"
HOST = "127.0.0.1"
LEASE_SECONDS = 2.0
FLEET = {"lease": "2s", "lease_renewal": "500ms"}
GATEWAY = {"health_interval": "1s", "retry_unanswered": True}
HAPROXY_CONFIG = PROJECT_ROOT / "deploy" / "haproxy" / "interlock.cfg"
WAIT_SECONDS = 120.0
"""The deadline of every wait for a process to be ready (the machine may be busy)."""

TARGETS = {
    "failed_requests": 0,
    "seconds_to_new_leader": 2 * LEASE_SECONDS,
    "fan_out_p99_ms": 20.0,
    "probes_per_node_per_interval": 1.0,
    "follower_core_percent": 5.0,
    "records_missing": 0,
    "seconds_to_exclude_dead_node": 3 * 1.0 + 1.0,
}
"""seconds_to_exclude_dead_node: the health rules' time, `health_fail_threshold` (3) probes
`health_interval` (1 s) apart, plus one interval for the round under way at the kill."""


@dataclass
class Replica:
    name: str
    port: int
    metrics_port: int
    process: NamedProcess

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


# --- starting things -------------------------------------------------------------------------


@dataclass
class NatsCluster:
    """Clustered JetStream servers, each its own process group; stopped and started again on
    the same ports and stores (`stop`, `start`)."""

    processes: Processes
    argvs: dict[int, list[str]]
    """Each server's command line, by its client port."""
    running: list[NamedProcess]

    @property
    def urls(self) -> list[str]:
        return [f"nats://{HOST}:{port}" for port in self.argvs]

    def start(self) -> None:
        for index, (port, argv) in enumerate(self.argvs.items(), start=1):
            process = self.processes.start(f"nats{index}", argv, cores=None)
            self.running.append(process)
            _wait_for_port(port, process)

    def stop(self) -> None:
        while self.running:
            self.processes.stop(self.running.pop())


def start_nats(processes: Processes, folder: Path, count: int = 3) -> NatsCluster:
    """`count` clustered JetStream servers, running."""
    ports = [(free_port(), free_port()) for _ in range(count)]
    program = shutil.which("nats-server")
    if program is None:
        raise SystemExit("bench.fleet needs nats-server (Debian: apt-get install nats-server)")
    argvs = {}
    for index, (port, cluster_port) in enumerate(ports, start=1):
        routes = ",".join(f"nats://{HOST}:{other}" for _, other in ports if other != cluster_port)
        argvs[port] = [
            program, "-js", "-sd", str(folder / f"nats{index}"), "-a", HOST, "-p", str(port), "-n", f"nats{index}",
            "--cluster_name", "bench", "--cluster", f"nats://{HOST}:{cluster_port}", "--routes", routes,
        ]  # fmt: skip
    cluster = NatsCluster(processes, argvs, [])
    cluster.start()
    return cluster


def _wait_for_port(port: int, process: NamedProcess) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.name} exited with code {process.returncode}")
        try:
            socket.create_connection((HOST, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{process.name} does not listen on {port}")


def fleet_table(urls: list[str], replica: str, name: str, folder: Path) -> str:
    """The [fleet] table of `replica`, its partitions written in `folder` (not the checkout)."""
    servers = ", ".join(json.dumps(url) for url in urls)
    own = {"partition_dir": str(folder / f"{replica}-partitions")}
    settings = "".join(f"{key} = {json.dumps(value)}\n" for key, value in (FLEET | own).items())
    return f"[fleet]\nnats = [{servers}]\nname = {json.dumps(name)}\nreplica = {json.dumps(replica)}\n{settings}"


def start_replica(processes: Processes, folder: Path, name: str, config_text: str, port: int) -> Replica:
    config = folder / f"{name}.toml"
    config.write_text(config_text)
    metrics_port = free_port()
    argv = [
        sys.executable, "-m", "interlock.cli", "serve", "--config", str(config),
        "--listen", f"{HOST}:{port}", "--metrics-listen", f"{HOST}:{metrics_port}",
    ]  # fmt: skip
    return Replica(name, port, metrics_port, processes.start(name, argv, cores=None, cwd=PROJECT_ROOT))


def start_haproxy(processes: Processes, replicas: list[Replica], name: str = "haproxy") -> str:
    """HAProxy on the shipped config in front of `replicas`; its URL."""
    program = shutil.which("haproxy")
    if program is None:
        raise SystemExit("bench.fleet needs haproxy (Debian: apt-get install haproxy)")
    port = free_port()
    os.environ["INTERLOCK_LISTEN"] = f"{HOST}:{port}"
    for index, replica in enumerate(replicas, start=1):
        os.environ[f"INTERLOCK_{index}"] = f"{HOST}:{replica.port}"
    process = processes.start(name, [program, "-db", "-f", str(HAPROXY_CONFIG)], cores=None)
    _wait_for_port(port, process)
    return f"http://{HOST}:{port}"


# --- asking the replicas ---------------------------------------------------------------------


async def fleet_health(http: httpx.AsyncClient, replica: Replica) -> dict | None:
    """The replica's /health body with its fleet headers, or None when it does not answer."""
    try:
        response = await http.get(replica.url + "/health", timeout=2)
    except httpx.HTTPError:
        return None
    return {
        **response.json(),
        "leader": response.headers.get("X-Interlock-Leader", ""),
        "seq": int(response.headers.get("X-Interlock-Seq", "0")),
    }


async def wait_until_settled(replicas: list[Replica], healthy: int) -> str:
    """Wait until every replica routes on `healthy` healthy nodes under one leader; its name."""
    async with httpx.AsyncClient(trust_env=False) as http:
        with trio.fail_after(WAIT_SECONDS):
            while True:
                answers = [await fleet_health(http, replica) for replica in replicas]
                leaders = {answer["leader"] for answer in answers if answer}
                if all(answer and answer["healthy"] == healthy for answer in answers) and len(leaders) == 1 and "" not in leaders:
                    return leaders.pop()
                await trio.sleep(0.2)


async def scrape(replica: Replica) -> dict[str, float]:
    """The replica's metrics as {name{labels}: value} (histogram buckets by their `le`)."""
    async with httpx.AsyncClient(trust_env=False) as http:
        text = (await http.get(f"http://{HOST}:{replica.metrics_port}/metrics", timeout=5)).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{key}={value}" for key, value in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def histogram_quantile(quantile: float, before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    """The quantile of a histogram's observations between two scrapes, interpolated linearly
    within its bucket (Prometheus' `histogram_quantile`); None without observations."""
    prefix = f"{name}_bucket{{le="
    buckets = sorted(
        (float(key[len(prefix) : -1]), value - before.get(key, 0.0)) for key, value in after.items() if key.startswith(prefix)
    )
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank = quantile * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / max(count - lower_count, 1e-9)
        lower_bound, lower_count = bound, count
    return lower_bound


# --- the measurements ------------------------------------------------------------------------


def probes_per_node_per_interval(nodes: list[SimulatedNodeProcess], seconds: float) -> list[float]:
    """Each node's `GET /health` requests over `seconds`, per second (the health interval)."""
    for node in nodes:
        httpx.delete(node.url + "/_control/requests", timeout=5, trust_env=False)
    time.sleep(seconds)
    counts = []
    for node in nodes:
        recorded = httpx.get(node.url + "/_control/requests", timeout=5, trust_env=False).json()
        counts.append(sum(1 for request in recorded if request["path"] == "/health") / seconds)
    return counts


async def load_with_failover(
    url: str, replicas: list[Replica], leader: str, *, total: int, clients: int, kill_after: int
) -> dict:
    """`total` completions through `url` from `clients` clients; the leader SIGKILLed after
    `kill_after` answers; the time until a survivor names a new leader."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}]}
    failures: Counter[str] = Counter()
    sent = answered = 0
    killed = trio.Event()
    new_leader: dict = {}
    failed_after_kill: list[float] = []
    by_name = {replica.name: replica for replica in replicas}

    async def client() -> None:
        nonlocal sent, answered
        async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
            while sent < total:
                sent += 1
                try:
                    response = await http.post(url + "/v1/chat/completions", json=body)
                    failure = "" if response.status_code == 200 else f"status {response.status_code}"
                except httpx.HTTPError as error:
                    failure = type(error).__name__
                if failure:
                    failures[failure] += 1
                    if killed.is_set():
                        failed_after_kill.append(round(time.monotonic() - new_leader["killed_at"], 3))
                answered += 1
                if answered == kill_after:
                    os.killpg(by_name[leader].process.pid, signal.SIGKILL)
                    new_leader["killed_at"] = time.monotonic()
                    killed.set()

    async def watch_leader() -> None:
        await killed.wait()
        survivors = [replica for replica in replicas if replica.name != leader]
        async with httpx.AsyncClient(trust_env=False) as http:
            with trio.fail_after(WAIT_SECONDS):
                while True:
                    for replica in survivors:
                        answer = await fleet_health(http, replica)
                        if answer and answer["leader"] not in ("", leader):
                            new_leader.update(name=answer["leader"], seconds=time.monotonic() - new_leader["killed_at"])
                            return
                    await trio.sleep(0.02)

    started = time.monotonic()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_leader)
        for _ in range(clients):
            nursery.start_soon(client)
    return {
        "requests": answered,
        "failed": sum(failures.values()),
        "failures": dict(failures),
        "failed_seconds_after_kill": failed_after_kill,
        "requests_per_second": answered / (time.monotonic() - started),
        "killed_leader": leader,
        "new_leader": new_leader.get("name"),
        "seconds_to_new_leader": new_leader.get("seconds"),
    }


def failover_run(processes: Processes, folder: Path, nats: NatsCluster, args: argparse.Namespace) -> dict:
    nodes = start_simulated_nodes(processes, 3, MODEL, ttft=0.002, tpot=0.001, tokens=4)
    replicas = []
    for name in ("r1", "r2", "r3"):
        port = free_port()
        text = gateway_config(port, nodes, MODEL, GATEWAY, {}) + fleet_table(nats.urls, name, "bench", folder)
        replicas.append(start_replica(processes, folder, name, text, port))
    leader = trio.run(wait_until_settled, replicas, len(nodes))
    url = start_haproxy(processes, replicas)
    probes = probes_per_node_per_interval(nodes, args.probe_seconds)
    follower = next(replica for replica in replicas if replica.name != leader)
    before = trio.run(scrape, follower)
    run = trio.run(
        lambda: load_with_failover(
            url, replicas, leader, total=args.requests, clients=args.clients, kill_after=args.kill_after
        )
    )
    after = trio.run(scrape, follower)
    delay = "interlock_fleet_apply_delay_seconds"
    observed = after.get(f"{delay}_count{{}}", 0) - before.get(f"{delay}_count{{}}", 0)
    p50, p99 = (histogram_quantile(q, before, after, delay) for q in (0.5, 0.99))
    return {
        **run,
        "probes_per_node_per_interval": probes,
        "fan_out": {
            "follower": follower.name,
            "messages": observed,
            "p50_ms": None if p50 is None else p50 * 1000,
            "p99_ms": None if p99 is None else p99 * 1000,
        },
    }


def follower_cpu_run(processes: Processes, folder: Path, nats: NatsCluster, args: argparse.Namespace) -> dict:
    """A leader and a follower over `--cpu-nodes` simulated nodes (see the module docstring)."""
    nodes_process = processes.start(
        "nodes-many",
        [sys.executable, "-m", "bench.control_plane_load", "--serve-nodes", str(args.cpu_nodes)],
        cores=None,
        cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE,
    )
    described = read_json_line(nodes_process, timeout=WAIT_SECONDS)
    nodes = [
        SimulatedNodeProcess(node["name"], node["host"], node["vllm_port"], node["metrics_port"], nodes_process)
        for node in described
    ]
    settings = {**GATEWAY, "probe_timeout": "5s"}
    replicas = []
    for name in ("leader", "follower"):
        port = free_port()
        text = gateway_config(port, nodes, MODEL, settings, {}) + fleet_table(nats.urls, name, "bench-many", folder)
        replicas.append(start_replica(processes, folder, name, text, port))
        trio.run(wait_until_settled, replicas, len(nodes))  # the first one started leads
    leader, follower = replicas
    before = trio.run(scrape, follower)
    cpu_before = {replica.name: cpu_seconds(group_pids(replica.process.pid)) for replica in replicas}
    start = time.monotonic()
    time.sleep(args.cpu_seconds)
    wall = time.monotonic() - start
    cpu = {replica.name: cpu_seconds(group_pids(replica.process.pid)) - cpu_before[replica.name] for replica in replicas}
    after = trio.run(scrape, follower)
    applied = after.get("interlock_snapshot_seq{}", 0) - before.get("interlock_snapshot_seq{}", 0)
    messages = "interlock_fleet_apply_delay_seconds_count{}"
    applied_messages = after.get(messages, 0) - before.get(messages, 0)
    for replica in replicas:
        processes.stop(replica.process)
    processes.stop(nodes_process)
    return {
        "nodes": len(nodes),
        "seconds": wall,
        "follower_core_percent": cpu["follower"] / wall * 100,
        "leader_core_percent": cpu["leader"] / wall * 100,
        "follower_events_per_second": applied / wall,
        "follower_messages_per_second": applied_messages / wall,
    }


async def drive_outage(
    url: str, replicas: list[Replica], nats: NatsCluster, killed: SimulatedNodeProcess, args: argparse.Namespace
) -> dict:
    """Load through `url` while NATS is stopped for `--outage-seconds` and `killed` is SIGKILLed
    once every replica is in a partition (the outage part of the module docstring)."""
    failures: Counter[str] = Counter()
    answered: list[str] = []
    stop_load = trio.Event()
    outage: dict = {"excluded_after": {}, "spooled": {replica.name: 0.0 for replica in replicas}}

    async def client(index: int) -> None:
        streamed = index % 2 == 1
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "stream": streamed}
        sent = 0
        async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
            while not stop_load.is_set():
                sent += 1
                request_id = f"outage-{index}-{sent}"
                try:
                    response = await http.post(
                        url + "/v1/chat/completions", json=body, headers={"X-Request-Id": request_id}
                    )
                    whole = not streamed or response.text.rstrip().endswith("data: [DONE]")
                    failure = "" if response.status_code == 200 and whole else f"status {response.status_code}"
                except httpx.HTTPError as error:
                    failure = type(error).__name__
                if failure:
                    failures[failure] += 1
                else:
                    answered.append(request_id)

    async def every(condition, what: str) -> None:
        with trio.move_on_after(WAIT_SECONDS):
            while not await condition():
                await trio.sleep(0.05)
            return
        raise RuntimeError(f"not within {WAIT_SECONDS:g} s: {what}")

    async with httpx.AsyncClient(trust_env=False) as http:

        async def headers(replica: Replica) -> httpx.Headers:
            return (await http.get(replica.url + "/health", timeout=5)).headers

        async def all_partitioned() -> bool:
            return all(["X-Interlock-Partition" in await headers(replica) for replica in replicas])

        async def all_following() -> bool:
            answers = [await headers(replica) for replica in replicas]
            return not any("X-Interlock-Partition" in answer or "X-Interlock-Degraded" in answer for answer in answers)

        async def spool(replica: Replica) -> float:
            return (await scrape(replica)).get("interlock_fleet_decision_spool_records{}", 0)

        async def spools_sent() -> bool:  # under load a spool always holds the records of a send or two
            return all([await spool(replica) <= steady[replica.name] for replica in replicas])

        async def watch_outage(back: trio.Event) -> None:
            while not back.is_set():
                for replica in replicas:
                    outage["spooled"][replica.name] = max(outage["spooled"][replica.name], await spool(replica))
                    excluded = outage["excluded_after"]
                    if "killed_at" in outage and replica.name not in excluded:
                        body = (await http.get(replica.url + "/health", timeout=5)).json()
                        if any(node["ip"] == killed.host and node["status"] == "dead" for node in body["details"]):
                            excluded[replica.name] = time.monotonic() - outage["killed_at"]
                await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            for index in range(args.clients):
                nursery.start_soon(client, index)
            steady = {replica.name: 0.0 for replica in replicas}
            with trio.move_on_after(5):  # the load under way before the outage
                while True:
                    for replica in replicas:
                        steady[replica.name] = max(steady[replica.name], await spool(replica))
                    await trio.sleep(0.05)
            back = trio.Event()
            nursery.start_soon(watch_outage, back)
            await trio.to_thread.run_sync(nats.stop)
            stopped_at = time.monotonic()
            await every(all_partitioned, "every replica in a partition")
            outage["seconds_to_partition"] = time.monotonic() - stopped_at
            os.killpg(killed.process.pid, signal.SIGKILL)
            outage["killed_at"] = time.monotonic()
            await trio.sleep(max(0.0, stopped_at + args.outage_seconds - time.monotonic()))
            answered_during = len(answered)
            await trio.to_thread.run_sync(nats.start)
            started_at = time.monotonic()
            back.set()
            await every(all_following, "every replica following the stream again")
            outage["catch_up_seconds"] = time.monotonic() - started_at
            await every(spools_sent, "every spool back to what it holds under load")
            outage["spools_sent_seconds"] = time.monotonic() - started_at
            await trio.sleep(5)  # the load after the outage
            stop_load.set()
    del outage["killed_at"]
    return {
        **outage,
        "requests": len(answered) + sum(failures.values()),
        "answered_during_outage": answered_during,
        "failed": sum(failures.values()),
        "failures": dict(failures),
        "answered_ids": answered,
    }


def outage_run(processes: Processes, folder: Path, nats: NatsCluster, args: argparse.Namespace) -> dict:
    """A fleet through an outage of all of NATS with a node killed meanwhile (module docstring)."""
    nodes = start_simulated_nodes(processes, 3, MODEL, ttft=0.002, tpot=0.001, tokens=4)
    replicas = []
    for name in ("outage-r1", "outage-r2", "outage-r3"):
        port = free_port()
        text = gateway_config(port, nodes, MODEL, GATEWAY, {}) + fleet_table(nats.urls, name, "bench-outage", folder)
        replicas.append(start_replica(processes, folder, name, text, port))
    trio.run(wait_until_settled, replicas, len(nodes))
    url = start_haproxy(processes, replicas, "haproxy-outage")
    run = trio.run(drive_outage, url, replicas, nats, nodes[0], args)
    export = folder / "outage-export"
    command = [sys.executable, "-m", "interlock.cli", "fleet", "export", str(export), "--fleet", nats.urls[0]]
    command += ["--name", "bench-outage", "--partitions"]
    command += [str(folder / f"{replica.name}-partitions") for replica in replicas]
    exported = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True)
    if exported.returncode != 0 or exported.stderr:
        raise RuntimeError(f"fleet export: {exported.stderr}")
    records = list(read_decisions(export / "decisions.jsonl"))
    recorded = {record.request_id for record in records}
    answered = run.pop("answered_ids")
    return {
        **run,
        "records_exported": len(records),
        "records_routed_in_partitions": sum(1 for record in records if record.partition),
        "records_missing": sum(1 for request_id in answered if request_id not in recorded),
        "spooled_records": sum(run["spooled"].values()),
    }


PARTS = {"failover": failover_run, "follower-cpu": follower_cpu_run, "outage": outage_run}


# --- the report ------------------------------------------------------------------------------


def evaluate(results: dict) -> list[dict]:
    """The figures of the parts run, each against its target (if it has one)."""
    rows = []
    if failover := results.get("failover"):
        probes = max(failover["probes_per_node_per_interval"])
        rows += [
            ("failed requests", failover["failed"], TARGETS["failed_requests"], f"{failover['failed']} of {failover['requests']}"),
            ("time to a new leader (s)", failover["seconds_to_new_leader"], TARGETS["seconds_to_new_leader"], None),
            ("event fan-out p50 (ms)", failover["fan_out"]["p50_ms"], None, None),
            ("event fan-out p99 (ms)", failover["fan_out"]["p99_ms"], TARGETS["fan_out_p99_ms"], None),
            ("probes per node per interval", probes, TARGETS["probes_per_node_per_interval"] * 1.1, None),
        ]
    if many := results.get("follower_cpu"):
        rows += [
            (f"follower CPU at {many['nodes']} nodes (% core)", many["follower_core_percent"], TARGETS["follower_core_percent"], None),
            (f"leader CPU at {many['nodes']} nodes (% core)", many["leader_core_percent"], None, None),
            (f"events applied a second at {many['nodes']} nodes", many["follower_events_per_second"], None, None),
            (f"messages applied a second at {many['nodes']} nodes", many["follower_messages_per_second"], None, None),
        ]
    if outage := results.get("outage"):
        excluded, requests = outage["excluded_after"], outage["requests"]
        slowest = max(excluded.values()) if len(excluded) == 3 else None
        rows += [
            ("outage: failed requests", outage["failed"], TARGETS["failed_requests"], f"{outage['failed']} of {requests}"),
            ("outage: dead node excluded, slowest (s)", slowest, TARGETS["seconds_to_exclude_dead_node"], None),
            ("outage: records spooled (peak, summed)", outage["spooled_records"], None, None),
            ("outage: records routed in partitions", outage["records_routed_in_partitions"], None, None),
            ("outage: answered without a record", outage["records_missing"], TARGETS["records_missing"], None),
            ("outage: catch-up after NATS (s)", outage["catch_up_seconds"], None, None),
            ("outage: spools sent after NATS (s)", outage["spools_sent_seconds"], None, None),
        ]
    evaluated = []
    for name, value, target, shown in rows:
        verdict = "" if target is None else ("MISS" if value is None or value > target else "PASS")
        shown = shown or ("-" if value is None else f"{value:.2f}")
        evaluated.append({"figure": name, "value": value, "shown": shown, "target": target, "verdict": verdict})
    return evaluated


def render(evaluated: list[dict]) -> str:
    lines = [f"{'figure':40}{'value':>16}{'target':>10}  verdict"]
    for row in evaluated:
        target = "" if row["target"] is None else f"<= {row['target']:g}"
        lines.append(f"{row['figure']:40}{row['shown']:>16}{target:>10}  {row['verdict']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--parts", default=",".join(PARTS), help=f"the parts to run, comma-separated (default: {','.join(PARTS)})")
    add("--requests", type=int, default=4000, help="completions through HAProxy (default: 4000)")
    add("--clients", type=int, default=16, help="clients sending at once (default: 16)")
    add("--kill-after", type=int, default=1000, help="answers before the leader is SIGKILLed (default: 1000)")
    add("--probe-seconds", type=float, default=10.0, help="seconds the nodes' probes are counted (default: 10)")
    add("--cpu-nodes", type=int, default=1000, help="nodes of the follower-CPU run (default: 1000)")
    add("--cpu-seconds", type=float, default=20.0, help="seconds the follower's CPU is measured (default: 20)")
    add("--outage-seconds", type=float, default=30.0, help="seconds every NATS server stays stopped (default: 30)")
    add("--out", type=Path, default=PROJECT_ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    if not 0 < args.kill_after < args.requests:
        parser.error("needs 0 < --kill-after < --requests")
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    if not parts or set(parts) - set(PARTS):
        parser.error(f"--parts takes one or more of {', '.join(PARTS)}, comma-separated")
    raise_file_limit()  # inherited: a thousand nodes need thousands of sockets in each replica
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as temporary, Processes(Path(temporary)) as processes:
        folder = Path(temporary)
        try:
            nats = start_nats(processes, folder)
            figures = {}
            for part in parts:
                figures[part.replace("-", "_")] = PARTS[part](processes, folder, nats, args)
        except Exception:
            for name in ("r1", "r2", "r3", "leader", "follower", "haproxy", "outage-r1", "outage-r2", "outage-r3"):
                tail = processes.log_tail(name, 5)
                if tail:
                    print(f"--- {name}\n{tail}", file=sys.stderr)
            raise
    results = {
        "when": utc_now(),
        "command": command_line().replace("python -m bench", "python -m bench.fleet", 1),
        "args": {key: str(value) for key, value in vars(args).items()},
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "busy": busy_note(load_before),
        **figures,
    }
    results["targets"] = evaluate(results)
    print(render(results["targets"]))
    if results["busy"]:
        print(results["busy"])
    print(f"wrote {write_results(results, args.out, kind='fleet')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

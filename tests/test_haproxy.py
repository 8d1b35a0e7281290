"""`deploy/haproxy/interlock.cfg`: the shipped file, as an operator runs it (the addresses in
environment variables), with Debian's real `haproxy` on loopback in front of two real gateways
and their simulated nodes. HAProxy keeps a replica in rotation only while its `/ready` says 200,
and a replica killed with requests in flight costs no client its answer.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio

from fixtures.node import NodeSpec, SimulatedNode, serve_nodes

from harness import (
    MODEL,
    PROJECT_ROOT,
    chat,
    completions_to,
    free_port,
    required_program,
    running_gateway,
    sse_events,
    wait_until_ready,
    write_config,
)

CONFIG = PROJECT_ROOT / "deploy" / "haproxy" / "interlock.cfg"
CHAT = "/v1/chat/completions"
GATEWAY = {"health_interval": "50ms", "health_fail_threshold": 1}


def haproxy_program() -> str:
    return required_program("haproxy", "apt-get install haproxy")


class HAProxy:
    """A running `haproxy -f interlock.cfg`; its log (standard output and error) in a file."""

    def __init__(self, url: str, log: Path, process: trio.Process) -> None:
        self.url = url
        self.log = log
        self.process = process

    async def logged(self, text: str, timeout: float = 30.0) -> None:
        """Wait until the log holds `text` (HAProxy logs each server going DOWN and UP)."""
        with trio.fail_after(timeout):
            while text not in (written := self.log.read_text()):
                assert self.process.returncode is None, f"haproxy exited: {written}"
                await trio.sleep(0.05)


@asynccontextmanager
async def running_haproxy(tmp_path: Path, replicas: list[str], silence: str = "") -> AsyncIterator[HAProxy]:
    """HAProxy on the shipped config, listening on a socket this test binds (a free port, handed
    over as `fd@N`), with `replicas` as INTERLOCK_1, 2, … and `silence` as INTERLOCK_SILENCE
    (unless ""); killed at the end, whatever happens."""
    program = haproxy_program()
    listener = socket.create_server(("127.0.0.1", 0))
    log = tmp_path / "haproxy.log"
    env = {**os.environ, "INTERLOCK_LISTEN": f"fd@{listener.fileno()}"}
    env.update({f"INTERLOCK_{index}": address for index, address in enumerate(replicas, start=1)})
    if silence:
        env["INTERLOCK_SILENCE"] = silence
    with listener, log.open("wb") as output:
        process = await trio.lowlevel.open_process(
            [program, "-db", "-f", str(CONFIG)],
            env=env,
            pass_fds=(listener.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
        try:
            yield HAProxy(f"http://127.0.0.1:{listener.getsockname()[1]}", log, process)
        finally:
            with trio.CancelScope(shield=True):
                process.kill()
                await process.wait()


def refusing_address() -> socket.socket:
    """A loopback port bound and not listening: connections to it are refused for as long as the
    socket stays open (a replica that is down)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def address(url: str) -> str:
    return url.removeprefix("http://")


async def served_by(http: httpx.AsyncClient, url: str, count: int) -> list[str]:
    """Send `count` completions; each must succeed: the nodes that answered, in order."""
    nodes = []
    for _ in range(count):
        response = await http.post(url + CHAT, json=chat())
        assert response.status_code == 200, response.text
        nodes.append(response.headers["x-interlock-node"])
    return nodes


def test_the_shipped_config_is_valid_as_shipped_and_with_addresses():
    without_variables = {name: value for name, value in os.environ.items() if not name.startswith("INTERLOCK_")}
    addresses = {"INTERLOCK_1": "10.0.1.11:8000", "INTERLOCK_2": "10.0.1.12:8000", "INTERLOCK_3": "[::1]:8000"}
    for env in (without_variables, {**without_variables, **addresses, "INTERLOCK_SILENCE": "5m"}):
        result = subprocess.run(
            [haproxy_program(), "-c", "-f", str(CONFIG)], env=env, capture_output=True, text=True, timeout=30
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "Configuration file is valid" in result.stdout


async def test_haproxys_own_503_is_the_gateways_json_error(tmp_path):
    """No replica up: HAProxy answers itself, in the shape the OpenAI SDKs read (and retry)."""
    with refusing_address() as one, refusing_address() as two, refusing_address() as three:
        replicas = ["127.0.0.1:%d" % sock.getsockname()[1] for sock in (one, two, three)]
        async with running_haproxy(tmp_path, replicas) as haproxy, httpx.AsyncClient(timeout=60, trust_env=False) as http:
            response = await http.post(haproxy.url + CHAT, json=chat())
    assert response.status_code == 503
    assert response.headers["content-type"] == "application/json"
    assert response.headers["retry-after"] == "1"
    assert response.json() == {
        "error": {"message": "no replica of the gateway is ready to serve", "type": "server_error", "code": "no_ready_replica"}
    }


async def test_haproxy_sends_requests_only_to_ready_replicas(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    specs = [NodeSpec(name="a1", host="127.0.0.2", models=[MODEL]), NodeSpec(name="b1", host="127.0.0.3", models=[MODEL])]
    async with (
        serve_nodes(specs) as (node_a, node_b),
        running_gateway(tmp_path / "a", [node_a], **GATEWAY) as gateway_a,
        running_gateway(tmp_path / "b", [node_b], **GATEWAY) as gateway_b,
    ):
        with refusing_address() as down:
            replicas = [address(gateway_a.url), address(gateway_b.url), "127.0.0.1:%d" % down.getsockname()[1]]
            async with running_haproxy(tmp_path, replicas) as haproxy, httpx.AsyncClient(timeout=60, trust_env=False) as http:
                # A replica that is down gets nothing, even before its checks have failed: a
                # refused connection is retried on another replica.
                assert set(await served_by(http, haproxy.url, 10)) == {"a1", "b1"}
                await haproxy.logged("interlock_replicas/replica3 is DOWN")

                async with http.stream("POST", haproxy.url + CHAT, json=chat(stream=True, max_tokens=5)) as stream:
                    assert stream.status_code == 200
                    assert stream.headers["content-type"].startswith("text/event-stream")
                    events = sse_events((await stream.aread()).decode())
                assert len(events) == 5 + 1 and events[-1] == "[DONE]"  # a chunk per token, then [DONE]

                # Every node of replica 1 dies: its /health stays 200, its /ready goes 503,
                # and HAProxy takes it out of rotation.
                node_a.behaviour.health = "fail"
                await gateway_a.wait_for(lambda: gateway_a.node(node_a.host).status == "dead")
                assert (await http.get(gateway_a.url + "/health")).status_code == 200
                assert (await http.get(gateway_a.url + "/ready")).status_code == 503
                await haproxy.logged("interlock_replicas/replica1 is DOWN")
                assert set(await served_by(http, haproxy.url, 10)) == {"b1"}

                node_a.behaviour.health = "ok"
                await haproxy.logged("interlock_replicas/replica1 is UP")
                assert "a1" in await served_by(http, haproxy.url, 10)


async def test_a_replica_killed_with_requests_in_flight_costs_no_request(tmp_path):
    """Replica 1's node never answers, so the completions sent through replica 1 are in flight
    there when it is SIGKILLed: HAProxy gets an empty response for each (`retry-on
    empty-response`), resends it from its buffer (`http-buffer-request`) to replica 2, and
    every client gets its 200."""
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        async with two_replica_processes(tmp_path, http) as (node_a, replica_a, haproxy):
            node_a.behaviour.completion = "hang"
            failures: list[str] = []
            answered_by: list[str] = []

            async def client() -> None:
                for _ in range(10):
                    response = await http.post(haproxy.url + CHAT, json=chat())
                    if response.status_code == 200:
                        answered_by.append(response.headers["x-interlock-node"])
                    else:
                        failures.append(f"{response.status_code} {response.text}")

            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(client)
                with trio.fail_after(30):
                    while len(completions_to(node_a)) < 2:
                        await trio.sleep(0.01)
                replica_a.process.kill()
            assert failures == []
            assert answered_by == ["b1"] * 80


async def test_a_frozen_replica_holds_a_request_only_until_its_silence_runs_out(tmp_path):
    """Replica 1 is SIGSTOPped: the requests HAProxy sends it get no byte back, and once
    INTERLOCK_SILENCE has passed each is sent to replica 2 (`retry-on response-timeout`):
    every client gets its 200 while replica 1 is still frozen."""
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        async with two_replica_processes(tmp_path, http, silence="2s") as (node_a, replica_a, haproxy):
            assert set(await served_by(http, haproxy.url, 6)) == {"a1", "b1"}  # both in rotation
            replica_a.process.send_signal(signal.SIGSTOP)
            try:
                answered_by: list[str] = []

                async def client() -> None:
                    answered_by.extend(await served_by(http, haproxy.url, 3))

                async with trio.open_nursery() as nursery:
                    for _ in range(4):
                        nursery.start_soon(client)
                assert answered_by == ["b1"] * 12
                # at least one of them waited out replica 1's silence (2 s) and was sent again
                log = haproxy.log.read_text()
                assert any(waited_and_retried(line, 2000) for line in log.splitlines()), log
            finally:
                replica_a.process.send_signal(signal.SIGCONT)


@asynccontextmanager
async def two_replica_processes(
    tmp_path: Path, http: httpx.AsyncClient, silence: str = ""
) -> AsyncIterator[tuple[SimulatedNode, ServeSubprocess, HAProxy]]:
    """Replica 1 (`interlock serve` on node a1) and replica 2 (on b1), each in a process of its
    own and ready, and HAProxy on the shipped file in front of them and a third that is down;
    yields node a1, replica 1 and HAProxy."""
    specs = [NodeSpec(name="a1", host="127.0.0.2", models=[MODEL]), NodeSpec(name="b1", host="127.0.0.3", models=[MODEL])]
    async with (
        serve_nodes(specs) as (node_a, node_b),
        serve_subprocess(tmp_path / "a", node_a) as replica_a,
        serve_subprocess(tmp_path / "b", node_b) as replica_b,
    ):
        await wait_until_ready(http, replica_a.url)
        await wait_until_ready(http, replica_b.url)
        with refusing_address() as down:  # the shipped file names three replicas: one is down
            replicas = [address(replica_a.url), address(replica_b.url), "127.0.0.1:%d" % down.getsockname()[1]]
            async with running_haproxy(tmp_path, replicas, silence=silence) as haproxy:
                yield node_a, replica_a, haproxy


def waited_and_retried(line: str, milliseconds: int) -> bool:
    """Whether an httplog line is of a request answered by replica 2 after a retry (`+1`, the
    retries field's last) that took at least `milliseconds` in all (the timers' last, Ta)."""
    fields = line.split()  # … server timers status bytes cookies cookies flags connections …
    if "interlock_replicas/replica2" not in fields:
        return False
    server = fields.index("interlock_replicas/replica2")
    timers, connections = fields[server + 1], fields[server + 7]
    return connections.endswith("/+1") and int(timers.split("/")[-1]) >= milliseconds


@dataclass
class ServeSubprocess:
    url: str
    process: trio.Process


@asynccontextmanager
async def serve_subprocess(directory: Path, node) -> AsyncIterator[ServeSubprocess]:
    """`interlock serve` on `node` in a process of its own (to be SIGKILLed), on a free port;
    killed at the end."""
    directory.mkdir()
    config = write_config(directory, [node], **GATEWAY)
    port = free_port()
    with (directory / "log.jsonl").open("wb") as log:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "interlock.cli", "serve", "--config", str(config), "--listen", f"127.0.0.1:{port}"],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=PROJECT_ROOT,
        )
        try:
            yield ServeSubprocess(f"http://127.0.0.1:{port}", process)
        finally:
            with trio.CancelScope(shield=True):
                process.kill()
                await process.wait()

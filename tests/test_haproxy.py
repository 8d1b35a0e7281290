"""`deploy/haproxy/interlock.cfg`: the shipped file, as an operator runs it (the addresses in
environment variables), with Debian's real `haproxy` on loopback in front of two real gateways
and their simulated nodes. HAProxy keeps a replica in rotation only while its `/ready` says 200,
and a replica killed with requests in flight costs no client its answer.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio

from fixtures.node import NodeSpec, serve_nodes

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
async def running_haproxy(tmp_path: Path, replicas: list[str]) -> AsyncIterator[HAProxy]:
    """HAProxy on the shipped config, listening on a socket this test binds (a free port, handed
    over as `fd@N`), with `replicas` as INTERLOCK_1, 2, …; killed at the end, whatever happens."""
    program = haproxy_program()
    listener = socket.create_server(("127.0.0.1", 0))
    log = tmp_path / "haproxy.log"
    env = {**os.environ, "INTERLOCK_LISTEN": f"fd@{listener.fileno()}"}
    env.update({f"INTERLOCK_{index}": address for index, address in enumerate(replicas, start=1)})
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


def test_the_shipped_config_is_valid():
    result = subprocess.run(
        [haproxy_program(), "-c", "-f", str(CONFIG)],
        env={**os.environ, "INTERLOCK_1": "10.0.1.11:8000", "INTERLOCK_2": "10.0.1.12:8000", "INTERLOCK_3": "[::1]:8000"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Configuration file is valid" in result.stdout


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
    specs = [NodeSpec(name="a1", host="127.0.0.2", models=[MODEL]), NodeSpec(name="b1", host="127.0.0.3", models=[MODEL])]
    async with serve_nodes(specs) as (node_a, node_b), httpx.AsyncClient(timeout=60, trust_env=False) as http:
        async with (
            serve_subprocess(tmp_path / "a", node_a) as replica_a,
            serve_subprocess(tmp_path / "b", node_b) as replica_b,
        ):
            await wait_until_ready(http, replica_a.url)
            await wait_until_ready(http, replica_b.url)
            node_a.behaviour.completion = "hang"
            with refusing_address() as down:  # the shipped file names three replicas: one is down
                replicas = [address(replica_a.url), address(replica_b.url), "127.0.0.1:%d" % down.getsockname()[1]]
                async with running_haproxy(tmp_path, replicas) as haproxy:
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

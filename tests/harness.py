"""What the integration tests share (no tests here; the pytest fixtures are in conftest.py).

Simulated nodes on their own loopback addresses (127.0.0.2, 127.0.0.3, …, since a node's identity
is its IP), gateway config files for them, a JSON log captured in memory, and a real gateway
(`interlock.serve.serve`, real hypercorn on free ports of 127.0.0.1) in front of the nodes.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio

from controlplane.infrastructure.logs import JsonLog
from controlplane.effects.control_plane import ControlPlane
from events.decisions import Decision, read_decisions
from events.state import Discovery, NodeState
from fixtures.node import Behaviour, NodeSpec, SimulatedNode, serve_nodes
from interlock.serve import Listening, serve
from journal.segments import list_segments

MODEL = "test-model"
PROJECT_ROOT = Path(__file__).resolve().parent.parent


def required_program(name: str, install: str) -> str:
    """The path of a program a test drives (a browser, systemd's tools, podman). Without it the
    test skips, except in CI (`.ci/run` sets CI and installs the program), where it fails."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed (.ci/run installs it: {install})")
        pytest.skip(f"{name} is not installed ({install})")
    return path


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port of 127.0.0.1 free at the moment (for a listen address a subprocess must be given),
    never one handed out before in this process: a port probed and released can come back at
    the next probe, and a gateway given one port for both its listeners does not start."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def node_specs(count: int, *, serving: Sequence[str] = (MODEL,), **behaviour) -> list[NodeSpec]:
    """`count` nodes n1, n2, … on 127.0.0.2, 127.0.0.3, … serving the models `serving`, with
    the given behaviour (see fixtures.node.Behaviour)."""
    return [
        NodeSpec(name=f"n{i}", host=f"127.0.0.{i + 1}", models=list(serving), behaviour=Behaviour(**behaviour))
        for i in range(1, count + 1)
    ]


@dataclass
class NodeProcess:
    """A simulated node in a process of its own (`python -m fixtures.node`), so that a test can
    kill it for real. It has what `config_text` reads of a node."""

    name: str
    host: str
    vllm_port: int
    metrics_port: int
    process: trio.Process

    def kill(self) -> None:
        """SIGKILL: the node dies with its connections, as a crashed or OOM-killed vLLM does."""
        self.process.kill()


@asynccontextmanager
async def node_processes(count: int, *flags: str) -> AsyncIterator[list[NodeProcess]]:
    """`count` simulated nodes serving MODEL on 127.0.0.2, 127.0.0.3, …, one process each, with
    more `fixtures.node` flags (`"--tpot", "0.05"`); those still running at the end are killed."""
    nodes: list[NodeProcess] = []
    processes: list[trio.Process] = []
    try:
        for index in range(1, count + 1):
            host = f"127.0.0.{index + 1}"
            command = [sys.executable, "-m", "fixtures.node", "--host", host, "--base-port", "0", "--models", MODEL]
            process = await trio.lowlevel.open_process(
                [*command, "--name-prefix", f"n{index}-", *flags], cwd=PROJECT_ROOT, stdout=subprocess.PIPE
            )
            processes.append(process)
            output = b""
            with trio.fail_after(60):
                while b"\n" not in output:
                    data = await process.stdout.receive_some()
                    if not data:
                        raise RuntimeError(f"fixtures.node exited early: {output!r}")
                    output += data
            # "<name>  vllm http://<host>:<port>  metrics http://<host>:<port>  models <models>"
            name, _, vllm_url, _, metrics_url = output.decode().split()[:5]
            ports = [int(url.rpartition(":")[2]) for url in (vllm_url, metrics_url)]
            nodes.append(NodeProcess(name, host, *ports, process))
        yield nodes
    finally:
        with trio.CancelScope(shield=True):
            for process in processes:
                if process.returncode is None:
                    process.kill()
                await process.wait()
                await process.stdout.aclose()


# --- config files ------------------------------------------------------------------------------


def config_text(
    nodes: Sequence[SimulatedNode],
    *,
    rings: dict[str, str] | None = None,
    models: Sequence[tuple[str, str]] = ((MODEL, ""),),
    default: str = "",
    health_interval: str = "30s",
    node_settings: dict[str, dict[str, object]] | None = None,
    routing: dict[str, object] | None = None,
    aliases: dict[str, str] | None = None,
    adapters: dict[str, dict[str, str]] | None = None,
    extra: str = "",
    **gateway: object,
) -> str:
    """A gateway TOML with one [[nodes]] per simulated node (ip = its host, its name and both
    ports; rings by node name), listening on free ports of 127.0.0.1. `models` are (name, ring)
    or (name, ring, policy) for [[models.available]], `aliases` more entries (name: target),
    `adapters` more (name: its keys, `parent` and `lora_path`); `node_settings` adds keys to nodes
    by name; `routing` is the [routing] table; `extra` is TOML appended at the end
    (`[[tenants]]`, …); `gateway` adds [gateway] keys (durations as strings: "1s")."""
    rings = rings or {}
    lines = ["[gateway]", 'listen = "127.0.0.1:0"', 'metrics_listen = "127.0.0.1:0"']
    lines.append(f"health_interval = {_toml(health_interval)}")
    lines += [f"{key} = {_toml(value)}" for key, value in gateway.items()]
    for node in nodes:
        lines += [
            "[[nodes]]",
            f"ip = {_toml(node.host)}",
            f"name = {_toml(node.name)}",
            f"vllm_port = {node.vllm_port}",
            f"metrics_port = {node.metrics_port or 0}",
            f"ring = {_toml(rings.get(node.name, ''))}",
        ]
        lines += [f"{key} = {_toml(value)}" for key, value in (node_settings or {}).get(node.name, {}).items()]
    if routing is not None:
        lines += ["[routing]"] + [f"{key} = {_toml(value)}" for key, value in routing.items()]
    lines += ["[models]", f"default = {_toml(default)}"]
    for name, ring, *policy in models:
        lines += ["[[models.available]]", f"name = {_toml(name)}", f"ring = {_toml(ring)}"]
        lines += [f"policy = {_toml(value)}" for value in policy]
    for name, target in (aliases or {}).items():
        lines += ["[[models.available]]", f"name = {_toml(name)}", f"target = {_toml(target)}"]
    for name, keys in (adapters or {}).items():
        lines += ["[[models.available]]", f"name = {_toml(name)}"] + [f"{k} = {_toml(v)}" for k, v in keys.items()]
    return "\n".join(lines) + "\n" + extra


def _toml(value: object) -> str:
    """A TOML value for a string, number or bool (JSON spells them the same way)."""
    return msgspec.json.encode(value).decode()


def write_config(directory: Path, nodes: Sequence[SimulatedNode], **keywords: object) -> Path:
    """Write (or rewrite) `directory/gateway.toml` (see `config_text` for the keywords)."""
    path = directory / "gateway.toml"
    path.write_text(config_text(nodes, **keywords))
    return path


# --- the JSON log ------------------------------------------------------------------------------


class CapturedLog(JsonLog):
    """A JsonLog writing to memory; `records()` parses what was written so far."""

    def __init__(self) -> None:
        super().__init__(io.StringIO())

    def lines(self) -> list[str]:
        return self.stream.getvalue().splitlines()

    def records(self) -> list[dict[str, str]]:
        return [json.loads(line) for line in self.lines()]

    def messages(self, node: str | None = None) -> list[str]:
        return [record["msg"] for record in self.records() if node is None or record.get("node") == node]


# --- a running gateway -------------------------------------------------------------------------


class _Serving:
    """`serve` running in the background: its exit code once it has returned."""

    def __init__(self) -> None:
        self.returned = trio.Event()
        self.exit_code: int | None = None

    async def run(self, config_path: Path, log: JsonLog, ready) -> None:
        self.exit_code = await serve(str(config_path), version="test", ready=ready, log=log)
        self.returned.set()


@dataclass
class Gateway:
    url: str
    metrics_url: str
    control_plane: ControlPlane
    config_path: Path
    log: CapturedLog
    http: httpx.AsyncClient
    serving: _Serving

    def logged(self, msg: str) -> list[dict]:
        return [record for record in self.log.records() if record["msg"] == msg]

    def node(self, ip: str) -> NodeState:
        return self.control_plane.view.snapshot.nodes[ip]

    async def wait_for(self, condition, timeout: float = 60.0) -> None:
        """Poll until `condition()` is true (`timeout` bounds a hang, not the wait: load may make it long)."""
        with trio.fail_after(timeout):
            while not condition():
                await trio.sleep(0.01)

    async def discovered(self) -> None:
        """Wait until every node's model listing has been applied at least once."""
        await self.wait_for(lambda: all(node.models.state != Discovery.UNTRIED for node in self.nodes()))

    async def exited(self, timeout: float = 60.0) -> int:
        """Wait until `serve` has returned; its exit code."""
        with trio.fail_after(timeout):
            await self.serving.returned.wait()
        return self.serving.exit_code

    def nodes(self) -> list[NodeState]:
        return self.control_plane.view.snapshot.node_list()

    async def metrics(self) -> str:
        response = await self.http.get(self.metrics_url + "/metrics")
        return response.text

    async def metric(self, sample: str) -> float | None:
        """The value of one sample line, e.g. `gateway_requests_total{model="m",status="200"}`."""
        for line in (await self.metrics()).splitlines():
            name, _, value = line.rpartition(" ")
            if name == sample:
                return float(value)
        return None


@asynccontextmanager
async def running_gateway(
    tmp_path: Path,
    nodes: Sequence[SimulatedNode],
    *,
    log: CapturedLog | None = None,
    **config: object,
) -> AsyncIterator[Gateway]:
    """Serve a gateway for `nodes` (see `config_text` for the config keywords) until the block
    ends (or it stops by itself, see `Gateway.exited`); its log is `log` (by default a new one)."""
    config_path = write_config(tmp_path, nodes, **config)
    log = log if log is not None else CapturedLog()
    listening: list[Listening] = []
    serving = _Serving()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serving.run, config_path, log, listening.append)
        with trio.fail_after(60):
            while not listening:
                await trio.sleep(0.005)
        ready = listening[0]
        # A failure in the block is re-raised after the nursery, unwrapped (a plain AssertionError).
        failure: Exception | None = None
        async with httpx.AsyncClient(timeout=60.0, trust_env=False) as http:
            try:
                yield Gateway(
                    url=f"http://127.0.0.1:{ready.api[1]}",
                    metrics_url=f"http://127.0.0.1:{ready.metrics[1]}",
                    control_plane=ready.control_plane,
                    config_path=config_path,
                    log=log,
                    http=http,
                    serving=serving,
                )
            except Exception as exc:
                failure = exc
        nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure


@asynccontextmanager
async def nodes_and_gateway(
    tmp_path: Path, specs: Sequence[NodeSpec], **config: object
) -> AsyncIterator[tuple[list[SimulatedNode], Gateway]]:
    """Simulated nodes from `specs` and a gateway in front of them (see `running_gateway`)."""
    async with serve_nodes(specs) as nodes, running_gateway(tmp_path, nodes, **config) as gateway:
        yield nodes, gateway


# --- `interlock serve` as a subprocess ----------------------------------------------------------


class ServeProcess:
    """An `interlock serve --config PATH` subprocess; its stdout (the JSON log) read on demand."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.output = b""

    def messages(self) -> list[str]:
        """The `msg` of each complete line written so far."""
        return [msgspec.json.decode(line)["msg"] for line in self.output.split(b"\n")[:-1]]

    def logged(self, msg: str) -> list[dict]:
        """The complete lines written so far with this `msg`."""
        lines = (msgspec.json.decode(line) for line in self.output.split(b"\n")[:-1])
        return [line for line in lines if line["msg"] == msg]

    async def wait_for_log(self, msg: str, timeout: float = 60.0) -> None:
        """Read stdout until a line with this `msg` has been written."""
        with trio.fail_after(timeout):
            while msg not in self.messages():
                chunk = await self.process.stdout.receive_some()
                assert chunk, f"stdout closed before {msg!r}: {self.output.decode()}"
                self.output += chunk

    async def exit(self) -> tuple[int, list[dict], str]:
        """Wait for the exit: the exit code, the log lines and stderr."""
        with trio.fail_after(30):
            while chunk := await self.process.stdout.receive_some():
                self.output += chunk
            errors = b""
            while chunk := await self.process.stderr.receive_some():
                errors += chunk
            code = await self.process.wait()
        return code, [msgspec.json.decode(line) for line in self.output.splitlines()], errors.decode()


@asynccontextmanager
async def serve_process(config_path: Path, **popen: object) -> AsyncIterator[ServeProcess]:
    """`interlock serve --config config_path` (more subprocess.Popen arguments in `popen`), killed
    at the end if still running."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "interlock.cli", "serve", "--config", str(config_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=PROJECT_ROOT,
        **popen,
    )
    try:
        yield ServeProcess(process)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


# --- requests and answers ----------------------------------------------------------------------


def tenants_toml(*tables: dict[str, object]) -> str:
    """`[[tenants]]` tables as TOML (for `config_text`'s `extra`)."""
    return "".join(_table_toml("[[tenants]]", table) for table in tables)


def admission_toml(**keys: object) -> str:
    """An `[admission]` table as TOML (the table turns the gateway's queue on)."""
    return _table_toml("[admission]", keys)


def _table_toml(header: str, table: dict[str, object]) -> str:
    return "\n".join([header, *(f"{key} = {_toml(value)}" for key, value in table.items())]) + "\n"


def completions_to(node: SimulatedNode) -> list:
    """The completion requests `node` received (probes left out)."""
    return [request for request in node.requests if request.path.startswith("/v1/") and request.method == "POST"]


async def post_and_leave(gateway: Gateway, node: SimulatedNode, body: dict) -> Any:
    """Send the chat completion `body` and leave (the client closes its connection) once the
    request has reached `node`, whatever the machine's load: the node's record of it."""
    before = len(completions_to(node))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(gateway.http.post, gateway.url + "/v1/chat/completions", json=body))
        await gateway.wait_for(lambda: len(completions_to(node)) > before)
        nursery.cancel_scope.cancel()
    return completions_to(node)[-1]


def chat(model: str | None = MODEL, stream: bool = False, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    if model is not None:
        body["model"] = model
    if stream:
        body["stream"] = True
    return body


def sse_events(text: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order."""
    return re.findall(r"^data: (.*)$", text, flags=re.MULTILINE)


async def post_cut_short(http: httpx.AsyncClient, url: str, body: dict) -> tuple[httpx.Response, bytes]:
    """POST `body` and read an answer that must end cut short (the connection closed before the
    body's end): the response and the body bytes received."""
    received = b""
    async with http.stream("POST", url, json=body) as response:
        try:
            async for chunk in response.aiter_raw():
                received += chunk
        except httpx.RemoteProtocolError:
            return response, received
    raise AssertionError(f"the answer ended complete: {received[-200:]!r}")


def decision_records(path: Path) -> list[Decision]:
    """The records of the decision log at `path` written so far (none before its first segment)."""
    return list(read_decisions(path)) if list_segments(path) else []


def error_message(response: httpx.Response) -> str:
    return response.json()["error"]["message"]


def table(out: str, first_heading: str) -> list[dict[str, str]]:
    """The rows of the table whose heading line starts with `first_heading`."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first_heading + " "))
    headings = [heading for heading in lines[start].split("  ") if heading.strip()]
    starts = [lines[start].index(heading.strip()) for heading in headings]
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        cells = [line[begin:end].strip() for begin, end in zip(starts, starts[1:] + [None])]
        rows.append(dict(zip((heading.strip() for heading in headings), cells)))
    return rows


async def wait_until_ready(client: httpx.AsyncClient, url: str) -> None:
    """Wait until the gateway at `url` (a subprocess, say) routes: `/ready` answers 200."""
    with trio.fail_after(60):
        while True:
            try:
                if (await client.get(url + "/ready")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await trio.sleep(0.05)

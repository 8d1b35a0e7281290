"""`interlock serve`'s command line: the options that override the config file (at start and at
every reload), INTERLOCK_CONFIG, the log level and format (workers included), `--help`, and a
bare `interlock`. Each runs the real `interlock` in a subprocess."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import msgspec
import pytest
import trio

from controlplane.infrastructure.config import ConfigError, Overrides, load_config
from events.log import read_events
from fixtures.node import serve_nodes

from harness import MODEL, chat, config_text, free_port, node_specs
from nats_cluster import nats_servers

PROJECT_ROOT = Path(__file__).resolve().parent.parent
TEXT_LINE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ (INFO |WARN |ERROR) \S.*")


class Gateway:
    """An `interlock serve` subprocess; its stdout read on demand."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.output = ""

    async def read_until(self, text: str) -> None:
        with trio.fail_after(60):
            while text not in self.output:
                chunk = await self.process.stdout.receive_some()
                assert chunk, f"stdout closed before {text!r}: {self.output}"
                self.output += chunk.decode()

    async def stop(self) -> tuple[int, str, str]:
        """SIGTERM, then the exit code, all of stdout and stderr."""
        self.process.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            while chunk := await self.process.stdout.receive_some():
                self.output += chunk.decode()
            errors = b""
            while chunk := await self.process.stderr.receive_some():
                errors += chunk
            return await self.process.wait(), self.output, errors.decode()


@asynccontextmanager
async def interlock_serve(*options: str, env: dict[str, str] | None = None) -> AsyncIterator[Gateway]:
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "interlock.cli", "serve", *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=PROJECT_ROOT,
        env={**os.environ, **(env or {})},
    )
    try:
        yield Gateway(process)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_listen_options_and_INTERLOCK_CONFIG_override_the_file_at_start_and_on_reload(tmp_path):
    event_log = tmp_path / "events.jsonl"
    api, metrics = free_port(), free_port()
    async with serve_nodes(node_specs(1)) as nodes:
        config_path = tmp_path / "gateway.toml"
        config_path.write_text(config_text(nodes, event_log=str(event_log)))  # listens on port 0
        options = ("--listen", f"127.0.0.1:{api}", "--metrics-listen", f"127.0.0.1:{metrics}")
        async with interlock_serve(*options, env={"INTERLOCK_CONFIG": str(config_path)}) as gateway:
            await gateway.read_until('"metrics server listening"')
            async with httpx.AsyncClient(trust_env=False) as client:
                assert (await client.get(f"http://127.0.0.1:{api}/health")).status_code == 200
                assert "gateway_requests_total" in (await client.get(f"http://127.0.0.1:{metrics}/metrics")).text
            gateway.process.send_signal(signal.SIGHUP)
            await gateway.read_until('"config reloaded"')
            code, output, errors = await gateway.stop()
    assert (code, errors) == (0, "")
    lines = [msgspec.json.decode(line) for line in output.splitlines()]
    listening = {line["msg"]: line["addr"] for line in lines if line["msg"].endswith("server listening")}
    assert listening == {"api server listening": f"127.0.0.1:{api}", "metrics server listening": f"127.0.0.1:{metrics}"}
    # The reload kept the command line's addresses: nothing "changed; requires restart".
    assert [line["msg"] for line in lines if "requires restart" in line["msg"]] == []
    recorded = [event.config.gateway.listen for event in read_events([event_log]) if hasattr(event, "config")]
    assert recorded == [f"127.0.0.1:{api}"] * 2  # run_started and config_reloaded


async def test_port_keeps_the_files_host_and_log_format_text_writes_a_line_for_a_person(tmp_path):
    api = free_port()
    async with serve_nodes(node_specs(1)) as nodes:
        config_path = tmp_path / "gateway.toml"
        config_path.write_text(config_text(nodes, helth_interval="1s"))  # an unknown key: a warning
        async with interlock_serve("--config", str(config_path), "--port", str(api), "--log-format", "text") as gateway:
            await gateway.read_until(" metrics server listening ")
            code, output, errors = await gateway.stop()
    assert (code, errors) == (0, "")
    lines = output.splitlines()
    assert all(TEXT_LINE.fullmatch(line) for line in lines), output
    assert any(line.endswith(f" INFO  api server listening  addr=127.0.0.1:{api}") for line in lines), output
    [warning] = [line for line in lines if " WARN " in line]
    assert warning.endswith(
        f"WARN  unknown config key  file={config_path} key=gateway.helth_interval did_you_mean=gateway.health_interval"
    )
    assert lines[-1].endswith("INFO  gateway stopped  seq=" + lines[-1].rsplit("=", 1)[1])


@pytest.mark.parametrize("level", ["warn", "error"])
async def test_workers_log_at_the_leaders_level_and_format(tmp_path, level):
    api = free_port()
    async with serve_nodes(node_specs(1)) as nodes:
        config_path = tmp_path / "gateway.toml"
        # A configured model that no node serves: a request for it is a warning, from its worker.
        config_path.write_text(config_text(nodes, models=[(MODEL, ""), ("unserved", "")], workers=2))
        options = ("--config", str(config_path), "--port", str(api), "--log-format", "text", "--log-level", level)
        async with interlock_serve(*options) as gateway:
            async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
                with trio.fail_after(60):
                    while True:  # until the node's models are discovered and both workers listen
                        try:
                            response = await client.post(f"http://127.0.0.1:{api}/v1/chat/completions", json=chat())
                        except httpx.TransportError:
                            response = None
                        if response is not None and response.status_code == 200:
                            break
                        await trio.sleep(0.1)
                unserved = await client.post(f"http://127.0.0.1:{api}/v1/chat/completions", json=chat("unserved"))
                assert unserved.status_code == 503  # its warning was written before the answer
            code, output, errors = await gateway.stop()
    assert (code, errors) == (0, "")
    lines = output.splitlines()
    assert all(TEXT_LINE.fullmatch(line) for line in lines), output
    assert not [line for line in lines if " INFO " in line], output  # the leader's and the workers'
    warnings = [line for line in lines if " no node serves requested model " in line]
    if level == "error":
        assert warnings == []
    else:
        [warning] = warnings
        assert re.search(r" WARN  no node serves requested model  worker=[12] model=unserved request_id=\w+$", warning)


def test_serve_help_shows_each_default_and_a_bare_interlock_lists_the_commands():
    def interlock(*argv: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "interlock.cli", *argv]
        return subprocess.run(command, capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=30, check=False)

    help_text = " ".join(interlock("serve", "--help").stdout.split())
    for default in [
        "(default: $INTERLOCK_CONFIG if set, else config/gateway.toml)",
        "(gateway.listen: :8000)",
        "(gateway.metrics_listen: :9090)",
        "(gateway.log_level: info)",
        "(gateway.log_format: json)",
        "(gateway.workers: 1)",
        "as vLLM's --host",
        "as vLLM's --port",
        "2 for invalid options",
    ]:
        assert default in help_text
    bare = interlock()
    assert bare.returncode == 0
    for command in ("demo", "serve", "check-config", "replay", "explain", "audit", "timeline"):
        assert re.search(rf"^    {command}\b", bare.stdout, re.MULTILINE), bare.stdout
    wrong = interlock("serve", "--listen", ":1", "--port", "2")
    assert (wrong.returncode, wrong.stderr) == (
        2,
        "interlock serve: error: argument --port: not allowed with argument --listen (its address has a port)\n",
    )


async def test_a_reload_applies_the_files_log_level(tmp_path):
    async with serve_nodes(node_specs(1)) as nodes:
        config_path = tmp_path / "gateway.toml"
        config_path.write_text(config_text(nodes))
        async with interlock_serve("--config", str(config_path)) as gateway:
            await gateway.read_until('"metrics server listening"')
            # workers = 2 needs a restart: a warning, logged after the reload's new level took effect.
            config_path.write_text(config_text(nodes, log_level="warn", workers=2))
            gateway.process.send_signal(signal.SIGHUP)
            await gateway.read_until('"gateway.workers changed; requires restart"')
            code, output, errors = await gateway.stop()
    assert (code, errors) == (0, "")
    lines = [msgspec.json.decode(line) for line in output.splitlines()]
    messages = [(line["level"], line["msg"]) for line in lines]
    after_reload = messages[messages.index(("warn", "gateway.workers changed; requires restart")) :]
    # The reload itself is said at warn, so the operator sees it; `gateway stopped` (info) is not.
    assert after_reload == [("warn", "gateway.workers changed; requires restart"), ("warn", "config reloaded")]


async def test_audit_log_format_text_prints_the_lines_the_live_text_log_printed(tmp_path):
    event_log = tmp_path / "events.jsonl"
    async with serve_nodes(node_specs(2)) as nodes:
        config_path = tmp_path / "gateway.toml"
        config_path.write_text(config_text(nodes, event_log=str(event_log)))
        async with interlock_serve("--config", str(config_path), "--log-format", "text") as gateway:
            await gateway.read_until(" models discovered ")
            gateway.process.send_signal(signal.SIGHUP)
            await gateway.read_until(" config reloaded ")
            code, output, errors = await gateway.stop()
    assert (code, errors) == (0, "")
    live_transitions = [line for line in output.splitlines() if "  seq=" in line]
    with trio.fail_after(30):
        audit = await trio.run_process(
            [sys.executable, "-m", "interlock.cli", "audit", str(event_log), "--log-format", "text"],
            capture_stdout=True, cwd=PROJECT_ROOT,
        )  # fmt: skip
    assert audit.stdout.decode().splitlines() == live_transitions
    assert any(" INFO  config reloaded  seq=" in line for line in live_transitions)


def test_serve_help_names_the_settings_a_reload_keeps():
    run = [sys.executable, "-m", "interlock.cli", "serve", "--help"]
    completed = subprocess.run(run, capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=30, check=True)
    serve_help = " ".join(completed.stdout.split())
    assert "(nodes, models, routing, keys, log_level, log_format) but these gateway settings" in serve_help
    for key in ("listen", "event_log", "decision_log", "workers"):
        assert f" {key}," in serve_help or f" {key}." in serve_help


def test_an_unknown_log_level_names_the_key_and_the_levels(tmp_path):
    config_path = tmp_path / "gateway.toml"
    config_path.write_text(config_text([], log_level="debug") + '[[nodes]]\nip = "10.0.0.1"\n')
    result = subprocess.run(
        [sys.executable, "-m", "interlock.cli", "check-config", str(config_path)],
        capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=30, check=False,
    )  # fmt: skip
    assert (result.returncode, result.stderr) == (
        2,
        f'{config_path}: gateway.log_level: log_level must be one of info, warn, error (got "debug")\n',
    )


@pytest.mark.parametrize(
    ("listen", "overrides", "expected"),
    [
        (":8000", Overrides(port=8001), ":8001"),  # all interfaces stay all interfaces
        ("10.1.2.3:8000", Overrides(host="127.0.0.1"), "127.0.0.1:8000"),
        ("10.1.2.3:8000", Overrides(host="::1", port=9000), "[::1]:9000"),
        ("[::1]:8000", Overrides(port=9000), "[::1]:9000"),
        ("10.1.2.3:8000", Overrides(listen="127.0.0.1:7000"), "127.0.0.1:7000"),
    ],
)
def test_host_and_port_each_replace_one_half_of_the_files_listen(tmp_path, listen, overrides, expected):
    config_path = tmp_path / "gateway.toml"
    config_path.write_text(f'[gateway]\nlisten = "{listen}"\n[[nodes]]\nip = "10.0.0.1"\n')
    assert load_config(config_path, overrides=overrides).gateway.listen == expected


def test_an_override_that_collides_with_the_file_is_refused_by_the_loader(tmp_path):
    config_path = tmp_path / "gateway.toml"
    config_path.write_text('[gateway]\nmetrics_listen = ":9090"\n[[nodes]]\nip = "10.0.0.1"\n')
    with pytest.raises(ConfigError, match='metrics_listen: metrics_listen ":9090" and listen ":9090" both bind'):
        load_config(config_path, overrides=Overrides(port=9090))


def test_serve_without_a_config_file_says_how_to_give_one(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "INTERLOCK_CONFIG"}
    result = subprocess.run(
        [sys.executable, "-m", "interlock.cli", "serve"], capture_output=True, text=True, cwd=tmp_path, timeout=30,
        env={**env, "PYTHONPATH": str(PROJECT_ROOT)}, check=False,
    )  # fmt: skip
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == (
        "fatal: no config file at config/gateway.toml: give its path with --config PATH or $INTERLOCK_CONFIG "
        "(config/gateway.toml in a checkout documents every key)\n"
    )


async def test_sigterm_while_the_config_is_being_read_ends_serve(tmp_path):
    # A config file that is a FIFO with a writer that never writes: its read never ends.
    fifo = tmp_path / "gateway.toml"
    os.mkfifo(fifo)
    async with interlock_serve("--config", str(fifo)) as gateway:
        with trio.fail_after(60):
            while True:  # opening the write end succeeds once serve has opened the read end
                try:
                    writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                    break
                except OSError:
                    await trio.sleep(0.05)
        try:
            code, out, errors = await gateway.stop()
        finally:
            os.close(writer)
    assert (code, out, errors) == (0, "", "")


def test_require_event_log_refuses_to_start_without_a_writable_event_log(tmp_path):
    def serve(config_text_: str) -> subprocess.CompletedProcess:
        config_path.write_text(config_text_)
        command = [sys.executable, "-m", "interlock.cli", "serve", "--config", str(config_path), "--require-event-log"]
        return subprocess.run(command, capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=30, check=False)

    config_path = tmp_path / "gateway.toml"
    node = '[[nodes]]\nip = "127.0.0.1"\n'
    listen = 'listen = "127.0.0.1:0"\nmetrics_listen = "127.0.0.1:0"\n'
    none = serve(f"[gateway]\n{listen}{node}")
    assert (none.returncode, none.stdout, none.stderr) == (
        1, "", f"fatal: --require-event-log: {config_path} sets no gateway.event_log\n"
    )  # fmt: skip
    (tmp_path / "a-file").write_text("")
    under_a_file = serve(f'[gateway]\n{listen}event_log = "{tmp_path}/a-file/events.jsonl"\n{node}')
    assert (under_a_file.returncode, under_a_file.stdout) == (1, "")
    assert under_a_file.stderr == (
        f"fatal: --require-event-log: {config_path}: gateway.event_log = {tmp_path}/a-file/events.jsonl: "
        f"cannot create its directory {tmp_path}/a-file: {tmp_path}/a-file is not a directory\n"
    )


def readme_block(heading: str, language: str) -> str:
    """The first ```language block after `heading` in the README."""
    text = (PROJECT_ROOT / "README.md").read_text()
    section = text[text.index(f"\n{heading}\n") :]
    return section.split(f"```{language}\n", 1)[1].split("```", 1)[0]


async def test_the_readmes_config_for_your_own_nodes_serves_their_models_and_explains_a_request(tmp_path):
    """The quick start's config and commands as written: check-config, serve, a request with
    the README's id, then its `explain` from the two logs (run in the directory serve wrote them
    in, which the README's relative paths name)."""
    config = readme_block("### Point it at your vLLM nodes", "toml")
    commands = readme_block("### Point it at your vLLM nodes", "sh").splitlines()
    (tmp_path / "gateway.toml").write_text(config)
    with trio.fail_after(30):
        checked = await trio.run_process(
            [sys.executable, "-m", "interlock.cli", "check-config", "gateway.toml"],
            capture_stdout=True, capture_stderr=True, cwd=tmp_path, check=False,
        )  # fmt: skip
    assert (checked.returncode, checked.stderr) == (0, b""), checked.stderr
    async with serve_nodes(node_specs(2)) as nodes:
        # The same file, with the two simulated nodes' addresses and ports in place of yours.
        for documented, node in zip(("10.0.0.1", "10.0.0.2"), nodes):
            config = config.replace(f'ip = "{documented}"', f'ip = "{node.host}"\nvllm_port = {node.vllm_port}')
        config_path = tmp_path / "gateway.toml"
        for log in ("events", "decisions"):  # serve runs in the checkout: the logs go where explain reads them
            config = config.replace(f'"var/{log}.jsonl"', f'"{tmp_path}/var/{log}.jsonl"')
        config_path.write_text(config)
        api = free_port()
        options = ("--config", str(config_path), "--listen", f"127.0.0.1:{api}", "--metrics-listen", "127.0.0.1:0")
        async with interlock_serve(*options) as gateway, httpx.AsyncClient(trust_env=False, timeout=60) as client:
            url = f"http://127.0.0.1:{api}"
            with trio.fail_after(60):
                while True:  # until the nodes' model lists are in: no model is configured
                    try:
                        answer = await client.post(
                            url + "/v1/chat/completions", json=chat(), headers={"x-request-id": "first"}
                        )
                    except httpx.TransportError:
                        answer = None
                    if answer is not None and answer.status_code == 200:
                        break
                    await trio.sleep(0.1)
            assert answer.headers["x-interlock-node"] in {node.host for node in nodes}  # no name: the IP
            embeddings = await client.post(url + "/v1/embeddings", json={"model": MODEL, "input": "x"})
            assert embeddings.status_code == 200 and embeddings.json()["object"] == "list"
            unknown = await client.post(url + "/v1/embedding", json={"model": MODEL, "input": "x"})
            assert unknown.status_code == 404  # not routed
            code, _, errors = await gateway.stop()
    assert (code, errors) == (0, "")
    [explain] = [command for command in commands if " explain " in command]
    explained = await trio.run_process(
        explain.replace(".venv/bin/interlock", f"{sys.executable} -m interlock.cli"),
        shell=True, cwd=tmp_path, capture_stdout=True, capture_stderr=True, check=False,
        env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)},
    )  # fmt: skip
    assert (explained.returncode, explained.stderr) == (0, b""), explained.stderr
    assert answer.headers["x-interlock-node"] in explained.stdout.decode()  # the node it went to


async def test_serve_fleet_joins_a_fleet_and_its_workers_answer_for_the_replica(tmp_path):
    """`--fleet URL` with a [fleet] table that names no servers (only where partitions go): the
    replica is named after the host and, alone, leads; its workers' /health names it and the
    leader, and their /ready follows the replica's: still 200 once its NATS server is gone,
    degraded ("not connected to NATS"), and it keeps routing."""
    api = free_port()
    async with nats_servers(tmp_path) as [server], serve_nodes(node_specs(1)) as nodes:
        config_path = tmp_path / "gateway.toml"
        partitions = f'[fleet]\npartition_dir = "{tmp_path / "partitions"}"\n'
        config_path.write_text(config_text(nodes, health_interval="1s", workers=2) + partitions)
        options = ("--config", str(config_path), "--listen", f"127.0.0.1:{api}", "--fleet", server.url)
        async with interlock_serve(*options) as gateway, httpx.AsyncClient(trust_env=False) as client:
            await gateway.read_until('"api server listening"')
            host = socket.gethostname()
            with trio.fail_after(60):
                while True:
                    response = await client.get(f"http://127.0.0.1:{api}/ready")
                    if response.status_code == 200:
                        break
                    await trio.sleep(0.1)
            response = await client.get(f"http://127.0.0.1:{api}/health")
            assert response.headers["X-Interlock-Worker"] in ("1", "2")
            assert (response.headers["X-Interlock-Replica"], response.headers["X-Interlock-Leader"]) == (host, host)
            assert (await client.post(f"http://127.0.0.1:{api}/v1/chat/completions", json=chat(MODEL))).status_code == 200
            await server.kill()
            with trio.fail_after(60):
                while True:
                    ready = await client.get(f"http://127.0.0.1:{api}/ready")
                    if ready.headers.get("X-Interlock-Degraded", "").startswith("not connected to NATS"):
                        break
                    await trio.sleep(0.1)
            assert ready.status_code == 200
            assert (await client.post(f"http://127.0.0.1:{api}/v1/chat/completions", json=chat(MODEL))).status_code == 200
            code, output, errors = await gateway.stop()
    assert (code, errors) == (0, "")
    assert "fleet: NATS client error" in output  # once, not a traceback per reconnection attempt

"""`interlock demo`: simulated vLLM nodes plus the gateway in front of them, in one process.

Starts one simulated node per `[[nodes]]` table of the demo config (on loopback addresses),
runs the real gateway on that config, waits until it has discovered every node's models,
sends one chat completion through it and prints the answer and the node that served it (the
gateway's `X-Interlock-Node`), then keeps serving until Ctrl-C (or stops at once with `--once`).

Its files go to one directory, whatever the working directory: the gateway's log
(`gateway.log`, so that the terminal shows the answer, not log lines) and the event and decision
logs when the config gives them relative paths. When the gateway stops before it serves (its
port taken, say), the terminal says why: the log's error lines are repeated there.
"""

from __future__ import annotations

import collections
import os
import signal
import sys
from functools import partial
from pathlib import Path
from typing import TextIO

import httpx
import prometheus_client
import trio

from controlplane.infrastructure.config import ConfigError, Overrides, load_config
from controlplane.infrastructure.gocompat import join_host_port, parse_listen_address
from controlplane.infrastructure.logs import JsonLog
from events.config import GatewayConfig
from events.state import Discovery
from fixtures.node import serve_nodes, specs_from_config
from interlock.serve import Listening, serve

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "config" / "demo.toml"
DISCOVERY_TIMEOUT = 15.0
QUESTION = "Which node are you?"
GATEWAY_LOG = "gateway.log"


def default_directory() -> Path:
    """Where the demo writes by default: `$XDG_STATE_HOME/interlock/demo` (`~/.local/state/…`)."""
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "interlock" / "demo"


class _DemoLog(JsonLog):
    """The gateway's log, keeping its last error lines for the terminal."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream=stream)
        self.errors: collections.deque[str] = collections.deque(maxlen=5)

    def write(self, at: float, level: str, msg: str, fields: dict[str, object] | tuple[tuple[str, str], ...]) -> None:
        super().write(at, level, msg, fields)
        if level == "error":
            error = dict(fields).get("error")
            self.errors.append(f"{msg}: {error}" if error else msg)


def run_demo(
    config_path: str,
    version: str,
    *,
    once: bool,
    directory: Path,
    log_to_stderr: bool,
    port: int | None = None,
    metrics_port: int | None = None,
) -> int:
    """The `interlock demo` entry point; returns the exit code. `port` and `metrics_port`
    replace the config's listen ports."""
    try:
        config = load_config(config_path)
    except ConfigError as error:
        print(f"fatal: loading config: {error}", file=sys.stderr)
        return 1
    directory = directory.resolve()
    log_path = None if log_to_stderr else directory / GATEWAY_LOG
    try:
        directory.mkdir(parents=True, exist_ok=True)
        log_stream: TextIO = sys.stderr if log_path is None else open(log_path, "w", encoding="utf-8")
    except OSError as error:
        print(f"demo: cannot write in {directory}: {error}", file=sys.stderr)
        return 1
    overrides = _files_in(directory, config.gateway, port, metrics_port)
    written = [str(path) for path in (log_path, overrides.event_log, overrides.decision_log) if path]
    segmented = [Path(path).name for path in (overrides.event_log, overrides.decision_log) if path]
    print(f"demo files: {', '.join(written) or 'none'}")
    if segmented:
        segments = Path(segmented[0])
        print(f"  ({' and '.join(segmented)} written as numbered segments: {segments.stem}.000001{segments.suffix}, …)")
    prometheus_client.disable_created_metrics()
    log = _DemoLog(log_stream)
    demo = partial(_demo, config_path, version, once=once, overrides=overrides, log=log, log_path=log_path)
    try:
        return trio.run(demo)
    finally:
        if log_path is not None:
            log_stream.close()


def _files_in(directory: Path, gateway: GatewayConfig, port: int | None, metrics_port: int | None) -> Overrides:
    """The event and decision logs in `directory` when the config gives them relative paths,
    and the listen ports the command line gives."""

    def placed(path: str) -> str | None:
        return str(directory / path) if path and not os.path.isabs(path) else path or None

    metrics_listen = None
    if metrics_port is not None:
        metrics_listen = join_host_port(parse_listen_address(gateway.metrics_listen)[0], metrics_port)
    return Overrides(
        event_log=placed(gateway.event_log),
        decision_log=placed(gateway.decision_log),
        port=port,
        metrics_listen=metrics_listen,
    )


async def _demo(
    config_path: str, version: str, *, once: bool, overrides: Overrides, log: _DemoLog, log_path: Path | None
) -> int:
    try:
        specs = specs_from_config(config_path)
    except (OSError, ValueError) as error:
        print(f"demo: cannot read the simulated nodes from {config_path}: {error}", file=sys.stderr)
        return 1
    try:
        async with serve_nodes(specs) as nodes:
            for node in nodes:
                print(f"simulated node {node.name:<12} {node.url}  serves {', '.join(node.models)}")
            exit_code = 0
            async with trio.open_nursery() as nursery:
                listening: list[Listening] = []
                ready = trio.Event()

                def on_ready(info: Listening) -> None:
                    listening.append(info)
                    ready.set()

                async def run_gateway() -> None:
                    nonlocal exit_code
                    exit_code = await serve(config_path, version=version, overrides=overrides, ready=on_ready, log=log)
                    ready.set()  # also when it could not start

                nursery.start_soon(run_gateway)
                await ready.wait()
                if not listening:
                    _print_why_it_stopped(log, log_path)
                    return exit_code or 1
                if not await _first_request(listening[0]):
                    exit_code = 1
                else:
                    _print_what_next(listening[0], once=once, log_path=log_path)
                if once or exit_code:
                    os.kill(os.getpid(), signal.SIGTERM)  # the same shutdown as Ctrl-C
            return exit_code
    except OSError as error:
        print(f"demo: cannot start the simulated nodes: {error}", file=sys.stderr)
        return 1


async def _first_request(listening: Listening) -> bool:
    control_plane = listening.control_plane
    with trio.move_on_after(DISCOVERY_TIMEOUT):
        while any(node.models.state == Discovery.UNTRIED for node in control_plane.view.snapshot.nodes.values()):
            await trio.sleep(0.05)
    host, port = listening.api
    base = f"http://{host}:{port}"
    model = control_plane.view.snapshot.config.models.default
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}]}
    print(f"\ngateway listening on {base} (metrics on http://{listening.metrics[0]}:{listening.metrics[1]}/metrics)")
    print(f"> POST {base}/v1/chat/completions  model={model}  \"{QUESTION}\"")
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as client:
        try:
            response = await client.post(f"{base}/v1/chat/completions", json=body)
        except httpx.HTTPError as error:
            print(f"demo: the request through the gateway failed: {error}", file=sys.stderr)
            return False
    if response.status_code != 200:
        print(f"demo: the gateway answered {response.status_code}: {response.text}", file=sys.stderr)
        return False
    answer = response.json()["choices"][0]["message"]["content"]
    print(f"< {answer}")
    print(f"  served by {response.headers.get('x-interlock-node')}, request id {response.headers.get('x-request-id')}")
    return True


def _print_why_it_stopped(log: _DemoLog, log_path: Path | None) -> None:
    """The gateway did not start: its error lines, on the terminal (its log is a file)."""
    for error in log.errors:
        print(f"demo: the gateway did not start: {error}", file=sys.stderr)
    if any("cannot listen on" in error for error in log.errors):
        print(
            "demo: another program listens there: `interlock demo --port N --metrics-port M` "
            "(`make demo PORT=N METRICS_PORT=M`) chooses other ports",
            file=sys.stderr,
        )
    if log_path is not None:
        print(f"demo: the gateway's log: {log_path}", file=sys.stderr)


def _print_what_next(listening: Listening, *, once: bool, log_path: Path | None) -> None:
    """What to try: requests of your own while the gateway serves, and `explain` on what it recorded."""
    gateway = listening.control_plane.view.snapshot.config.gateway
    model = listening.control_plane.view.snapshot.config.models.default
    interlock = Path(sys.executable).with_name("interlock")
    command = str(interlock) if interlock.exists() else "interlock"
    if not once:
        host, port = listening.api
        base = f"http://{host}:{port}"
        print("\nTry it yourself (Ctrl-C stops the demo):")
        print(
            f"  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' "
            f"""-d '{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}],"stream":true}}'"""
        )
        print(f"  curl -s {base}/health")
        if log_path:
            print(f"  tail -f {log_path}    # the gateway's log")
    if gateway.event_log:
        print(f"\n{'Explain' if once else 'And explain'} the routing from the recorded event log:")
        print(f"  {command} explain {gateway.event_log} --model {model}")

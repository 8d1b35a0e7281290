"""`interlock demo`: simulated vLLM nodes plus the gateway in front of them, in one process.

Starts one simulated node per `[[nodes]]` table of the demo config (on loopback addresses),
runs the real gateway on that config, waits until it has discovered every node's models,
sends one chat completion through it and prints the answer and the node that served it, then
keeps serving until Ctrl-C (or stops at once with `--once`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from functools import partial
from pathlib import Path

import httpx
import prometheus_client
import trio

from controlplane.config import ConfigError, load_config
from controlplane.logs import JsonLog
from events.state import Discovery
from fixtures.node import serve_nodes, specs_from_config
from interlock.serve import Listening, serve

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "config" / "demo.toml"
DISCOVERY_TIMEOUT = 15.0
QUESTION = "Which node are you?"


def run_demo(config_path: str, version: str, *, once: bool, quiet: bool) -> int:
    """The `interlock demo` entry point; returns the exit code."""
    try:
        load_config(config_path)
    except ConfigError as error:
        print(f"fatal: loading config: {error}", file=sys.stderr)
        return 1
    prometheus_client.disable_created_metrics()
    with open(os.devnull, "w") if quiet else contextlib.nullcontext(sys.stderr) as log_stream:
        return trio.run(partial(_demo, config_path, version, once=once, log=JsonLog(stream=log_stream)))


async def _demo(config_path: str, version: str, *, once: bool, log: JsonLog) -> int:
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
                    exit_code = await serve(config_path, version=version, ready=on_ready, log=log)
                    ready.set()  # also when it could not start

                nursery.start_soon(run_gateway)
                await ready.wait()
                if not listening:
                    return exit_code or 1
                if not await _first_request(listening[0]):
                    exit_code = 1
                if once or exit_code:
                    os.kill(os.getpid(), signal.SIGTERM)  # the same shutdown as Ctrl-C
            return exit_code
    except OSError as error:
        print(f"demo: cannot start the simulated nodes: {error}", file=sys.stderr)
        return 1


async def _first_request(listening: Listening) -> bool:
    control_plane = listening.control_plane
    with trio.move_on_after(DISCOVERY_TIMEOUT):
        while any(node.models.state == Discovery.UNTRIED for node in control_plane.snapshot.nodes.values()):
            await trio.sleep(0.05)
    host, port = listening.api
    base = f"http://{host}:{port}"
    model = control_plane.snapshot.config.models.default
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
    print(f"  served by {response.headers.get('x-served-by', '?')}, request id {response.headers.get('x-request-id')}")
    print("\nTry it yourself (Ctrl-C stops the demo):")
    print(
        f"  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' "
        f"""-d '{{"messages":[{{"role":"user","content":"hi"}}],"stream":true}}'"""
    )
    print(f"  curl -s {base}/health")
    event_log = control_plane.snapshot.config.gateway.event_log
    if event_log:
        print(f"  .venv/bin/interlock explain {event_log} --model {model}")
    return True


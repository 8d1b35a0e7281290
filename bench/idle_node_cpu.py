"""What an idle node costs the control plane in CPU, probed every second.

    python -m bench.idle_node_cpu [--nodes 1] [--seconds 30] [--no-event-log]

The simulated nodes run in a child process (this script with --serve), so only the control
plane's own CPU is counted: time.process_time() of this process (all its threads, so the
event-log writer too) over the measured window, after a few seconds of warm-up. Each second
brings, per node, one health check (`/health` and a GPU scrape) and one `/v1/models` listing,
so three events through the reducer and, unless --no-event-log, into the event log.
Prints CPU seconds per minute, in total and per node. Not part of the test run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from controlplane.logs import JsonLog
from controlplane.runtime import open_control_plane
from fixtures.node import NodeSpec, serve_nodes

WARM_UP_SECONDS = 3.0


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.idle_node_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1, help="simulated nodes (default 1)")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured window (default 30)")
    parser.add_argument("--no-event-log", action="store_true", help="run without an event log")
    parser.add_argument("--serve", type=int, metavar="N", help=argparse.SUPPRESS)  # the child's role
    args = parser.parse_args()
    if args.serve:
        trio.run(_serve, args.serve)
        return
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.idle_node_cpu", "--serve", str(args.nodes)], stdout=subprocess.PIPE, text=True
    )
    try:
        nodes = json.loads(child.stdout.readline())
        with tempfile.TemporaryDirectory() as folder:
            config_path = _write_config(Path(folder), nodes, event_log=not args.no_event_log)
            cpu, wall, events = trio.run(_measure, config_path, args.seconds)
    finally:
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=10)
    per_minute = cpu / wall * 60
    print(f"nodes: {args.nodes}, health_interval 1s, event log: {'off' if args.no_event_log else 'on'}")
    print(f"measured {wall:.1f} s: {cpu:.3f} CPU s, {events} events applied ({events / wall:.1f}/s)")
    print(f"control plane CPU: {per_minute:.2f} s per minute ({per_minute / args.nodes:.2f} s per node per minute)")


async def _measure(config_path: Path, seconds: float) -> tuple[float, float, int]:
    with open(os.devnull, "w") as devnull:
        async with open_control_plane(config_path, version="bench", log=JsonLog(devnull)) as control_plane:
            await trio.sleep(WARM_UP_SECONDS)
            cpu_start, wall_start, seq_start = time.process_time(), time.monotonic(), control_plane.snapshot.seq
            await trio.sleep(seconds)
            cpu, wall = time.process_time() - cpu_start, time.monotonic() - wall_start
            return cpu, wall, control_plane.snapshot.seq - seq_start


def _write_config(folder: Path, nodes: list[dict], *, event_log: bool) -> Path:
    lines = ["[gateway]", 'health_interval = "1s"', 'probe_timeout = "5s"']
    if event_log:
        lines.append(f"event_log = {json.dumps(str(folder / 'events.jsonl'))}")
    for node in nodes:
        lines += [
            "[[nodes]]",
            f"ip = {json.dumps(node['host'])}",
            f"name = {json.dumps(node['name'])}",
            f"vllm_port = {node['vllm_port']}",
            f"metrics_port = {node['metrics_port']}",
        ]
    path = folder / "gateway.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


async def _serve(count: int) -> None:
    """The child: nodes on 127.0.1.1, 127.0.1.2, … (a node's IP is its identity), described as
    one JSON line on stdout; serves until SIGTERM."""
    specs = [NodeSpec(name=f"bench-node-{index + 1}", host=f"127.0.1.{index + 1}") for index in range(count)]
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with serve_nodes(specs) as nodes:
            described = [
                {"host": n.host, "name": n.name, "vllm_port": n.vllm_port, "metrics_port": n.metrics_port} for n in nodes
            ]
            print(json.dumps(described), flush=True)
            async for _ in signals:
                return


if __name__ == "__main__":
    main()

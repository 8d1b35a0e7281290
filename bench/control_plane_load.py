"""The control plane's cost with many nodes probed every second: CPU (% of one core) and RSS.

    python -m bench.control_plane_load [--nodes 100] [--seconds 20]

Two child processes: the simulated nodes (`fixtures.node`, each on its own loopback address
127.0.1.1, 127.0.1.2, …, 127.0.2.1, …, since a node's IP is its identity), and the control plane
alone (`controlplane.effects.control_plane.open_control_plane`: probes, reducer, event log on; no data plane)
with `health_interval = "1s"`. Once every node is healthy and its models listed, the control
plane measures its own CPU time (all threads) over `--seconds`, and the events it applied:
each node should bring three a second (health, GPU scrape, model listing); fewer means the
probe rounds fell behind. Its RSS is its peak (VmHWM) at the end.

`python -m bench` runs this for 100 and 1,000 nodes, the control plane pinned away from the nodes;
`--nodes 1` gives what one idle node costs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from bench.processes import CorePlan, Processes, cpu_seconds, peak_rss_bytes, plan_cores, read_json_line
from bench.upstream import MODEL
from controlplane.infrastructure.logs import JsonLog
from controlplane.effects.control_plane import open_control_plane
from events.state import Health
from fixtures.node import NodeSpec, serve_nodes

PROJECT_ROOT = Path(__file__).resolve().parent.parent
EVENTS_PER_NODE_ROUND = 3
READY_TIMEOUT = 60.0
SETTLE_SECONDS = 2.0
"""After every node is ready: let the connection pools and rounds settle before measuring."""


def node_address(index: int) -> str:
    return f"127.0.{1 + index // 250}.{index % 250 + 1}"


def measure_control_plane(
    processes: Processes, folder: Path, *, nodes: int, seconds: float, cores: CorePlan
) -> dict:
    """Run the nodes and the control plane (see the module docstring) and return the figures."""
    node_process = processes.start(
        f"nodes-{nodes}",
        [sys.executable, "-m", "bench.control_plane_load", "--serve-nodes", str(nodes)],
        cores=cores.load,
        cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE,
    )
    try:
        described = read_json_line(node_process, timeout=60)
        config = folder / f"control-plane-{nodes}.toml"
        config.write_text(control_plane_config(folder / f"events-{nodes}.jsonl", described))
        control_plane = processes.start(
            f"control-plane-{nodes}",
            [
                sys.executable, "-m", "bench.control_plane_load", "--run", str(config), "--seconds", str(seconds),
                "--nodes-pid", str(node_process.pid),
            ],
            cores=cores.server,
            cwd=PROJECT_ROOT,
            stdout=subprocess.PIPE,
        )
        try:
            figures = read_json_line(control_plane, timeout=READY_TIMEOUT + SETTLE_SECONDS + seconds + 30)
        finally:
            processes.stop(control_plane)
    finally:
        processes.stop(node_process)
    figures["nodes"] = nodes
    return figures


def control_plane_config(event_log: Path, nodes: list[dict]) -> str:
    quoted = json.dumps  # a TOML basic string for these plain values
    lines = ["[gateway]", 'health_interval = "1s"', 'probe_timeout = "5s"', f"event_log = {quoted(str(event_log))}"]
    for node in nodes:
        lines += [
            "[[nodes]]",
            f"ip = {quoted(node['host'])}",
            f"name = {quoted(node['name'])}",
            f"vllm_port = {node['vllm_port']}",
            f"metrics_port = {node['metrics_port']}",
        ]
    lines += ["[models]", f"default = {quoted(MODEL)}", "[[models.available]]", f"name = {quoted(MODEL)}"]
    return "\n".join(lines) + "\n"


# --- the children ----------------------------------------------------------------------------


def raise_file_limit() -> None:
    """A thousand nodes need thousands of sockets, in both processes."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def _serve_nodes(count: int) -> None:
    """Serve `count` simulated nodes, describe them as one JSON line on stdout, run until SIGTERM."""
    specs = [
        NodeSpec(name=f"bench-node-{index + 1}", host=node_address(index), models=[MODEL], keep_requests=1)
        for index in range(count)
    ]
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with serve_nodes(specs) as nodes:
            described = [
                {"host": n.host, "name": n.name, "vllm_port": n.vllm_port, "metrics_port": n.metrics_port} for n in nodes
            ]
            print(json.dumps(described), flush=True)
            async for _ in signals:
                return


async def _run_control_plane(config_path: str, seconds: float, nodes_pid: int | None) -> dict:
    """Run the control plane until every node is ready, then measure it for `seconds` (and the
    CPU of the nodes' process, to tell whether they kept up)."""
    nodes_pids = [nodes_pid] if nodes_pid else []
    def ready(snapshot) -> int:
        return sum(1 for node in snapshot.nodes.values() if node.status == Health.HEALTHY and node.models.settled())

    with open(os.devnull, "w") as devnull:
        async with open_control_plane(config_path, version="bench", log=JsonLog(devnull)) as control_plane:
            node_count = len(control_plane.view.snapshot.nodes)
            with trio.move_on_after(READY_TIMEOUT):
                while ready(control_plane.view.snapshot) < node_count:
                    await trio.sleep(0.1)
            await trio.sleep(SETTLE_SECONDS)
            cpu_start, wall_start, seq_start = time.process_time(), time.monotonic(), control_plane.view.snapshot.seq
            nodes_cpu_start = cpu_seconds(nodes_pids)
            await trio.sleep(seconds)
            cpu, wall = time.process_time() - cpu_start, time.monotonic() - wall_start
            nodes_cpu = cpu_seconds(nodes_pids) - nodes_cpu_start
            events = control_plane.view.snapshot.seq - seq_start
            return {
                "seconds": wall,
                "cpu_seconds": cpu,
                "core_percent": cpu / wall * 100,
                "events": events,
                "events_per_second": events / wall,
                "expected_events_per_second": EVENTS_PER_NODE_ROUND * node_count,
                "ready_nodes": ready(control_plane.view.snapshot),
                "nodes_process_core_percent": nodes_cpu / wall * 100 if nodes_pids else None,
                "peak_rss_bytes": peak_rss_bytes([os.getpid()]),
            }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.control_plane_load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=100, help="simulated nodes (default 100)")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window (default 20)")
    parser.add_argument("--serve-nodes", type=int, metavar="N", help=argparse.SUPPRESS)  # a child's role
    parser.add_argument("--run", metavar="CONFIG", help=argparse.SUPPRESS)  # the other child's role
    parser.add_argument("--nodes-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_nodes or args.run:
        raise_file_limit()
    if args.serve_nodes:
        trio.run(_serve_nodes, args.serve_nodes)
    elif args.run:
        print(json.dumps(trio.run(_run_control_plane, args.run, args.seconds, args.nodes_pid)), flush=True)
    else:
        with tempfile.TemporaryDirectory(prefix="interlock-bench-") as folder, Processes(Path(folder)) as processes:
            figures = measure_control_plane(processes, Path(folder), nodes=args.nodes, seconds=args.seconds, cores=plan_cores())
        print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()

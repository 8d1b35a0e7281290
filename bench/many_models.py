"""What nodes that list many models cost the gateway (issue 26): `--nodes` simulated nodes, each
listing `--models-per-node` models of its own, behind `interlock serve` probing every second.

    python -m bench.many_models [--nodes 20] [--models-per-node 1000] [--seconds 20] [--source DIR]

Prints one JSON line: the seconds until every node's listing was applied, `/health` latency
while it runs (median and worst of one request every half second over `--seconds`), the
gateway's CPU (% of one core) over that window, and the size of `/metrics` with its
`interlock_model_nodes` series. `--source` runs the `interlock serve` of another checkout (a
`git archive` of an older commit, say) with this checkout's simulated nodes, to compare.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.processes import Processes, cpu_seconds, group_pids, read_json_line

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DISCOVERY_TIMEOUT = 900.0


def _serve_nodes(nodes: int, models_per_node: int) -> None:
    """The nodes' process: prints their addresses as one JSON line, serves until signalled."""
    import trio

    from fixtures.node import NodeSpec, serve_nodes

    specs = [
        NodeSpec(
            name=f"n{index}",
            host=f"127.0.0.{index + 1}",
            models=["bench-model", *(f"n{index}/adapter-{number:05d}" for number in range(models_per_node))],
        )
        for index in range(1, nodes + 1)
    ]

    async def serve() -> None:
        async with serve_nodes(specs) as running:
            print(json.dumps([[node.host, node.vllm_port, node.metrics_port] for node in running]), flush=True)
            await trio.sleep_forever()

    trio.run(serve)


def _config(nodes: list[list], listen_port: int, metrics_port: int) -> str:
    lines = [
        "[gateway]",
        f'listen = "127.0.0.1:{listen_port}"',
        f'metrics_listen = "127.0.0.1:{metrics_port}"',
        'health_interval = "1s"',
    ]
    for index, (host, vllm_port, gpu_port) in enumerate(nodes, start=1):
        lines += ["[[nodes]]", f'ip = "{host}"', f'name = "n{index}"', f"vllm_port = {vllm_port}", f"metrics_port = {gpu_port}"]
    lines += ["[models]", "[[models.available]]", 'name = "bench-model"']
    return "\n".join(lines) + "\n"


def _get(port: int, path: str, timeout: float = 60.0) -> tuple[int, bytes, float]:
    """Status, body and seconds of one GET on 127.0.0.1."""
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read(), time.perf_counter() - started
    finally:
        connection.close()


def measure(nodes: int, models_per_node: int, seconds: float, source: Path) -> dict:
    from bench.processes import free_port

    with tempfile.TemporaryDirectory() as folder, Processes(Path(folder)) as processes:
        runner = processes.start(
            "nodes",
            [sys.executable, "-m", "bench.many_models", "--serve-nodes", str(nodes), str(models_per_node)],
            cores=None,
            cwd=PROJECT_ROOT,
            stdout=subprocess.PIPE,
        )
        addresses = read_json_line(runner, 60)
        api, metrics = free_port(), free_port()
        config = Path(folder) / "gateway.toml"
        config.write_text(_config(addresses, api, metrics))
        started = time.monotonic()
        gateway = processes.start(
            "gateway", [sys.executable, "-m", "interlock.cli", "serve", "--config", str(config)], cores=None, cwd=source
        )
        while True:
            if gateway.poll() is not None:
                raise RuntimeError(f"the gateway exited: {processes.log_tail('gateway')}")
            if time.monotonic() - started > DISCOVERY_TIMEOUT:
                raise RuntimeError("the listings were not all applied in time")
            try:
                status, body, _ = _get(api, "/health")
            except OSError:
                time.sleep(0.2)
                continue
            if status == 200 and all(node["models"]["state"] == "known" for node in json.loads(body)["details"]):
                break
            time.sleep(0.5)
        discovered = time.monotonic() - started
        pids = group_pids(gateway.pid)
        cpu_before, window_started = cpu_seconds(pids), time.monotonic()
        latencies = []
        while time.monotonic() - window_started < seconds:
            latencies.append(_get(api, "/health")[2])
            time.sleep(0.5)
        cpu = (cpu_seconds(pids) - cpu_before) / (time.monotonic() - window_started)
        _, page, _ = _get(metrics, "/metrics")
    model_series = [line for line in page.decode().splitlines() if line.startswith("interlock_model_nodes{")]
    return {
        "nodes": nodes,
        "models_listed": nodes * models_per_node,
        "source": str(source),
        "discovery_seconds": round(discovered, 2),
        "health_ms_median": round(statistics.median(latencies) * 1000, 1),
        "health_ms_max": round(max(latencies) * 1000, 1),
        "cpu_percent": round(cpu * 100, 1),
        "metrics_bytes": len(page),
        "model_nodes_series": len(model_series),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.many_models", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--models-per-node", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20.0, help="the measured window (default: 20)")
    parser.add_argument("--source", type=Path, default=PROJECT_ROOT, help="the checkout whose gateway runs")
    parser.add_argument("--serve-nodes", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_nodes:
        _serve_nodes(*args.serve_nodes)
        return 0
    print(json.dumps(measure(args.nodes, args.models_per_node, args.seconds, args.source.resolve())))
    return 0


if __name__ == "__main__":
    sys.exit(main())

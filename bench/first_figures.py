"""First throughput figures of the data plane: small requests/s and streamed chunks/s through
`interlock serve`, against simulated nodes, next to the same load sent to the nodes directly.

    .venv/bin/python bench/first_figures.py [--seconds 5] [--connections 16] [--nodes 2]

The nodes (`python -m fixtures.node --from-config`) and the gateway (`interlock serve`) run as
subprocesses; the load comes from this process over keep-alive connections, with h11 (cheaper
than an HTTP client library, so the client is not what is measured). All share the machine's
cores, so the rates vary with whatever else runs; the CPU time the gateway process spends per
request and per chunk is the steadier figure for comparing changes.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import h11
import msgspec
import trio

PROJECT_ROOT = Path(__file__).resolve().parent.parent
MODEL = "test-model"
STREAM_TOKENS = 64


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def write_config(folder: Path, nodes: int) -> tuple[Path, int, list[tuple[str, int]]]:
    api_port = free_port()
    node_addresses = [(f"127.0.0.{i + 2}", free_port(f"127.0.0.{i + 2}")) for i in range(nodes)]
    lines = [
        "[gateway]",
        f'listen = "127.0.0.1:{api_port}"',
        f'metrics_listen = "127.0.0.1:{free_port()}"',
        'health_interval = "3s"',
    ]
    for index, (host, port) in enumerate(node_addresses, start=1):
        lines += ["[[nodes]]", f'ip = "{host}"', f'name = "bench-{index}"', f"vllm_port = {port}", f"metrics_port = {free_port(host)}"]
    lines += ["[models]", f'default = "{MODEL}"', "[[models.available]]", f'name = "{MODEL}"']
    path = folder / "bench.toml"
    path.write_text("\n".join(lines) + "\n")
    return path, api_port, node_addresses


class Totals:
    def __init__(self) -> None:
        self.responses = 0
        self.chunks = 0
        self.errors = 0


async def client_loop(host: str, port: int, body: bytes, stream: bool, until: float, totals: Totals) -> None:
    """One keep-alive connection sending the same request until `until`."""
    connection = h11.Connection(h11.CLIENT)
    head = h11.Request(
        method="POST",
        target="/v1/chat/completions",
        headers=[("Host", f"{host}:{port}"), ("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
    )
    async with await trio.open_tcp_stream(host, port) as socket_stream:
        while trio.current_time() < until:
            request = connection.send(head) + connection.send(h11.Data(data=body)) + connection.send(h11.EndOfMessage())
            await socket_stream.send_all(request)
            status = 0
            while True:
                event = connection.next_event()
                if event is h11.NEED_DATA:
                    connection.receive_data(await socket_stream.receive_some(65536))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    if stream:
                        totals.chunks += bytes(event.data).count(b"data: ")
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    raise RuntimeError("server closed the connection")
            if status == 200:
                totals.responses += 1
            else:
                totals.errors += 1
            connection.start_next_cycle()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time used so far by process `pid` (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(
    targets: list[tuple[str, int]], *, stream: bool, seconds: float, connections: int, pid: int
) -> tuple[float, float, int, float]:
    """Responses/s, chunks/s, errors, and the CPU seconds process `pid` used meanwhile."""
    body = msgspec.json.encode(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **({"stream": True} if stream else {"max_tokens": 4})}
    )
    totals = Totals()
    # A short warm-up, then the measured run.
    for duration, record in ((0.5, False), (seconds, True)):
        totals = Totals() if record else totals
        started = trio.current_time()
        cpu_before = cpu_seconds(pid)
        async with trio.open_nursery() as nursery:
            for index in range(connections):
                host, port = targets[index % len(targets)]
                nursery.start_soon(client_loop, host, port, body, stream, started + duration, totals)
        elapsed = trio.current_time() - started
    return totals.responses / elapsed, totals.chunks / elapsed, totals.errors, cpu_seconds(pid) - cpu_before


async def wait_listening(host: str, port: int, timeout: float = 20.0) -> None:
    with trio.fail_after(timeout):
        while True:
            try:
                stream = await trio.open_tcp_stream(host, port)
            except OSError:
                await trio.sleep(0.1)
                continue
            await stream.aclose()
            return


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as folder:
        config_path, api_port, node_addresses = write_config(Path(folder), args.nodes)
        nodes = subprocess.Popen(
            [sys.executable, "-m", "fixtures.node", "--from-config", str(config_path), "--tokens", str(STREAM_TOKENS)],
            cwd=PROJECT_ROOT,
            stdout=subprocess.DEVNULL,
        )
        gateway = subprocess.Popen(
            [sys.executable, "-m", "dataplane.cli", "serve", "--config", str(config_path)],
            cwd=PROJECT_ROOT,
            stdout=subprocess.DEVNULL,
        )
        try:
            for host, port in node_addresses:
                await wait_listening(host, port)
            await wait_listening("127.0.0.1", api_port)
            await trio.sleep(1.0)  # the first health round and model discovery
            through_gateway = [("127.0.0.1", api_port)]
            rows = []
            for label, targets, pid in (("gateway", through_gateway, gateway.pid), ("direct", node_addresses, nodes.pid)):
                load = {"seconds": args.seconds, "connections": args.connections, "pid": pid}
                rps, _, errors, small_cpu = await measure(targets, stream=False, **load)
                _, cps, stream_errors, stream_cpu = await measure(targets, stream=True, **load)
                cpu_per_request = small_cpu / (rps * args.seconds) if rps else float("nan")
                cpu_per_chunk = stream_cpu / (cps * args.seconds) if cps else float("nan")
                rows.append((label, rps, cpu_per_request * 1e6, cps, cpu_per_chunk * 1e6, errors + stream_errors))
        finally:
            for process in (gateway, nodes):
                process.terminate()
                process.wait(timeout=15)
    print(f"{args.nodes} simulated nodes, {args.connections} keep-alive connections, {args.seconds:g} s per figure")
    print("(CPU µs: CPU time of the gateway process, or of the nodes' process for `direct`, per response or chunk)")
    print(f"{'target':<10}{'requests/s':>12}{'CPU µs/req':>12}{'chunks/s':>12}{'CPU µs/chunk':>14}{'errors':>8}")
    for label, rps, request_cpu, cps, chunk_cpu, errors in rows:
        print(f"{label:<10}{rps:>12.0f}{request_cpu:>12.0f}{cps:>12.0f}{chunk_cpu:>14.0f}{errors:>8}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--nodes", type=int, default=2)
    trio.run(main, parser.parse_args())

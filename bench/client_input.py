"""What hostile client input costs a running gateway (issue 9): memory and /metrics after
requests for ever new model names, /health latency during a /metrics scrape, slow-body
connections still open after the body timeouts, upstream requests started by the HTTP/2
rapid-reset attack.

    .venv/bin/python -m bench.client_input [--project DIR] [--names N] [--slow-clients N]

`--project` runs the `interlock serve` of another checkout (e.g. `git worktree add /tmp/main
main`), for a before/after pair; the simulated node is always this checkout's. One JSON line out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h2.config
import h2.connection
import h2.exceptions
import httpx
import trio

PROJECT_ROOT = Path(__file__).resolve().parent.parent
NODE_HOST = "127.0.0.2"
MODEL = "test-model"
CHAT = "/v1/chat/completions"
BODY_TIMEOUT, BODY_IDLE_TIMEOUT = 4.0, 2.0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _start_node() -> tuple[trio.Process, int]:
    argv = [sys.executable, "-m", "fixtures.node", "--host", NODE_HOST, "--base-port", "0", "--models", MODEL]
    process = await trio.lowlevel.open_process(argv, cwd=PROJECT_ROOT, stdout=subprocess.PIPE)
    output = b""
    while b"\n" not in output:
        output += await process.stdout.receive_some()
    vllm_url = output.decode().split()[2]
    return process, int(vllm_url.rpartition(":")[2])


async def _start_gateway(project: Path, folder: Path, node_port: int, *, http2: bool) -> tuple[trio.Process, int, int]:
    port, metrics_port = _free_port(), _free_port()
    config = folder / f"gateway-{int(http2)}.toml"
    config.write_text(
        f'[gateway]\nlisten = "127.0.0.1:{port}"\nmetrics_listen = "127.0.0.1:{metrics_port}"\nhealth_interval = "1s"\n'
        f'request_body_timeout = "{BODY_TIMEOUT}s"\nrequest_body_idle_timeout = "{BODY_IDLE_TIMEOUT}s"\n'
        f"http2 = {str(http2).lower()}\n"
        f'[[nodes]]\nip = "{NODE_HOST}"\nname = "n1"\nvllm_port = {node_port}\nmetrics_port = {node_port}\n'
        f'[[models.available]]\nname = "{MODEL}"\n'
    )
    argv = [sys.executable, "-m", "interlock.cli", "serve", "--config", str(config)]
    env = {**os.environ, "PYTHONPATH": str(project)}
    process = await trio.lowlevel.open_process(argv, cwd=project, env=env, stdout=subprocess.DEVNULL)
    async with httpx.AsyncClient(trust_env=False) as http:
        with trio.fail_after(20):
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    health = (await http.get(f"http://127.0.0.1:{port}/health")).json()
                    if health["models_ok"] == health["nodes"]:
                        break
                await trio.sleep(0.1)
    return process, port, metrics_port


async def _node_completions(http: httpx.AsyncClient, node_port: int) -> int:
    requests = (await http.get(f"http://{NODE_HOST}:{node_port}/_control/requests")).json()
    await http.delete(f"http://{NODE_HOST}:{node_port}/_control/requests")
    return sum(1 for request in requests if request["method"] == "POST" and request["path"].startswith("/v1/"))


async def _unique_names(http: httpx.AsyncClient, url: str, count: int) -> None:
    """`count` requests, each for a model nobody serves, with a 230-byte name of its own."""
    sent = 0

    async def client() -> None:
        nonlocal sent
        while sent < count:
            sent += 1
            name = f"{sent:010d}-" + "n" * 219
            await http.post(url + CHAT, json={"model": name, "messages": []})

    async with trio.open_nursery() as nursery:
        for _ in range(32):
            nursery.start_soon(client)


async def _health_during_scrape(http: httpx.AsyncClient, url: str, metrics_url: str) -> dict:
    """/health latencies (ms) while one /metrics scrape runs, and the page's size."""
    latencies: list[float] = []
    page_bytes = 0
    async with trio.open_nursery() as nursery:
        done = trio.Event()

        async def scrape() -> None:
            nonlocal page_bytes
            page_bytes = len((await http.get(metrics_url + "/metrics", timeout=120)).content)
            done.set()

        nursery.start_soon(scrape)
        await trio.sleep(0.01)
        while not done.is_set():
            started = time.perf_counter()
            await http.get(url + "/health")
            latencies.append((time.perf_counter() - started) * 1000)
    return {
        "metrics_page_bytes": page_bytes,
        "health_during_scrape_ms_median": round(statistics.median(latencies), 2) if latencies else None,
        "health_during_scrape_ms_max": round(max(latencies), 2) if latencies else None,
    }


async def _slow_bodies(port: int, clients: int) -> int:
    """`clients` connections that send a head and then one body byte a second: how many are still
    open 2 s after the body timeout."""
    open_count = 0
    head = f"POST {CHAT} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"

    async def client() -> None:
        nonlocal open_count
        try:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
        except OSError:
            return
        async with stream:
            await stream.send_all(head.encode())
            closed = trio.Event()

            async def read_until_closed() -> None:
                with contextlib.suppress(trio.BrokenResourceError):
                    while await stream.receive_some(65536):
                        pass
                closed.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_until_closed)
                with trio.move_on_after(BODY_TIMEOUT + 2), contextlib.suppress(trio.BrokenResourceError):
                    while not closed.is_set():
                        await stream.send_all(b" ")
                        await trio.sleep(1)
                if not closed.is_set():
                    open_count += 1
                nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(client)
    return open_count


async def rapid_reset(address: str, streams: int) -> list:
    """The rapid-reset attack over one HTTP/2 connection (prior knowledge): `streams` completion
    requests, each reset as soon as it is sent. What the gateway sent back, as h2 events, until
    it closed the connection or went quiet for a second."""
    host, port = address.split(":")
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    body = b'{"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}'
    headers = [
        (":method", "POST"), (":path", CHAT), (":scheme", "http"), (":authority", "gw"),
        ("content-type", "application/json"), ("content-length", str(len(body))),
    ]  # fmt: skip
    received = []
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(connection.data_to_send())
        with contextlib.suppress(trio.BrokenResourceError, h2.exceptions.ProtocolError):
            for index in range(streams):
                stream_id = 1 + 2 * index
                # The server's SETTINGS are not awaited (nor its stream limit respected).
                connection.send_headers(stream_id, headers)
                connection.send_data(stream_id, body, end_stream=True)
                connection.reset_stream(stream_id)
                if index % 100 == 99:
                    await stream.send_all(connection.data_to_send())
            await stream.send_all(connection.data_to_send())
        with contextlib.suppress(trio.BrokenResourceError):
            while True:
                with trio.move_on_after(1):
                    data = await stream.receive_some(65536)
                    if not data:
                        break
                    with contextlib.suppress(h2.exceptions.ProtocolError):
                        received += connection.receive_data(data)
                    continue
                break
    return received


async def run(project: Path, names: int, slow_clients: int, streams: int) -> dict:
    results: dict = {"project": str(project), "names": names, "slow_clients": slow_clients, "reset_streams": streams}
    node, node_port = await _start_node()
    try:
        with tempfile.TemporaryDirectory() as folder:
            async with httpx.AsyncClient(trust_env=False, timeout=30, limits=httpx.Limits(max_connections=64)) as http:
                gateway, port, metrics_port = await _start_gateway(project, Path(folder), node_port, http2=False)
                url, metrics_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}"
                try:
                    rss_before = _rss_mb(gateway.pid)
                    await _unique_names(http, url, names)
                    results["rss_growth_mb"] = round(_rss_mb(gateway.pid) - rss_before, 1)
                    page = (await http.get(metrics_url + "/metrics", timeout=120)).text
                    results["model_series"] = sum(1 for line in page.splitlines() if line.startswith("gateway_requests_total{"))
                    results |= await _health_during_scrape(http, url, metrics_url)
                    results["slow_bodies_open_after_limit"] = await _slow_bodies(port, slow_clients)
                finally:
                    gateway.terminate()
                    await gateway.wait()
                gateway, port, _ = await _start_gateway(project, Path(folder), node_port, http2=True)
                try:
                    await _node_completions(http, node_port)
                    await rapid_reset(f"127.0.0.1:{port}", streams)
                    results["upstream_started_by_resets_http2_on"] = await _node_completions(http, node_port)
                finally:
                    gateway.terminate()
                    await gateway.wait()
    finally:
        node.terminate()
        await node.wait()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", type=Path, default=PROJECT_ROOT, help="the checkout whose gateway runs")
    parser.add_argument("--names", type=int, default=110_000, help="requests with unique model names")
    parser.add_argument("--slow-clients", type=int, default=2000, help="clients sending their body a byte a second")
    parser.add_argument("--streams", type=int, default=5000, help="HTTP/2 streams opened and reset")
    args = parser.parse_args()
    print(json.dumps(trio.run(run, args.project.resolve(), args.names, args.slow_clients, args.streams)))


if __name__ == "__main__":
    main()

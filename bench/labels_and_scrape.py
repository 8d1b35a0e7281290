"""What client input costs the gateway (issue 9, "Client input must not grow memory, logs or
metrics"): memory and /metrics after requests for ever new model names, and API latency while
a large /metrics page is scraped.

    .venv/bin/python bench/labels_and_scrape.py [--tree PATH] [--requests 110000] [--name-bytes 230]
                                              [--padding-series 1000000] [--scrapes 3]

`--tree` is the checkout whose gateway is measured (default: this one), so that an older
commit, exported with `git archive <commit> | tar -x -C DIR`, is measured by the same script:
the gateway runs as `serve` of that tree in a process of its own, in front of one simulated node
(`fixtures.node`, from this checkout), with no event or decision log.

- unique names: RSS of the gateway and the size of its /metrics page (bytes, series) after a
  warm-up, and again after `--requests` requests each naming a new model of `--name-bytes`
  bytes (unknown to the gateway, so each is answered without reaching the node).
- scrape: the gateway's registry gets `--padding-series` more series (about 100 bytes each, so
  a page as large as client input made one before), then /health is asked in a loop on one
  connection, first alone, then while `--scrapes` scrapes of /metrics run back to back:
  p50/p99/max latency of each phase.

Prints one JSON object. Run on a quiet machine; alternate trees in pairs and compare medians.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

THIS_TREE = Path(__file__).resolve().parent.parent
NODE_HOST = "127.0.0.2"
MODEL = "test-model"


# --- the gateway process: `serve` of the tree under test, with padding series ------------------


def serve_main(config: str, padding: int) -> None:
    """Run the tree's `serve` (imported from PYTHONPATH), print its ports as one JSON line once
    it listens, and add `padding` series to its registry."""
    import functools

    import prometheus_client
    import trio
    from prometheus_client.core import GaugeMetricFamily

    from controlplane.logs import JsonLog
    from interlock.serve import serve

    class Padding:
        def describe(self) -> list:
            return []

        def collect(self):
            family = GaugeMetricFamily("bench_padding", "Series that make the page large", labels=["series"])
            for number in range(padding):
                family.add_metric([f"padding-{number:09d}-" + "p" * 48], number)
            yield family

    def ready(listening) -> None:
        if padding:
            listening.control_plane.registry.register(Padding())
        print(json.dumps({"api": listening.api[1], "metrics": listening.metrics[1]}), flush=True)

    prometheus_client.disable_created_metrics()
    with open(os.devnull, "w") as devnull:
        log = JsonLog(devnull)
        sys.exit(trio.run(functools.partial(serve, config, version="bench", ready=ready, log=log)))


# --- the measuring side -------------------------------------------------------------------------


def start_node() -> tuple[subprocess.Popen, int]:
    command = [sys.executable, "-m", "fixtures.node", "--host", NODE_HOST, "--base-port", "0", "--models", MODEL]
    node = subprocess.Popen(command, cwd=THIS_TREE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    # "<name>  vllm http://<host>:<port>  metrics http://<host>:<port>  models <models>"
    line = node.stdout.readline().split()
    return node, int(line[2].rpartition(":")[2])


def start_gateway(tree: Path, folder: Path, node_port: int, padding: int) -> tuple[subprocess.Popen, int, int]:
    config = folder / "gateway.toml"
    config.write_text(
        "\n".join(
            [
                "[gateway]",
                'listen = "127.0.0.1:0"',
                'metrics_listen = "127.0.0.1:0"',
                'health_interval = "1s"',
                "[[nodes]]",
                f'ip = "{NODE_HOST}"',
                'name = "n1"',
                f"vllm_port = {node_port}",
                "metrics_port = 0",
                "[models]",
                "[[models.available]]",
                f'name = "{MODEL}"',
            ]
        )
        + "\n"
    )
    gateway = subprocess.Popen(
        [sys.executable, __file__, "serve", str(config), str(padding)],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    ports = json.loads(gateway.stdout.readline())
    return gateway, ports["api"], ports["metrics"]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


async def _request(client, port: int, method: bytes, target: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """One request on the client's keep-alive connections: the status and the whole body."""
    headers = [(b"content-type", b"application/json")] if body else []
    response = await client.request(method, "127.0.0.1", port, target, headers, body)
    return response.status, await response.read_body()


def send_unique_names(port: int, requests: int, name_bytes: int, connections: int = 16) -> dict[int, int]:
    """`requests` completion requests, each for a new model name; the count of each status."""
    import trio

    from transport.http11 import HttpClient

    statuses: dict[int, int] = {}

    async def connection(client: HttpClient, index: int) -> None:
        for number in range(index, requests, connections):
            name = f"{number:010d}-".ljust(name_bytes, "u")
            body = json.dumps({"model": name, "messages": [{"role": "user", "content": "hi"}]}).encode()
            status, _ = await _request(client, port, b"POST", b"/v1/chat/completions", body)
            statuses[status] = statuses.get(status, 0) + 1

    async def main() -> None:
        async with HttpClient(max_idle_per_host=connections) as client, trio.open_nursery() as nursery:
            for index in range(connections):
                nursery.start_soon(connection, client, index)

    trio.run(main)
    return statuses


def scrape_page(port: int) -> bytes:
    import trio

    from transport.http11 import HttpClient

    async def main() -> bytes:
        async with HttpClient() as client:
            status, body = await _request(client, port, b"GET", b"/metrics")
        assert status == 200, status
        return body

    return trio.run(main)


def page_figures(page: bytes) -> dict[str, int]:
    series = sum(1 for line in page.split(b"\n") if line and not line.startswith(b"#"))
    return {"bytes": len(page), "series": series}


def health_latency_during_scrapes(api_port: int, metrics_port: int, scrapes: int, alone_seconds: float = 3.0) -> dict:
    """/health latency on one connection: alone, then while `scrapes` scrapes run back to back."""
    import trio

    from transport.http11 import HttpClient

    async def main() -> dict:
        phases: dict[str, list[float]] = {"alone": [], "during_scrape": []}
        scrape_times: list[float] = []
        scraping = trio.Event()
        scraped = trio.Event()

        async def scraper(client: HttpClient) -> None:
            await trio.sleep(alone_seconds)
            scraping.set()
            for _ in range(scrapes):
                started = time.perf_counter()
                await _request(client, metrics_port, b"GET", b"/metrics")
                scrape_times.append(time.perf_counter() - started)
            scraped.set()

        async def asker(client: HttpClient) -> None:
            while not scraped.is_set():
                phase = "during_scrape" if scraping.is_set() else "alone"
                started = time.perf_counter()
                status, _ = await _request(client, api_port, b"GET", b"/health")
                assert status == 200, status
                phases[phase].append(time.perf_counter() - started)
                await trio.sleep(0.005)

        async with HttpClient() as client, trio.open_nursery() as nursery:
            nursery.start_soon(asker, client)
            await scraper(client)
        return {
            **{phase: _percentiles(values) for phase, values in phases.items()},
            "scrape_seconds": [round(value, 2) for value in scrape_times],
        }

    return trio.run(main)


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "count": len(ordered),
        "p50_ms": round(statistics.median(ordered) * 1e3, 2),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3, 2),
        "max_ms": round(ordered[-1] * 1e3, 2),
    }


def measure(tree: Path, requests: int, name_bytes: int, padding: int, scrapes: int) -> dict:
    result: dict = {"tree": str(tree), "requests": requests, "name_bytes": name_bytes}
    node, node_port = start_node()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-client-input-") as folder:
            gateway, api, metrics = start_gateway(tree, Path(folder), node_port, 0)
            try:
                time.sleep(1.5)  # the node's model list discovered
                send_unique_names(api, 1000, name_bytes)  # warm-up: every code path run once
                before = {"rss_mb": round(rss_mb(gateway.pid), 1), **page_figures(scrape_page(metrics))}
                started = time.perf_counter()
                statuses = send_unique_names(api, requests, name_bytes)
                seconds = time.perf_counter() - started
                after = {"rss_mb": round(rss_mb(gateway.pid), 1), **page_figures(scrape_page(metrics))}
                result["unique_names"] = {
                    "before": before,
                    "after": after,
                    "rss_growth_mb": round(after["rss_mb"] - before["rss_mb"], 1),
                    "statuses": statuses,
                    "requests_per_second": round(requests / seconds),
                }
            finally:
                stop(gateway)
            if padding:
                gateway, api, metrics = start_gateway(tree, Path(folder), node_port, padding)
                try:
                    time.sleep(1.5)
                    page = page_figures(scrape_page(metrics))
                    result["scrape"] = {"page": page, **health_latency_during_scrapes(api, metrics, scrapes)}
                finally:
                    stop(gateway)
    finally:
        stop(node)
    return result


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the processes started are stopped
    if sys.argv[1:2] == ["serve"]:
        serve_main(sys.argv[2], int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=THIS_TREE, help="the checkout whose gateway is measured")
    parser.add_argument("--requests", type=int, default=110_000)
    parser.add_argument("--name-bytes", type=int, default=230)
    parser.add_argument("--padding-series", type=int, default=1_000_000, help="0: no scrape measurement")
    parser.add_argument("--scrapes", type=int, default=3)
    args = parser.parse_args()
    result = measure(args.tree.resolve(), args.requests, args.name_bytes, args.padding_series, args.scrapes)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

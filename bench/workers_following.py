"""How fast an offline mark made by one worker reaches every worker (`serve --workers N`).

    python -m bench.workers_following [--workers 2] [--rounds 20]

Simulated nodes and the leader run in this process; the workers are real processes. Each round
makes another node refuse connections, sends requests until one of them is refused by it (the
worker that saw it reports `upstream_failed`, stamped with its own clock), and then polls every
worker's `/health` (new connections; each names its worker and the seq it routes on) until each
has applied that event. The figure is the time from the worker's observation to each worker's
first answer at or after that seq: it includes up to one polling interval (about a millisecond
here).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import trio

from controlplane.infrastructure.logs import JsonLog
from events.types import UpstreamFailed
from fixtures.node import NodeSpec, serve_nodes
from interlock.serve import Listening, serve

MODEL = "m"


async def _measure(workers: int, rounds: int) -> list[float]:
    specs = [NodeSpec(name=f"n{i}", host=f"127.0.{90 + i // 200}.{i % 200 + 1}", models=[MODEL]) for i in range(rounds + 1)]
    folder = Path(tempfile.mkdtemp(prefix="interlock-following-"))
    latencies: list[float] = []
    async with serve_nodes(specs) as nodes:
        config = folder / "gateway.toml"
        lines = ['[gateway]', 'listen = "127.0.0.1:0"', 'metrics_listen = "127.0.0.1:0"', 'health_interval = "1h"',
                 f"workers = {workers}"]  # fmt: skip
        for node in nodes:
            lines += ["[[nodes]]", f'ip = "{node.host}"', f"vllm_port = {node.vllm_port}", f"metrics_port = {node.metrics_port}"]
        lines += ["[models]", f'default = "{MODEL}"', "[[models.available]]", f'name = "{MODEL}"']
        config.write_text("\n".join(lines) + "\n")
        listening: list[Listening] = []
        async with trio.open_nursery() as nursery:
            quiet = JsonLog(open(os.devnull, "w"))
            nursery.start_soon(lambda: serve(str(config), version="bench", ready=listening.append, log=quiet))
            while not listening:
                await trio.sleep(0.01)
            ready = listening[0]
            url = f"http://127.0.0.1:{ready.api[1]}"
            applied: dict[int, float] = {}
            ready.control_plane.applier.add_listener(
                lambda event, state, step: applied.__setitem__(state.seq, event.at)
                if isinstance(event, UpstreamFailed)
                else None
            )
            async with httpx.AsyncClient(timeout=10, trust_env=False) as http:
                await _seen_by_all(http, url, workers, 0)
                for dying in nodes[:rounds]:
                    dying.behaviour.refuse = True
                    applied.clear()
                    while not applied:
                        await http.post(url + "/v1/chat/completions", json={"messages": []}, headers={"Connection": "close"})
                        await trio.sleep(0.001)
                    [(seq, observed_at)] = applied.items()
                    seen = await _seen_by_all(http, url, workers, seq)
                    latencies.extend(at - observed_at for at in seen.values())
            nursery.cancel_scope.cancel()
    return latencies


async def _seen_by_all(http: httpx.AsyncClient, url: str, workers: int, seq: int) -> dict[int, float]:
    """When each worker was first seen answering at or after `seq`."""
    seen: dict[int, float] = {}
    with trio.fail_after(30):
        while len(seen) < workers:
            response = await http.get(url + "/health", headers={"Connection": "close"})
            worker = int(response.headers["x-interlock-worker"])
            if worker not in seen and int(response.headers["x-interlock-seq"]) >= seq:
                seen[worker] = time.time()
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    latencies = sorted(trio.run(_measure, args.workers, args.rounds))
    ms = [latency * 1000 for latency in latencies]
    print(
        f"offline mark seen by every worker ({args.workers} workers, {args.rounds} rounds, {len(ms)} samples): "
        f"median {statistics.median(ms):.1f} ms, p90 {ms[int(len(ms) * 0.9) - 1]:.1f} ms, max {ms[-1]:.1f} ms"
    )


if __name__ == "__main__":
    main()

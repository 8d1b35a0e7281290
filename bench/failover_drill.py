"""Failover drill: one node SIGKILLed under load, tried as an operator would.

    python -m bench.failover_drill [--nodes 3] [--clients 8] [--duration 20] [--kill-at 5]
        [--ttft 0.05] [--tpot 0.01] [--tokens 8] [--settings off,on]

For each setting of `gateway.retry_unanswered` in turn: starts `--nodes` simulated nodes, each a
process of its own (`python -m fixtures.node` on 127.0.0.2, 127.0.0.3, …), and `interlock serve`
in front of them; keeps `--clients` clients sending non-streaming chat completions one after the
other for `--duration` seconds; SIGKILLs the first node `--kill-at` seconds in; and counts the
requests that failed (any answer but 200, or none). The gateway's decision log then says how
many requests were retried away from the killed node. Prints one line per setting, then the
figures as one JSON object.

Every process runs in its own process group and is stopped at the end, also on Ctrl-C or an
error. It takes about `--duration` seconds plus a few per setting.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import trio

from bench.processes import Processes
from bench.servers import start_gateway, start_simulated_nodes
from events.decisions import AttemptOutcome, read_decisions

MODEL = "drill-model"


async def load(url: str, clients: int, duration: float, kill_at: float, kill) -> tuple[int, Counter, float]:
    """`clients` clients asking one completion after the other until `duration` is up, `kill()`
    called at `kill_at`: (requests answered or failed, failures by kind, requests per second)."""
    body = {"messages": [{"role": "user", "content": "Say hello."}]}
    failures: Counter[str] = Counter()
    done = 0
    started = trio.current_time()
    deadline = started + duration

    async def client() -> None:
        nonlocal done
        async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
            while trio.current_time() < deadline:
                try:
                    response = await http.post(url, json=body)
                    if response.status_code != 200:
                        failures[f"status {response.status_code}"] += 1
                except httpx.HTTPError as error:
                    failures[type(error).__name__] += 1
                done += 1

    async def killer() -> None:
        await trio.sleep_until(started + kill_at)
        kill()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(killer)
        for _ in range(clients):
            nursery.start_soon(client)
    return done, failures, done / (trio.current_time() - started)


def run_setting(args: argparse.Namespace, retry_unanswered: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="failover-drill-") as temporary, Processes(Path(temporary)) as processes:
        folder = Path(temporary)
        nodes = start_simulated_nodes(processes, args.nodes, MODEL, ttft=args.ttft, tpot=args.tpot, tokens=args.tokens)
        settings = {
            "health_interval": "1s",
            "decision_log": str(folder / "decisions.jsonl"),
            "retry_unanswered": retry_unanswered,
        }
        gateway = start_gateway(processes, folder, nodes, MODEL, gateway=settings)
        killed = nodes[0]
        url = gateway.url
        requests, failures, rate = trio.run(
            load, url, args.clients, args.duration, args.kill_at, lambda: os.killpg(killed.process.pid, signal.SIGKILL)
        )
        processes.stop(gateway.process)  # SIGTERM: the decision log is written out
        decisions = list(read_decisions(folder / "decisions.jsonl"))
    retried_away = sum(
        1
        for decision in decisions
        if any(attempt.node == killed.host and attempt.outcome == AttemptOutcome.RETRIED for attempt in decision.attempts)
        and decision.status == 200
    )
    return {
        "retry_unanswered": retry_unanswered,
        "requests": requests,
        "failed": sum(failures.values()),
        "failures": dict(failures),
        "retried_away_from_killed_node": retried_away,
        "requests_per_second": round(rate, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.failover_drill", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--nodes", type=int, default=3)
    add("--clients", type=int, default=8)
    add("--duration", type=float, default=20.0, help="seconds of load per setting (default: 20)")
    add("--kill-at", type=float, default=5.0, help="seconds into the load when the first node is killed")
    add("--ttft", type=float, default=0.05, help="the nodes' seconds to the first token (default: 0.05)")
    add("--tpot", type=float, default=0.01, help="the nodes' seconds between tokens (default: 0.01)")
    add("--tokens", type=int, default=8)
    add("--settings", default="off,on", help="retry_unanswered settings to run, in order (default: off,on)")
    args = parser.parse_args(argv)
    if args.nodes < 2 or not 0 < args.kill_at < args.duration:
        parser.error("needs at least 2 nodes and 0 < --kill-at < --duration")
    results = []
    for setting in args.settings.split(","):
        if setting not in ("off", "on"):
            parser.error(f"--settings: off or on, not {setting!r}")
        result = run_setting(args, setting == "on")
        results.append(result)
        print(
            f"retry_unanswered={setting:3}  {result['failed']} of {result['requests']} requests failed"
            f" {result['failures'] or ''}; {result['retried_away_from_killed_node']} retried away from the"
            f" killed node; {result['requests_per_second']} requests/s",
            flush=True,
        )
    print(json.dumps({"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "args": vars(args), "runs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The gateway's own CPU cost of a prefill/decode-disaggregated request (two legs) against a
whole-node one, side by side in one run.

    python -m bench.disaggregated [--requests 1500] [--concurrency 8] [--rounds 2] [--out DIR]

Each round starts, for each setting in turn, two simulated nodes (`python -m fixtures.node`)
and `interlock serve` in front of them: `whole` (both nodes `role = "both"`: one attempt per
request) and `two legs` (one `prefill` node, one `decode` node). It sends `--requests` small
chat completions from `--concurrency` clients, non-streamed and then streamed (8 tokens), after
a warm-up, and reads the gateway's CPU time (user + system, from /proc) around each batch. The
settings alternate within a round, so that the machine's other load falls on both alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import httpx
import trio

from bench.processes import Processes, cpu_seconds
from bench.report import busy_note, load_average, machine_details, utc_now, write_results
from bench.servers import start_gateway, start_simulated_nodes
from bench.upstream import MODEL

SETTINGS = {"whole": ("both", "both"), "two legs": ("prefill", "decode")}
WARM_UP = 100
TOKENS = 8


async def send(url: str, count: int, concurrency: int, stream: bool) -> int:
    """`count` chat completions from `concurrency` clients; how many were not answered 200."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    failures = 0
    left = count

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal left, failures
        while left > 0:
            left -= 1
            response = await http.post(url, json=body)
            failures += response.status_code != 200

    limits = httpx.Limits(max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(trust_env=False, timeout=30, limits=limits) as http, trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(client, http)
    return failures


def measure(setting: str, args: argparse.Namespace, logs: Path, processes: Processes) -> dict:
    """One setting's gateway CPU per request, non-streamed and streamed."""
    folder = logs / setting.replace(" ", "-")
    folder.mkdir(parents=True, exist_ok=True)
    roles = SETTINGS[setting]
    nodes = start_simulated_nodes(processes, 2, MODEL, ttft=0.0, tpot=0.0, tokens=TOKENS, roles=roles)
    try:
        settings = {"health_interval": "1s", "event_log": str(folder / "events.jsonl")}
        gateway = start_gateway(processes, folder, nodes, MODEL, gateway=settings, roles=roles)
        try:
            row: dict = {"setting": setting}
            for stream in (False, True):
                trio.run(send, gateway.url, WARM_UP, args.concurrency, stream)
                before = cpu_seconds(gateway.pids())
                failures = trio.run(send, gateway.url, args.requests, args.concurrency, stream)
                spent = cpu_seconds(gateway.pids()) - before
                key = "streamed" if stream else "whole_answer"
                row[key] = {"cpu_us_per_request": spent / args.requests * 1e6, "failures": failures}
        finally:
            processes.stop(gateway.process)
    finally:
        for node in nodes:
            processes.stop(node.process)
    return row


def render(rows: list[dict]) -> str:
    lines = ["Gateway CPU per chat completion (us), median of the rounds", f"  {'setting':<12}{'non-streamed':>16}{'streamed':>12}"]
    for setting in SETTINGS:
        mine = [row for row in rows if row["setting"] == setting]
        cells = [statistics.median(row[key]["cpu_us_per_request"] for row in mine) for key in ("whole_answer", "streamed")]
        lines.append(f"  {setting:<12}{cells[0]:>16.0f}{cells[1]:>12.0f}")
    failures = sum(row[key]["failures"] for row in rows for key in ("whole_answer", "streamed"))
    lines.append(f"  requests not answered 200: {failures}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.disaggregated", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--requests", type=int, default=1500, help="measured requests per setting and mode (default: 1500)")
    add("--concurrency", type=int, default=8, help="clients at once (default: 8)")
    add("--rounds", type=int, default=2, help="rounds, each running every setting (default: 2)")
    add("--out", type=Path, help="results folder (default: bench/results)")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.rounds < 1:
        parser.error("--requests, --concurrency and --rounds must be at least 1")
    logs = Path(tempfile.mkdtemp(prefix="interlock-disaggregated-"))
    results: dict = {"command": "python -m bench.disaggregated " + " ".join(sys.argv[1:] if argv is None else argv)}
    results |= {"started_at": utc_now(), "machine": machine_details(None, None), "settings": vars(args) | {"tokens": TOKENS}}
    results["settings"].pop("out")
    results["notes"] = [note for note in [busy_note(results["machine"]["load_average_at_start"])] if note]
    rows = []
    with Processes(logs) as processes:
        for _ in range(args.rounds):
            for setting in SETTINGS:
                rows.append(measure(setting, args, logs, processes))
    results |= {"rows": rows, "load_average_at_end": load_average(), "finished_at": utc_now()}
    print(render(rows))
    path = write_results(results, **({"folder": args.out} if args.out else {}), kind="disaggregated")
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

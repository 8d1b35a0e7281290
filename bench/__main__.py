"""Interlock's benchmark: what it costs per request and per streamed chunk, side by side with
references measured in the same run on the same machine.

    python -m bench [--duration 10] [--quick] [--rows direct,floor,asgi-floor,nginx,interlock,interlock-x2]
                    [--sections requests,sse,paced,replay,control-plane] [--out bench/results]

Run it from the checkout with the project's virtualenv (`.venv/bin/python -m bench`) on a quiet
machine: it takes about ten minutes (`--quick`: about three). It installs nothing. The load
rows need `wrk` and the nginx row needs `nginx` (Debian: `apt-get install -y wrk nginx`); when
one is missing it says so and skips what needs it.

Rows, each measured in turn against the same upstream (`bench/upstream.py`, a canned
OpenAI-compatible server built to be much faster than anything in front of it):

- direct:    the load straight to the upstream (it must do >= 5x interlock's requests/s);
- floor:     a bare quart-trio app on hypercorn answering with the same canned bytes;
- asgi-floor: a plain ASGI app (no Quart) on hypercorn answering the same: the stack's own floor
             on the completion path, which Interlock answers in plain ASGI too;
- nginx:     nginx as a plain reverse proxy to the upstream;
- interlock: `interlock serve` with one node (the upstream), probes every second, metrics and
             the event log on.
- interlock-x2: `interlock serve --workers 2`, the same gateway with a leader and two worker
             processes. It runs on every core, and so shares the load's core with wrk (or the
             stream client) and the upstream: its CPU per request counts only its own processes
             (leader and workers), and its requests/s are what it reaches with the load
             generator taking its share of that core.

For each row: small non-streaming POSTs (wrk: requests/s, p50/p99 latency, the server's CPU per
request from /proc, its peak RSS), unpaced 64-chunk SSE responses (CPU per relayed chunk), and
paced streams of 50 chunks/s at rising concurrency (`bench/stream_client.py`: p99 added
inter-chunk delay, CPU per relayed chunk). Then replay speed over a generated event log
(1,000,000 events; `--quick`: 100,000), and the control plane alone with 100 and 1,000
simulated nodes probed every second (CPU % of one core, RSS). With two or more cores, the
process under test runs on the first core and the load (wrk, the stream client, the upstream
behind a proxy, the simulated nodes) on the others.

Prints one table, with PASS/MISS against the targets of issue 5, and writes the same figures
with the machine's details to `bench/results/<UTC timestamp>.json`. Every process it starts runs
in its own process group and is stopped at the end, also on Ctrl-C or an error.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from bench.control_plane_load import measure_control_plane
from bench.processes import CorePlan, Processes, cpu_seconds, peak_rss_bytes, pin, plan_cores
from bench.replay_speed import generate_log
from bench.report import (
    RESULTS_FOLDER,
    busy_note,
    ROWS,
    command_line,
    evaluate_targets,
    load_average,
    machine_details,
    paced_streams_held,
    render,
    utc_now,
    write_results,
)
from bench.servers import PROJECT_ROOT, Server, nginx_path, start_floor, start_interlock, start_nginx, start_upstream
from bench.upstream import MODEL, STREAM_CHUNKS
from bench.wrk import run_wrk, wrk_path
from controlplane.effects.replay import replay

SECTIONS = ("requests", "sse", "paced", "replay", "control-plane")
PACED_CONCURRENCY = (8, 16, 32, 64, 128, 256)
PACED_INTERVAL = 0.02
PACED_CHUNKS = 100
"""Two-second streams: long enough that the request itself is a small part of a stream's cost."""
CONNECTIONS = 16
REPLAY_EVENTS = 1_000_000
QUICK_REPLAY_EVENTS = 100_000
CONTROL_PLANE_NODES = (100, 1000)
CONTROL_PLANE_SECONDS = 20.0

SMALL_REQUEST = msgspec.json.encode({"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16})
SSE_REQUEST = msgspec.json.encode({"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "stream": True})


def main() -> None:
    args = _parse_args()
    cores = plan_cores()
    wrk, nginx = wrk_path(), nginx_path()
    machine = machine_details(wrk, nginx)
    if cores.load is not None:
        os.sched_setaffinity(0, cores.load)  # this process and what it starts stay off the server's core
    notes = _missing_tools(wrk, nginx, args)
    busy = busy_note(machine["load_average_at_start"])
    if busy:
        notes.append(busy)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    results = {
        "command": command_line(),
        "started_at": utc_now(),
        "machine": machine,
        "settings": {
            "cores": cores.describe(),
            "duration": args.duration,
            "warm_up": args.warm_up,
            "connections": CONNECTIONS,
            "sse_chunks": STREAM_CHUNKS,
            "paced_concurrency": args.concurrency,
            "paced_interval": PACED_INTERVAL,
            "paced_chunks": PACED_CHUNKS,
            "replay_events": args.replay_events,
            "control_plane_seconds": args.control_plane_seconds,
            "rows": args.rows,
            "sections": args.sections,
        },
        "notes": notes,
        "rows": {},
    }
    with tempfile.TemporaryDirectory(prefix="interlock-bench-") as folder_name:
        folder = Path(folder_name)
        (folder / "logs").mkdir()
        with Processes(folder / "logs") as processes:
            _run(args, results, processes, folder, cores, wrk=wrk, nginx=nginx)
        leftovers = processes.leftovers()
    if leftovers:
        results["notes"].append(f"processes still running after the run: {leftovers}")
    results["load_average_at_end"] = load_average()
    results["finished_at"] = utc_now()
    interlock = results["rows"].get("interlock", {}).get("requests")
    direct = results["rows"].get("direct", {}).get("requests")
    if interlock and direct:
        results["upstream_headroom"] = direct["requests_per_second"] / interlock["requests_per_second"]
    results["targets"] = evaluate_targets(results)
    print(render(results))
    path = write_results(results, args.out)
    print(f"\nwritten to {path}")


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, help="measured seconds per load point (default 10; --quick 3)")
    parser.add_argument("--warm-up", type=float, help="unmeasured seconds before each load point (default 2; --quick 1)")
    parser.add_argument("--quick", action="store_true", help="shorter load points, 100,000 replay events, 8 s control-plane runs")
    parser.add_argument("--rows", type=_choices(ROWS), default=list(ROWS), help="comma-separated (default: all)")
    parser.add_argument("--sections", type=_choices(SECTIONS), default=list(SECTIONS), help="comma-separated (default: all)")
    parser.add_argument(
        "--concurrency", type=_numbers, default=list(PACED_CONCURRENCY), help="paced stream levels (default 8,16,32,64,128,256)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS_FOLDER, help="folder for the JSON result (default bench/results)")
    args = parser.parse_args()
    args.duration = args.duration or (3.0 if args.quick else 10.0)
    args.warm_up = args.warm_up if args.warm_up is not None else (1.0 if args.quick else 2.0)
    args.replay_events = QUICK_REPLAY_EVENTS if args.quick else REPLAY_EVENTS
    args.control_plane_seconds = 8.0 if args.quick else CONTROL_PLANE_SECONDS
    return args


def _choices(known: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        chosen = [item.strip() for item in text.split(",") if item.strip()]
        unknown = [item for item in chosen if item not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown: {', '.join(unknown)} (known: {', '.join(known)})")
        return [item for item in known if item in chosen]

    return parse


def _numbers(text: str) -> list[int]:
    try:
        return sorted(int(item) for item in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError("a comma-separated list of integers") from None


def _missing_tools(wrk: str | None, nginx: str | None, args: argparse.Namespace) -> list[str]:
    notes = []
    if wrk is None and {"requests", "sse"} & set(args.sections):
        notes.append("wrk not found: the non-streaming and SSE sections are skipped (Debian: apt-get install -y wrk)")
    if nginx is None and "nginx" in args.rows:
        notes.append("nginx not found: the nginx row is skipped (Debian: apt-get install -y nginx)")
    return notes


# --- the run -------------------------------------------------------------------------------------


def _run(
    args: argparse.Namespace, results: dict, processes: Processes, folder: Path, cores: CorePlan, *, wrk, nginx
) -> None:
    """Every section, each server started and stopped in turn."""
    if {"requests", "sse", "paced"} & set(args.sections):
        upstream = start_upstream(processes, cores.load)
        for name in args.rows:
            if name == "nginx" and nginx is None:
                continue
            print(f"measuring {name} ...", file=sys.stderr, flush=True)
            row: dict = {}
            results["rows"][name] = row
            server = None
            try:
                pin(upstream.process.pid, cores.server if name == "direct" else cores.load)
                server = _start_row(name, processes, folder, cores, upstream)
                _measure_row(row, server, args, folder, cores, use_wrk=wrk is not None)
            except (RuntimeError, OSError, subprocess.SubprocessError, ValueError) as error:
                log = processes.log_tail("upstream" if name == "direct" else name)
                row["error"] = f"{error}\n{log}".strip()
                print(f"  {name} failed: {row['error']}", file=sys.stderr)
            finally:
                if server is not None and server is not upstream:
                    processes.stop(server.process)
        processes.stop(upstream.process)
    if "replay" in args.sections:
        print("measuring replay ...", file=sys.stderr, flush=True)
        results["replay"] = _measure_replay(folder, args.replay_events)
    if "control-plane" in args.sections:
        results["control_plane"] = []
        for nodes in CONTROL_PLANE_NODES:
            print(f"measuring the control plane with {nodes} nodes ...", file=sys.stderr, flush=True)
            try:
                figures = measure_control_plane(processes, folder, nodes=nodes, seconds=args.control_plane_seconds, cores=cores)
            except (RuntimeError, OSError, ValueError) as error:
                figures = {"nodes": nodes, "error": str(error)}
            results["control_plane"].append(figures)


def _start_row(name: str, processes: Processes, folder: Path, cores: CorePlan, upstream: Server) -> Server:
    if name == "direct":
        return upstream
    if name == "floor":
        return start_floor(processes, cores.server)
    if name == "asgi-floor":
        return start_floor(processes, cores.server, bare=True)
    if name == "nginx":
        return start_nginx(processes, folder, cores.server, upstream)
    if name == "interlock-x2":
        return start_interlock(processes, folder, cores.every, upstream, workers=2)
    return start_interlock(processes, folder, cores.server, upstream)


def _measure_row(row: dict, server: Server, args: argparse.Namespace, folder: Path, cores: CorePlan, *, use_wrk: bool) -> None:
    if use_wrk and "requests" in args.sections:
        measured = _wrk_point(server, SMALL_REQUEST, args, folder, cores)
        measured["cpu_per_request_us"] = measured.pop("cpu_seconds") / max(1, measured["requests"]) * 1e6
        row["requests"] = measured
    if use_wrk and "sse" in args.sections:
        measured = _wrk_point(server, SSE_REQUEST, args, folder, cores)
        chunks = measured["requests"] * STREAM_CHUNKS
        measured["responses_per_second"] = measured.pop("requests_per_second")
        measured["chunks_per_second"] = chunks / measured["seconds"]
        measured["cpu_per_chunk_us"] = measured.pop("cpu_seconds") / max(1, chunks) * 1e6
        row["sse"] = measured
    if "paced" in args.sections:
        row["paced"] = []
        for concurrency in args.concurrency:
            row["paced"].append(_paced_point(server, concurrency, args, cores))
            if paced_streams_held(row["paced"]) < concurrency:
                break  # past the limit: higher levels only say "worse"
    row["peak_rss_bytes"] = peak_rss_bytes(server.pids())


def _wrk_point(server: Server, body: bytes, args: argparse.Namespace, folder: Path, cores: CorePlan) -> dict:
    """A warm-up run, then the measured one, with the server's CPU time read around it."""
    run_wrk(server.url, body, connections=CONNECTIONS, seconds=args.warm_up, cores=cores.load, folder=folder)
    pids = server.pids()
    cpu_before = cpu_seconds(pids)
    result = run_wrk(server.url, body, connections=CONNECTIONS, seconds=args.duration, cores=cores.load, folder=folder)
    cpu = cpu_seconds(pids) - cpu_before
    return {
        "requests": result.requests,
        "seconds": result.seconds,
        "requests_per_second": result.requests_per_second,
        "p50_ms": result.p50_ms,
        "p99_ms": result.p99_ms,
        "errors": result.errors,
        "cpu_seconds": cpu,
    }


def _paced_point(server: Server, concurrency: int, args: argparse.Namespace, cores: CorePlan) -> dict:
    argv = [
        sys.executable, "-m", "bench.stream_client", server.url,
        "--concurrency", str(concurrency), "--duration", str(args.duration), "--warm-up", str(args.warm_up),
        "--chunks", str(PACED_CHUNKS), "--interval", str(PACED_INTERVAL),
    ]
    for pid in server.pids():
        argv += ["--pid", str(pid)]
    completed = subprocess.run(
        argv,
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=args.duration + args.warm_up + 60,
        preexec_fn=None if cores.load is None else lambda: os.sched_setaffinity(0, cores.load),
    )
    if completed.returncode != 0:
        raise RuntimeError(f"stream client failed: {completed.stderr.strip()[-2000:]}")
    return msgspec.json.decode(completed.stdout)


def _measure_replay(folder: Path, events: int) -> dict:
    """Replay speed over a generated log (bench.replay_speed's generator): median of 3 runs."""
    log_path = folder / "replay" / "events.jsonl"
    log_path.parent.mkdir()
    generate_log(log_path, events, node_count=10)
    timings = []
    for _ in range(3):
        started = time.perf_counter()
        result = replay([log_path])
        timings.append(time.perf_counter() - started)
    median = statistics.median(timings)
    return {"events": result.event_count, "seconds": timings, "median_seconds": median, "events_per_second": result.event_count / median}


if __name__ == "__main__":
    main()

"""The HTTP/1.1 client of this checkout against an older one's, side by side on this machine.

    python -m bench.http11_compare [--base main] [--rounds 7] [--sections parser,client,gateway]
                                   [--duration 5]

"old" is `transport/http11.py` as it is at `--base` (read with `git show`), "new" is this
checkout's, each loaded the same way as a module of its own (importing the rest of `transport/`
from this checkout). A variant whose `http11.py` has no `parse_head` of its own is measured with
this checkout's parser (`transport/parser.py`): against a base from before the parser had a
module of its own, the parser section compares the two parsers. Each section measures them in alternating pairs (old then
new, new then old, …), so that a machine that gets busier or quieter meanwhile weighs on both,
and prints each one's median, the ratio of the medians and the median of the pairs' ratios.

- parser:  `parse_head` alone on a typical node's response head: CPU ns per head.
- client:  the client alone, in this process, against the benchmark's upstream (`bench.upstream`,
           in a process of its own): CPU per small POST (status, headers, a JSON body read
           whole), and per SSE chunk relayed (64-chunk streams read chunk by chunk).
- gateway: `interlock serve` from `--base` (a `git archive` of it: the proxy as it was too)
           against this checkout's, under wrk as `python -m bench` measures it: the gateway's CPU
           per request and per relayed SSE chunk (needs wrk).

With two cores or more, what is measured runs on the first core and the load on the others.
The machine's load average is printed: figures taken on a busy machine are noisy.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import timeit
import types
from collections.abc import Callable
from io import BytesIO
from pathlib import Path

import trio

from bench.__main__ import SMALL_REQUEST, SSE_REQUEST
from bench.processes import Processes, cpu_seconds, pin, plan_cores
from bench.report import load_average
from bench.servers import COMPLETIONS_PATH, HOST, PROJECT_ROOT, start_interlock, start_upstream
from bench.upstream import STREAM_CHUNKS
from bench.wrk import run_wrk, wrk_path
from transport import parser

SECTIONS = ("parser", "client", "gateway")
TRANSPORT = "transport/http11.py"
HEAD = (
    b"HTTP/1.1 200 OK\r\ndate: Thu, 03 Dec 2026 06:00:00 GMT\r\nserver: uvicorn\r\ncontent-length: 412\r\n"
    b"content-type: application/json\r\nx-request-id: 5f0c6d1e8a7b4c3d9e2f1a0b6c5d4e3f"
)
"""A vLLM node's response head (uvicorn's headers), without its final CRLF CRLF."""
CLIENT_REQUESTS = 4000
CLIENT_STREAMS = 200
WRK_CONNECTIONS = 16


def main() -> None:
    args = _parse_args()
    old_source = subprocess.run(
        ["git", "show", f"{args.base}:{TRANSPORT}"], cwd=PROJECT_ROOT, capture_output=True, check=True
    ).stdout
    variants = {
        "old": load_module(old_source, f"{args.base}:{TRANSPORT}", "http11_old"),
        "new": load_module((PROJECT_ROOT / TRANSPORT).read_bytes(), str(PROJECT_ROOT / TRANSPORT), "http11_new"),
    }
    cores = plan_cores()
    print(f"old: transport/http11.py at {args.base}; new: this checkout ({PROJECT_ROOT})")
    print(f"load average at start: {load_average()}; cores: {cores.describe()}")
    if cores.server is not None:
        os.sched_setaffinity(0, cores.server)
    if "parser" in args.sections:
        report("parse_head, ns per head", alternate(args.rounds, {k: parser_cost(m) for k, m in variants.items()}))
    with tempfile.TemporaryDirectory(prefix="http11-compare-") as folder_name:
        folder = Path(folder_name)
        (folder / "logs").mkdir()
        with Processes(folder / "logs") as processes:
            upstream = start_upstream(processes, cores.load)
            if "client" in args.sections:
                per_request = {k: client_cost(m, upstream.port, streams=False) for k, m in variants.items()}
                report("client, CPU us per request", alternate(args.rounds, per_request))
                per_chunk = {k: client_cost(m, upstream.port, streams=True) for k, m in variants.items()}
                report("client, CPU us per SSE chunk", alternate(args.rounds, per_chunk))
            if "gateway" in args.sections:
                if wrk_path() is None:
                    print("wrk not found: the gateway section is skipped (Debian: apt-get install -y wrk)")
                else:
                    old_tree = archive(args.base, folder / "base")
                    gateway_costs(args, processes, folder, cores, upstream, {"old": old_tree, "new": PROJECT_ROOT})
    print(f"load average at end: {load_average()}")


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.http11_compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="main", help="the git revision of the old version (default main)")
    parser.add_argument("--rounds", type=int, default=7, help="pairs measured per figure (default 7)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of wrk load per gateway point (default 5)")
    parser.add_argument(
        "--sections",
        type=lambda text: [item for item in text.split(",") if item],
        default=list(SECTIONS),
        help="comma-separated, of parser, client, gateway (default: all)",
    )
    args = parser.parse_args()
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    return args


def load_module(source: bytes, origin: str, name: str) -> types.ModuleType:
    """`source` as a module of its own, `name` (it may import only `transport`)."""
    module = types.ModuleType(name)
    module.__file__ = origin
    sys.modules[name] = module
    exec(compile(source, origin, "exec"), module.__dict__)  # noqa: S102 (our own file, at some revision)
    return module


def archive(revision: str, folder: Path) -> Path:
    """The source tree at `revision`, extracted into `folder`."""
    data = subprocess.run(["git", "archive", revision], cwd=PROJECT_ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(folder, filter="data")
    return folder


# --- measuring in alternating pairs ------------------------------------------------------------


def alternate(rounds: int, measures: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
    """Each measure once per round, old and new in turn, the one that goes first alternating."""
    figures: dict[str, list[float]] = {name: [] for name in measures}
    names = list(measures)
    for round_number in range(rounds):
        for name in names if round_number % 2 == 0 else reversed(names):
            gc.collect()  # neither inherits the other's garbage
            figures[name].append(measures[name]())
    return figures


def report(title: str, figures: dict[str, list[float]]) -> None:
    old, new = figures["old"], figures["new"]
    pair_ratios = [b / a for a, b in zip(old, new, strict=True)]
    print(f"\n{title}")
    for name, values in figures.items():
        print(f"  {name}: median {statistics.median(values):9.3f}   ({', '.join(f'{v:.3f}' for v in values)})")
    print(
        f"  new/old: ratio of medians {statistics.median(new) / statistics.median(old):.3f}, "
        f"median of pair ratios {statistics.median(pair_ratios):.3f}"
    )


# --- the sections --------------------------------------------------------------------------------


def parser_cost(module: types.ModuleType) -> Callable[[], float]:
    def measure() -> float:
        count = 20000
        # CPU time of this thread: a busy machine that takes the core away meanwhile does not count.
        parse_head = getattr(module, "parse_head", parser.parse_head)
        runs = timeit.repeat(lambda: parse_head(HEAD), number=count, repeat=3, timer=time.thread_time)
        return min(runs) / count * 1e9

    return measure


def client_cost(module: types.ModuleType, port: int, *, streams: bool) -> Callable[[], float]:
    """CPU µs per request (small POSTs) or per SSE chunk (64-chunk streams) of `module`'s client."""

    async def run() -> float:
        async with module.HttpClient() as client:
            body = SSE_REQUEST if streams else SMALL_REQUEST
            count = CLIENT_STREAMS if streams else CLIENT_REQUESTS
            headers = [(b"content-type", b"application/json")]
            for _ in range(20):  # warm-up: a connection in the pool, the code paths taken
                await (await client.request(b"POST", HOST, port, COMPLETIONS_PATH.encode(), headers, body)).read_body()
            started = time.process_time()
            for _ in range(count):
                response = await client.request(b"POST", HOST, port, COMPLETIONS_PATH.encode(), headers, body)
                async for _chunk in response:
                    pass
            used = time.process_time() - started
        return used / (count * STREAM_CHUNKS if streams else count) * 1e6

    return lambda: trio.run(run)


def gateway_costs(args, processes: Processes, folder: Path, cores, upstream, trees: dict[str, Path]) -> None:
    """The gateway's CPU per request and per relayed chunk, `interlock serve` from each tree in turn."""
    per_request: dict[str, list[float]] = {name: [] for name in trees}
    per_chunk: dict[str, list[float]] = {name: [] for name in trees}
    names = list(trees)
    for round_number in range(args.rounds):
        for name in names if round_number % 2 == 0 else reversed(names):
            server = start_interlock(
                processes, folder, cores.server, upstream, root=trees[name], name=f"interlock-{name}"
            )
            try:
                pin(upstream.process.pid, cores.load)
                requests, cpu = _wrk_cpu(server, SMALL_REQUEST, args.duration, folder, cores)
                per_request[name].append(cpu / requests * 1e6)
                requests, cpu = _wrk_cpu(server, SSE_REQUEST, args.duration, folder, cores)
                per_chunk[name].append(cpu / (requests * STREAM_CHUNKS) * 1e6)
            finally:
                processes.stop(server.process)
    report("gateway (interlock serve under wrk), CPU us per request", per_request)
    report("gateway (interlock serve under wrk), CPU us per SSE chunk", per_chunk)


def _wrk_cpu(server, body: bytes, seconds: float, folder: Path, cores) -> tuple[int, float]:
    """(responses, the server's CPU seconds) of a wrk run after a one-second warm-up."""
    run_wrk(server.url, body, connections=WRK_CONNECTIONS, seconds=1.0, cores=cores.load, folder=folder)
    pids = server.pids()
    before = cpu_seconds(pids)
    result = run_wrk(server.url, body, connections=WRK_CONNECTIONS, seconds=seconds, cores=cores.load, folder=folder)
    if result.errors:
        raise RuntimeError(f"{server.name}: {result.errors} errors under wrk")
    return result.requests, cpu_seconds(pids) - before


if __name__ == "__main__":
    main()

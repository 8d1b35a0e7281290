"""Python function calls per small request and per paced SSE chunk in the gateway's process: a
measure of the hot path that a loaded machine does not blur, to compare two checkouts.

    python -m bench.call_count [--tree DIR] [--requests 2000] [--streams 8] [--chunks 100]
                               [--interval 0.02] [--top 25] [--cpu] [--out FILE]

Starts the bench upstream (`bench.upstream`) and `interlock serve` from the source tree `DIR`
(default: this checkout; another checkout's, such as a base commit's `git worktree`, to compare),
its one process under cProfile switched on and off by signals, only while the load runs. Then,
one after the other: `--requests` small chat completions over one keep-alive connection, one at
a time; and `--streams` concurrent paced streams of `--chunks` SSE events `--interval` seconds
apart. For each, the calls counted on the gateway's trio thread, divided by the requests or by
the chunks relayed (a stream's request included in its chunks' share, as the bench's CPU per
paced chunk has it): "own", calls of functions in the tree's own packages; "all", every call
cProfile sees (the libraries' and builtins' included). Then the functions that make the most
calls per unit, to find where one checkout spends calls another does not.

With `--cpu`, the same loads without the profiler, and the process's CPU time per request and
per chunk instead (from /proc): one request at a time and paced streams do not batch more or
less as a loaded machine slows the gateway, as wrk's sixteen connections do, so the figures
move less between runs than the main bench's; alternate the trees and take medians.

Counts depend a little on timing (how many events one wake-up of the loop finds, the probes
that fall in the window), so they are steady to a call or so, not exact. The window's probes
are counted too: the config probes every minute.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import signal
import socket
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import msgspec

from bench.processes import Processes, cpu_seconds, free_port, wait_until_healthy
from bench.servers import HOST, PROJECT_ROOT, interlock_config, start_upstream
from bench.upstream import MODEL

OWN_PACKAGES = ("events", "journal", "transport", "controlplane", "dataplane", "fleet", "interlock")

_PROFILED = textwrap.dedent(
    """\
    import cProfile, runpy, signal, sys
    out, module = sys.argv[1], sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    profile = cProfile.Profile()
    def start(*_):
        profile.enable()
        open(out + ".on", "w").close()
    def stop(*_):
        profile.disable()
        profile.dump_stats(out + ".part")
        import os
        os.replace(out + ".part", out)
        profile.clear()
    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    """
)
"""Run as `python -c`, from the tree: `interlock serve` with a profile that SIGUSR1 starts and
SIGUSR2 stops and writes."""


# --- the load: plain blocking sockets, so the client's own cost is nowhere near the gateway ------


def _post(path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


REQUESTS_PER_CONNECTION = 500
"""hypercorn closes a keep-alive connection after a thousand requests (`keep_alive_max_requests`)."""


def small_requests(port: int, count: int) -> None:
    """`count` small chat completions, one at a time over keep-alive connections, each used for
    REQUESTS_PER_CONNECTION requests at most."""
    request = _post(
        "/v1/chat/completions",
        msgspec.json.encode(
            {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16}
        ),
    )
    for first in range(0, count, REQUESTS_PER_CONNECTION):
        _requests_on_one_connection(port, request, min(REQUESTS_PER_CONNECTION, count - first))


def _requests_on_one_connection(port: int, request: bytes, count: int) -> None:
    with socket.create_connection((HOST, port)) as connection:
        buffered = b""
        for _ in range(count):
            connection.sendall(request)
            while b"\r\n\r\n" not in buffered:
                buffered += _receive(connection)
            head, _, buffered = buffered.partition(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"the gateway answered {head[:200]!r}")
            length = next(
                int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
            )
            while len(buffered) < length:
                buffered += _receive(connection)
            buffered = buffered[length:]


def paced_streams(port: int, streams: int, chunks: int, interval: float) -> None:
    """`streams` concurrent streams of `chunks` events, `interval` seconds apart, each read to its end."""
    request = _post(
        "/v1/chat/completions",
        msgspec.json.encode(
            {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "stream": True,
             "bench_chunks": chunks, "bench_interval": interval}
        ),
    )
    failures: list[str] = []

    def one(index: int) -> None:
        time.sleep(interval * index / streams)  # spread over the interval, as the bench's client does
        try:
            with socket.create_connection((HOST, port)) as connection:
                connection.sendall(request)
                received = b""
                while not received.endswith(b"\r\n0\r\n\r\n"):
                    received += _receive(connection)
                events = received.count(b"data: ")
                if events != chunks:
                    failures.append(f"a stream ended after {events} of {chunks} events")
        except (OSError, RuntimeError) as error:
            failures.append(str(error))

    threads = [threading.Thread(target=one, args=(index,)) for index in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise RuntimeError("; ".join(failures))


def _receive(connection: socket.socket) -> bytes:
    data = connection.recv(65536)
    if not data:
        raise RuntimeError("the gateway closed the connection")
    return data


# --- counting ------------------------------------------------------------------------------------


def _profiled(pid: int, out: Path, load) -> pstats.Stats:
    """The profile of the gateway's trio thread while `load()` runs."""
    for path in (out, Path(f"{out}.on")):
        path.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR1)
    _wait_for(Path(f"{out}.on"))
    load()
    os.kill(pid, signal.SIGUSR2)
    _wait_for(out)
    return pstats.Stats(str(out))


def _wait_for(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway did not write {path} within {timeout:g} s")
        time.sleep(0.01)


def counted(stats: pstats.Stats, tree: Path, units: int, top: int) -> dict:
    """Calls per unit, own and all, and the functions that make the most of them."""
    roots = tuple(str(tree / package) + os.sep for package in OWN_PACKAGES)
    own = every = 0
    functions = []
    for (filename, line, name), (_, calls, *_rest) in stats.stats.items():
        every += calls
        mine = filename.startswith(roots)
        if mine:
            own += calls
            filename = os.path.relpath(filename, tree)
        elif filename != "~":
            filename = _short(filename)
        functions.append((calls, mine, f"{filename}:{line}({name})" if filename != "~" else name))
    functions.sort(key=lambda item: -item[0])
    return {
        "units": units,
        "own_per_unit": own / units,
        "all_per_unit": every / units,
        "top_own": [[where, calls / units] for calls, mine, where in functions if mine][:top],
        "top_all": [[where, calls / units] for calls, _, where in functions][:top],
    }


def _short(filename: str) -> str:
    """A library's file from its package on (`trio/_core/_run.py`)."""
    parts = Path(filename).parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return "/".join(parts[parts.index(marker) + 1 :])
    return "/".join(parts[-3:])


def measure(tree: Path, args: argparse.Namespace) -> dict:
    entry = "interlock.cli" if (tree / "interlock" / "cli.py").exists() else "dataplane.cli"
    with tempfile.TemporaryDirectory(prefix="interlock-calls-") as folder_name:
        folder = Path(folder_name)
        (folder / "logs").mkdir()
        with Processes(folder / "logs") as processes:
            upstream = start_upstream(processes, None)
            port = free_port()
            config = folder / "interlock.toml"
            config.write_text(interlock_config(folder, port, free_port(), upstream, health_interval="60s"))
            profile = folder / "profile"
            serve = [entry, "serve", "--config", str(config)]
            argv = [sys.executable, *(["-m"] if args.cpu else ["-c", _PROFILED, str(profile)]), *serve]

            def node_ready(status: int, body: bytes) -> bool:
                health = json.loads(body) if status == 200 else {}
                return health.get("status") == "ok" and health.get("models_ok") == health.get("nodes")

            gateway = processes.start("interlock", argv, cores=None, cwd=tree)
            wait_until_healthy(HOST, port, gateway, accept=node_ready)
            pid = gateway.pid
            small_requests(port, 200)  # warm: connections to the node, caches, the first snapshot's views
            paced_streams(port, 2, 10, args.interval)

            def measured(load, units: int) -> dict:
                if args.cpu:
                    return _cpu_time(pid, load, units)
                return counted(_profiled(pid, profile, load), tree, units, args.top)

            requests = measured(lambda: small_requests(port, args.requests), args.requests)
            streams = measured(
                lambda: paced_streams(port, args.streams, args.chunks, args.interval), args.streams * args.chunks
            )
    return {"tree": str(tree), "per_small_request": requests, "per_paced_chunk": streams}


def _cpu_time(pid: int, load, units: int) -> dict:
    """The process's CPU time (all its threads, user and system) per unit while `load()` runs."""
    before = cpu_seconds([pid])
    load()
    return {"units": units, "cpu_us_per_unit": (cpu_seconds([pid]) - before) / units * 1e6}


def render(result: dict) -> str:
    lines = [f"tree {result['tree']}"]
    for key in ("per_small_request", "per_paced_chunk"):
        figures = result[key]
        if "cpu_us_per_unit" in figures:
            lines.append(f"  CPU {key.replace('_', ' ')}: {figures['cpu_us_per_unit']:.1f} µs (over {figures['units']})")
            continue
        lines.append(
            f"  calls {key.replace('_', ' ')}: own {figures['own_per_unit']:.1f}, all {figures['all_per_unit']:.1f}"
            f" (over {figures['units']})"
        )
        for where, calls in figures["top_own"]:
            lines.append(f"    {calls:8.2f}  {where}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.call_count", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tree", type=Path, default=PROJECT_ROOT, help="the source tree to serve from (default: this checkout)"
    )
    parser.add_argument("--requests", type=int, default=2000, help="small requests counted (default 2000)")
    parser.add_argument("--streams", type=int, default=8, help="concurrent paced streams (default 8)")
    parser.add_argument("--chunks", type=int, default=100, help="SSE events per stream (default 100)")
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between events (default 0.02)")
    parser.add_argument("--top", type=int, default=25, help="functions listed per measure (default 25)")
    parser.add_argument(
        "--cpu", action="store_true", help="measure the process's CPU time per unit instead, without the profiler"
    )
    parser.add_argument("--out", type=Path, help="also write the figures as JSON to this file")
    args = parser.parse_args()
    result = measure(args.tree.resolve(), args)
    print(render(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

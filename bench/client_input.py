"""Clients that cost the gateway without asking anything of it: slow request bodies, rapid reset.

    python -m bench.client_input --slow-bodies [--clients 2000] [--seconds 75] [--workers N] [--source DIR]
    python -m bench.client_input --rapid-reset [--streams 5000] [--http2] [--workers N] [--source DIR]

Starts one simulated node (`python -m fixtures.node`, which records every request it receives)
and `interlock serve` in front of it, run from `--source` (default: this checkout; give an
unpacked `git archive main` to measure main), then:

- `--slow-bodies`: `--clients` connections each send the head of a completion request
  (`Content-Length: 100000`) and then one body byte per second. Every 15 s, and after
  `--seconds`, prints how many are still open (neither answered nor closed by the gateway), how
  the others ended, and the RSS of the gateway's processes (its workers included). With the default limits (60 s in all, 10 s idle) none should be left.
- `--rapid-reset`: one HTTP/2 connection (prior knowledge; `--http2` writes `gateway.http2 =
  true` in the config) opens up to `--streams` streams, each with a whole completion request,
  and resets each at once, and opens another connection whenever the gateway closes one, until
  `--streams` were opened (or a connection takes none). Prints the connections, their GOAWAY
  codes, and the requests the node received (completions started for nothing).

The figures end as one JSON object. Every process is stopped at the end, also on an error.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import httpx
import trio

from bench.processes import Processes, free_port, group_pids, wait_until_healthy
from bench.servers import HOST, PROJECT_ROOT

MODEL = "bench-model"
NODE_HOST = "127.0.0.2"
CHAT = "/v1/chat/completions"
H2_REQUEST_HEADERS = [(":method", "POST"), (":path", CHAT), (":scheme", "http"), (":authority", "gw"),
                      ("content-type", "application/json")]  # fmt: skip
BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}]}).encode()


def start(processes: Processes, folder: Path, source: Path, http2: bool, workers: int) -> tuple[int, int, int]:
    """The node and the gateway: (gateway port, node port, gateway pid)."""
    node_port, node_metrics = free_port(NODE_HOST), free_port(NODE_HOST)
    argv = [
        sys.executable, "-m", "fixtures.node", "--host", NODE_HOST, "--base-port", str(node_port),
        "--metrics-base-port", str(node_metrics), "--models", MODEL,
    ]  # fmt: skip
    node = processes.start("node", argv, cores=None, cwd=PROJECT_ROOT)
    wait_until_healthy(NODE_HOST, node_port, node)
    port = free_port()
    config = folder / "gateway.toml"
    config.write_text(
        f'[gateway]\nlisten = "{HOST}:{port}"\nmetrics_listen = "{HOST}:{free_port()}"\nhealth_interval = "1s"\n'
        + ("http2 = true\n" if http2 else "")
        + f'[[nodes]]\nip = "{NODE_HOST}"\nvllm_port = {node_port}\nmetrics_port = {node_metrics}\n'
        + f'[[models.available]]\nname = "{MODEL}"\n'
    )
    gateway = processes.start("interlock", [sys.executable, "-m", "interlock.cli", "serve", "--config", str(config), "--workers", str(workers)],
                              cores=None, cwd=source)  # fmt: skip

    def node_known(status: int, body: bytes) -> bool:
        return status == 200 and json.loads(body).get("models_ok") == 1

    wait_until_healthy(HOST, port, gateway, accept=node_known)
    return port, node_port, gateway.pid


def rss_mib(pgid: int) -> float:
    """The resident memory of a process group (the gateway and its workers)."""
    total = 0
    for pid in group_pids(pgid):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total += sum(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return total / 1024


async def slow_bodies(port: int, pid: int, clients: int, seconds: float) -> dict:
    """`clients` connections trickling a body a byte a second; how many are open over time."""
    open_connections = 0
    samples = []
    endings: Counter[str] = Counter()

    async def client() -> None:
        nonlocal open_connections
        try:
            stream = await trio.open_tcp_stream(HOST, port)
        except OSError:
            return
        async with stream:
            head = f"POST {CHAT} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
            open_connections += 1
            try:
                await stream.send_all(head.encode())
                while True:
                    with trio.move_on_after(1):
                        answer = await stream.receive_some(65536)  # an answer (408) or the end: no longer held
                        endings[answer.split(b"\r\n", 1)[0].decode("latin-1") or "closed"] += 1
                        break
                    await stream.send_all(b" ")
            except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
                endings[type(error).__name__] += 1
            finally:
                open_connections -= 1

    async with trio.open_nursery() as nursery:
        started = trio.current_time()
        for _ in range(clients):
            nursery.start_soon(client)
            await trio.sleep(0.002)  # within the listen backlog
        for at in [*range(15, int(seconds), 15), seconds]:
            await trio.sleep_until(started + at)
            samples.append({"seconds": at, "open": open_connections, "gateway_rss_mib": round(rss_mib(pid), 1)})
            print(f"after {at:>5.0f} s: {open_connections:>5} connections open, gateway RSS {samples[-1]['gateway_rss_mib']} MiB, "
                  f"ended: {dict(endings)}")  # fmt: skip
        nursery.cancel_scope.cancel()
    return {"clients": clients, "samples": samples, "endings": dict(endings)}


async def rapid_reset(port: int, node_port: int, streams: int) -> dict:
    """Open and reset `streams` streams, on one HTTP/2 connection after the other as the gateway
    closes them; what the node received."""
    async with httpx.AsyncClient(trust_env=False) as http:
        await http.delete(f"http://{NODE_HOST}:{node_port}/_control/requests")
    opened, connections, goaways = 0, 0, set()
    while opened < streams:
        opened_here, goaway = await reset_streams_on_one_connection(port, streams - opened)
        connections += 1
        opened += opened_here
        goaways.add(goaway)
        if opened_here == 0:
            break  # refused: no HTTP/2 here
    await trio.sleep(3)  # what was started reaches the node
    async with httpx.AsyncClient(trust_env=False) as http:
        received = (await http.get(f"http://{NODE_HOST}:{node_port}/_control/requests")).json()
    started = sum(1 for request in received if request.get("path") == CHAT)
    goaway_names = sorted(str(getattr(code, "name", code)) for code in goaways)
    print(f"{opened} streams sent and reset on {connections} connections (GOAWAY {', '.join(goaway_names)}), "
          f"{started} completions started on the node")  # fmt: skip
    return {"streams": streams, "sent": opened, "connections": connections, "goaway": goaway_names, "started": started}


async def reset_streams_on_one_connection(port: int, streams: int, body: bytes = BODY) -> tuple[int, object]:
    """Up to `streams` streams opened with a whole request (`body`) and reset at once, until the
    gateway closes the connection: how many, and the GOAWAY's error code (None without one)."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    opened, goaway = 0, None
    sending = trio.Lock()
    async with await trio.open_tcp_stream(HOST, port) as stream:

        async def send() -> None:
            async with sending:
                await stream.send_all(client.data_to_send())

        async def read() -> None:
            nonlocal goaway
            try:
                while data := await stream.receive_some(65536):
                    for event in client.receive_data(data):
                        if isinstance(event, h2.events.ConnectionTerminated):
                            goaway = event.error_code
                    await send()
            except (h2.exceptions.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            if goaway is None:
                goaway = "closed"

        async with trio.open_nursery() as nursery:
            try:
                await send()
                nursery.start_soon(read)
                while opened < streams and goaway is None:
                    if client.outbound_flow_control_window < len(body):
                        await trio.sleep(0.001)
                        continue
                    stream_id = client.get_next_available_stream_id()
                    client.send_headers(stream_id, H2_REQUEST_HEADERS)
                    client.send_data(stream_id, body, end_stream=True)
                    client.reset_stream(stream_id)
                    opened += 1
                    await send()
            except (h2.exceptions.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the gateway closed the connection
            with trio.move_on_after(2):
                while goaway is None:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    return opened, goaway


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--slow-bodies", action="store_true")
    mode.add_argument("--rapid-reset", action="store_true")
    parser.add_argument("--clients", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=75.0)
    parser.add_argument("--streams", type=int, default=5000)
    parser.add_argument("--http2", action="store_true", help="write gateway.http2 = true")
    parser.add_argument("--workers", type=int, default=1, help="interlock serve --workers")
    parser.add_argument("--source", type=Path, default=PROJECT_ROOT, help="the gateway's code (default: here)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="client-input-") as temporary, Processes(Path(temporary)) as processes:
        port, node_port, pid = start(processes, Path(temporary), args.source.resolve(), args.http2, args.workers)
        if args.slow_bodies:
            figures = trio.run(slow_bodies, port, pid, args.clients, args.seconds)
        else:
            figures = trio.run(rapid_reset, port, node_port, args.streams)
    print(json.dumps({"source": str(args.source), "http2": args.http2, "workers": args.workers, **figures}))


if __name__ == "__main__":
    main()

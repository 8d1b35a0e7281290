"""The servers the benchmark compares, each started as its own process group on 127.0.0.1.

- the upstream (`bench.upstream`): what every other row proxies to, and the `direct` row itself;
- the floor (`bench.floor_app`): quart-trio on hypercorn answering with the same canned bytes;
- nginx as a plain reverse proxy to the upstream (foreground, one worker, keep-alive upstream
  connections, no response buffering so SSE flows chunk by chunk), from a generated config;
- interlock: `interlock serve` with one standalone node, the upstream, probed every second, with
  its metrics listener and its event log on.

The failover drill and the routing benchmark run simulated nodes instead (`fixtures.node`, each
a process on its own loopback address) behind `interlock serve` (`start_simulated_nodes`,
`start_gateway`).
"""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from bench.processes import NamedProcess, Processes, free_port, group_pids, wait_until_healthy
from bench.upstream import MODEL

PROJECT_ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
COMPLETIONS_PATH = "/v1/chat/completions"


@dataclass
class Server:
    name: str
    port: int
    process: NamedProcess

    @property
    def url(self) -> str:
        """The chat-completions URL."""
        return f"http://{HOST}:{self.port}{COMPLETIONS_PATH}"

    def pids(self) -> list[int]:
        """Its live processes (nginx: the master and the worker)."""
        return group_pids(self.process.pid)


def _launch(
    processes: Processes,
    name: str,
    argv: list[str],
    port: int,
    cores: frozenset[int] | None,
    accept=None,
    root: Path = PROJECT_ROOT,
) -> Server:
    """Start a server (from the source tree `root`) and wait until `GET /health` on `port` is
    accepted; stop it if it never is."""
    process = processes.start(name, argv, cores=cores, cwd=root)
    try:
        wait_until_healthy(HOST, port, process, **({"accept": accept} if accept else {}))
    except BaseException:
        processes.stop(process)
        raise
    return Server(name, port, process)


def start_upstream(processes: Processes, cores: frozenset[int] | None) -> Server:
    port = free_port()
    return _launch(processes, "upstream", [sys.executable, "-m", "bench.upstream", "--host", HOST, "--port", str(port)], port, cores)


def start_floor(processes: Processes, cores: frozenset[int] | None, *, bare: bool = False) -> Server:
    """The quart-trio floor, or with `bare` the plain ASGI one (`bench.floor_app`)."""
    port = free_port()
    argv = [sys.executable, "-m", "bench.floor_app", "--host", HOST, "--port", str(port), *(["--bare"] if bare else [])]
    return _launch(processes, "asgi-floor" if bare else "floor", argv, port, cores)


def nginx_config(prefix: Path, port: int, upstream: Server) -> str:
    temp = {name: prefix / f"{name}_temp" for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")}
    return textwrap.dedent(
        f"""\
        worker_processes 1;
        pid {prefix / 'nginx.pid'};
        error_log {prefix / 'error.log'} warn;
        events {{
            worker_connections 4096;
        }}
        http {{
            access_log off;
            client_body_temp_path {temp['client_body']};
            proxy_temp_path {temp['proxy']};
            fastcgi_temp_path {temp['fastcgi']};
            uwsgi_temp_path {temp['uwsgi']};
            scgi_temp_path {temp['scgi']};
            keepalive_requests 1000000;
            upstream bench_upstream {{
                server {HOST}:{upstream.port};
                keepalive 256;
                keepalive_requests 1000000;
            }}
            server {{
                listen {HOST}:{port};
                location / {{
                    proxy_pass http://bench_upstream;
                    proxy_http_version 1.1;
                    proxy_set_header Connection "";
                    proxy_buffering off;
                }}
            }}
        }}
        """
    )


def start_nginx(processes: Processes, folder: Path, cores: frozenset[int] | None, upstream: Server) -> Server:
    prefix = folder / "nginx"
    prefix.mkdir()
    prefix.chmod(0o755)  # a worker running as an unprivileged user reads and writes here too
    port = free_port()
    config = prefix / "nginx.conf"
    config.write_text(nginx_config(prefix, port, upstream))
    argv = [nginx_path(), "-p", str(prefix), "-c", str(config), "-e", str(prefix / "error.log"), "-g", "daemon off;"]
    return _launch(processes, "nginx", argv, port, cores)


def nginx_path() -> str | None:
    """nginx is often in /usr/sbin, which a user's PATH may not include."""
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin:/usr/local/nginx/sbin")


def interlock_config(
    folder: Path, port: int, metrics_port: int, upstream: Server, health_interval: str = "1s"
) -> str:
    quoted = lambda value: msgspec.json.encode(value).decode()  # a TOML basic string
    return textwrap.dedent(
        f"""\
        [gateway]
        listen = {quoted(f"{HOST}:{port}")}
        metrics_listen = {quoted(f"{HOST}:{metrics_port}")}
        health_interval = {quoted(health_interval)}
        event_log = {quoted(str(folder / "events.jsonl"))}

        [[nodes]]
        ip = {quoted(HOST)}
        name = "bench-upstream"
        vllm_port = {upstream.port}
        metrics_port = {upstream.port}

        [models]
        default = {quoted(MODEL)}

        [[models.available]]
        name = {quoted(MODEL)}
        """
    )


def start_interlock(
    processes: Processes,
    folder: Path,
    cores: frozenset[int] | None,
    upstream: Server,
    *,
    workers: int = 1,
    root: Path = PROJECT_ROOT,
    name: str = "",
) -> Server:
    """`interlock serve`, ready once its /health says the node is healthy and its models listed;
    run from the source tree `root` (another checkout's, to compare two versions)."""
    port = free_port()
    config = folder / f"interlock-{workers}.toml"
    config.write_text(interlock_config(folder / f"workers-{workers}", port, free_port(), upstream))
    argv = [sys.executable, "-m", "interlock.cli", "serve", "--config", str(config), "--workers", str(workers)]

    def node_ready(status: int, body: bytes) -> bool:
        if status != 200:
            return False
        health = json.loads(body)
        return health["status"] == "ok" and health["models_ok"] == health["nodes"]

    name = name or ("interlock" if workers == 1 else f"interlock-x{workers}")
    return _launch(processes, name, argv, port, cores, accept=node_ready, root=root)


# --- simulated nodes behind a gateway (the failover drill, the routing benchmark) --------------


@dataclass
class SimulatedNodeProcess:
    name: str
    host: str
    port: int
    metrics_port: int
    process: NamedProcess

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def start_simulated_nodes(
    processes: Processes,
    count: int,
    model: str,
    *,
    ttft: float,
    tpot: float,
    tokens: int,
    roles: Sequence[str] = (),
    scheduling_policy: str = "fcfs",
    options: Sequence[str] = (),
) -> list[SimulatedNodeProcess]:
    """`count` simulated nodes n1, n2, … on 127.0.0.2, 127.0.0.3, …, each a process answering
    its /health; `roles` are the first nodes' disaggregation roles (the others: both);
    `scheduling_policy` as vLLM's; `options` more of `python -m fixtures.node`'s flags."""
    nodes = []
    for index in range(count):
        host = f"127.0.0.{index + 2}"
        port, metrics_port = free_port(host), free_port(host)
        argv = [
            sys.executable, "-m", "fixtures.node", "--host", host, "--base-port", str(port),
            "--metrics-base-port", str(metrics_port), "--name-prefix", f"n{index + 1}-", "--models", model,
            "--ttft", str(ttft), "--tpot", str(tpot), "--tokens", str(tokens),
            "--role", roles[index] if index < len(roles) else "both", "--scheduling-policy", scheduling_policy,
            *options,
        ]  # fmt: skip
        process = processes.start(f"node-{index + 1}", argv, cores=None, cwd=PROJECT_ROOT)
        wait_until_healthy(host, port, process)
        nodes.append(SimulatedNodeProcess(f"n{index + 1}", host, port, metrics_port, process))
    return nodes


def gateway_config(
    port: int,
    nodes: list[SimulatedNodeProcess],
    model: str,
    gateway: dict[str, object],
    routing: dict[str, object],
    roles: Sequence[str] = (),
    node_keys: dict[str, object] | None = None,
    tables: str = "",
    keys_of_node: Sequence[dict[str, object]] = (),
    model_keys: dict[str, object] | None = None,
) -> str:
    """A TOML config for `nodes` serving `model`, with `gateway` keys and a [routing] table;
    `roles` are the first nodes' disaggregation roles, `node_keys` more keys of every node,
    `keys_of_node` more keys of the first nodes, one table each, `model_keys` more keys of the
    model's entry, `tables` more TOML (tables of their own) at the end."""
    quoted = lambda value: msgspec.json.encode(value).decode()  # noqa: E731 (TOML spells these as JSON does)
    lines = ["[gateway]", f"listen = {quoted(f'{HOST}:{port}')}", f"metrics_listen = {quoted(f'{HOST}:{free_port()}')}"]
    lines += [f"{key} = {quoted(value)}" for key, value in gateway.items()]
    for index, node in enumerate(nodes):
        lines += ["[[nodes]]", f"ip = {quoted(node.host)}", f"name = {quoted(node.name)}"]
        lines += [f"vllm_port = {node.port}", f"metrics_port = {node.metrics_port}"]
        if index < len(roles):
            lines.append(f"role = {quoted(roles[index])}")
        own = keys_of_node[index] if index < len(keys_of_node) else {}
        lines += [f"{key} = {quoted(value)}" for key, value in ((node_keys or {}) | own).items()]
    lines += ["[routing]"] + [f"{key} = {quoted(value)}" for key, value in routing.items()]
    lines += ["[models]", f"default = {quoted(model)}", "[[models.available]]", f"name = {quoted(model)}"]
    lines += [f"{key} = {quoted(value)}" for key, value in (model_keys or {}).items()]
    return "\n".join(lines) + "\n" + tables


def start_gateway(
    processes: Processes,
    folder: Path,
    nodes: list[SimulatedNodeProcess],
    model: str,
    *,
    gateway: dict[str, object],
    routing: dict[str, object] | None = None,
    name: str = "interlock",
    roles: Sequence[str] = (),
    node_keys: dict[str, object] | None = None,
    tables: str = "",
    workers: int = 1,
    keys_of_node: Sequence[dict[str, object]] = (),
    model_keys: dict[str, object] | None = None,
) -> Server:
    """`interlock serve` for `nodes` (see `gateway_config`), with `workers` API processes, ready
    once every node is healthy and its models are known."""
    port = free_port()
    config = folder / f"{name}.toml"
    config.write_text(
        gateway_config(
            port, nodes, model, gateway, routing or {}, roles, node_keys, tables, keys_of_node, model_keys
        )
    )
    argv = [sys.executable, "-m", "interlock.cli", "serve", "--config", str(config)]
    if workers > 1:
        argv += ["--workers", str(workers)]

    def all_ready(status: int, body: bytes) -> bool:
        health = json.loads(body) if status == 200 else {}
        return health.get("status") == "ok" and health.get("models_ok") == len(nodes)

    return _launch(processes, name, argv, port, None, accept=all_ready)

"""`interlock serve`: the composition root of a running gateway (plinth §7).

Start-up, in this order: handle signals (from the start, so none is lost), load the config,
bind both listen addresses, and only then start the control plane (probes, event log), so a
gateway that cannot bind probes nothing and writes nothing. The control plane runs around
everything else: the API listener (`gateway.listen`), the metrics listener
(`gateway.metrics_listen`), the decision-log writer, and the control plane's signal handler.

Signals, as `interlock serve --help` documents them: SIGHUP reloads. SIGTERM/SIGINT shut down
in plinth's order: log `shutting down`, drain both listeners (streams in flight finish, for up
to SHUTDOWN_GRACE_SECONDS) and the decision log, then stop the control plane (`gateway
stopped`), so requests finishing during the drain still report to a running control plane. A
second SIGTERM/SIGINT during the drain closes the connections still open at once; the rest of
the shutdown is the same.

Exit codes: 0 after a signalled shutdown, graceful or forced; 1 when the config cannot be
loaded (`fatal: loading config: …` on stderr) or a listener cannot bind (`server error`).
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial

import prometheus_client
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app
from prometheus_client import CollectorRegistry

from controlplane.config import ConfigError, parse_listen_address
from controlplane.logs import JsonLog
from controlplane.runtime import HANDLED_SIGNALS, ControlPlane, load_config_logging_unknown_keys, open_control_plane
from dataplane.asgi import ApiApp
from dataplane.decisions import DecisionLog
from dataplane.metrics import RequestMetrics, metrics_app
from dataplane.proxy import FIRST_CHUNK_TIMEOUT, RESPONSE_HEADER_TIMEOUT, Proxy, SnapshotViews, new_upstream_pool
from events.config import Config, GatewayConfig

EXIT_OK = 0
EXIT_FAILURE = 1

SHUTDOWN_GRACE_SECONDS = 10.0
"""plinth's graceful-shutdown timeout (hypercorn's default of 3 s would cut draining streams)."""

KEEP_ALIVE_SECONDS = 90.0
"""How long an idle client connection stays open (hypercorn's default is 5 s)."""

LISTEN_BACKLOG = 100
"""Connections the kernel queues before the server accepts them (hypercorn's default)."""


@dataclass(frozen=True)
class Listening:
    """What `serve` tells its `ready` callback once both listeners accept connections."""

    api: tuple[str, int]
    metrics: tuple[str, int]
    control_plane: ControlPlane


async def serve(
    config_path: str,
    *,
    version: str,
    ready: Callable[[Listening], None] | None = None,
    log: JsonLog | None = None,
    response_header_timeout: float = RESPONSE_HEADER_TIMEOUT,
    first_chunk_timeout: float = FIRST_CHUNK_TIMEOUT,
) -> int:
    """Run the gateway until SIGTERM or SIGINT; returns the exit code.

    `ready` is called once both listeners accept connections and signals are handled; `log`
    replaces the JSON log on stdout, and the two timeouts plinth's, for tests. Signals that come
    before the gateway is serving wait for it; those left when it returns are re-raised (see
    `run_serve`).
    """
    log = log if log is not None else JsonLog()
    with trio.open_signal_receiver(*HANDLED_SIGNALS) as signals:
        try:
            config = await load_config_logging_unknown_keys(config_path, log)
        except ConfigError as error:
            print(f"fatal: loading config: {error}", file=sys.stderr)
            return EXIT_FAILURE
        try:
            sockets = _bind_listeners(config.gateway)
        except ListenError as error:
            log.error("server error", error=str(error))
            return EXIT_FAILURE
        try:
            registry = CollectorRegistry()
            async with open_control_plane(
                config_path, config=config, version=version, log=log, registry=registry
            ) as control_plane:
                return await _run(
                    control_plane, signals, sockets, registry, log, ready, response_header_timeout, first_chunk_timeout
                )
        finally:
            for sock in sockets:
                sock.close()


async def _run(
    control_plane: ControlPlane,
    signals: AsyncIterator[int],
    sockets: tuple[socket.socket, socket.socket],
    registry: CollectorRegistry,
    log: JsonLog,
    ready: Callable[[Listening], None] | None,
    response_header_timeout: float,
    first_chunk_timeout: float,
) -> int:
    config = control_plane.snapshot.config
    _log_topology(log, config)
    decisions = DecisionLog(lambda: control_plane.snapshot.config.gateway.decision_log, log)
    request_metrics = RequestMetrics(registry)
    stop_listening = trio.Event()
    drained = trio.Event()

    async def drain() -> None:
        """SIGTERM's step before the control plane stops: both listeners stop accepting and
        finish what is in flight, then the decision log writes what is left."""
        stop_listening.set()
        await drained.wait()

    api_socket, metrics_socket = sockets
    async with new_upstream_pool() as upstream_pool, trio.open_nursery() as nursery:
        proxy = Proxy(
            control_plane,
            upstream_pool,
            request_metrics,
            log,
            decisions,
            response_header_timeout=response_header_timeout,
            first_chunk_timeout=first_chunk_timeout,
        )
        api_app = ApiApp(control_plane, proxy, SnapshotViews(control_plane))
        async with trio.open_nursery() as serving:
            serving.start_soon(decisions.run)
            async with trio.open_nursery() as listeners:
                await listeners.start(_serve_on, api_app, api_socket, stop_listening)
                log.info("api server listening", addr=config.gateway.listen)
                await listeners.start(_serve_on, metrics_app(registry), metrics_socket, stop_listening)
                log.info("metrics server listening", addr=config.gateway.metrics_listen)
                handle_signals = partial(
                    control_plane.serve_signals, signals, before_stop=drain, force=listeners.cancel_scope.cancel
                )
                await nursery.start(handle_signals)
                if ready is not None:
                    ready(
                        Listening(
                            api=api_socket.getsockname()[:2],
                            metrics=metrics_socket.getsockname()[:2],
                            control_plane=control_plane,
                        )
                    )
            decisions.close()  # the listeners are done: no request records any more
        drained.set()
    return EXIT_OK


class ListenError(Exception):
    """A listen address that cannot be bound: `cannot listen on ADDRESS (KEY): REASON`."""


def _bind_listeners(gateway: GatewayConfig) -> tuple[socket.socket, socket.socket]:
    """Bind and listen on `gateway.listen` and `gateway.metrics_listen` (both validated by the
    config loader); ListenError names the address and the key that cannot be bound."""
    api = _bind(gateway.listen, "listen")
    try:
        return api, _bind(gateway.metrics_listen, "metrics_listen")
    except ListenError:
        api.close()
        raise


def _bind(address: str, key: str) -> socket.socket:
    """A listening socket set up as hypercorn sets up its own."""
    host, port = parse_listen_address(address)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as error:
        sock.close()
        reason = error.strerror or str(error)
        raise ListenError(f"cannot listen on {address} ({key}): {reason[:1].lower()}{reason[1:]}") from None
    sock.setblocking(False)
    return sock


async def _serve_on(
    app, sock: socket.socket, stopped: trio.Event, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve `app` on the listening socket `sock` until `stopped` is set, then drain."""
    config = HypercornConfig()
    config.graceful_timeout = SHUTDOWN_GRACE_SECONDS
    config.keep_alive_timeout = KEEP_ALIVE_SECONDS
    config.include_server_header = False
    config.accesslog = None
    config.errorlog = _hypercorn_errors
    await worker_serve(
        wrap_app(app, config.wsgi_max_body_size, None),
        config,
        sockets=Sockets(secure_sockets=[], insecure_sockets=[sock], quic_sockets=[]),
        shutdown_trigger=stopped.wait,
        task_status=task_status,
    )


_hypercorn_errors = logging.getLogger("interlock.hypercorn")
"""hypercorn's own messages: warnings and errors only (its `Running on …` lines are ours)."""
_hypercorn_errors.setLevel(logging.WARNING)


def _log_topology(log: JsonLog, config: Config) -> None:
    """plinth's startup lines about rings (after the control plane's `starting gateway` and
    `config loaded`)."""
    standalone = [node.name for node in config.nodes if not node.ring]
    if standalone:
        log.info("standalone nodes serving non-ring models", nodes=",".join(standalone))
    rings: dict[str, list[str]] = {}
    for node in config.nodes:
        if node.ring:
            rings.setdefault(node.ring, []).append(node.name)
    for ring, names in rings.items():
        log.info("ring nodes", ring=ring, nodes=",".join(names))
    for model in config.models.available:
        if model.ring:
            log.info("model routed to ring", model=model.name, ring=model.ring)


def run_serve(config_path: str, version: str) -> int:
    """The `interlock serve` entry point.

    The handled signals are `serve`'s. Outside its signal receiver (the instant before it opens,
    and once the gateway has stopped, when the receiver re-raises the signals it has not
    handled) they are ignored: a late SIGINT or SIGTERM must end neither in a KeyboardInterrupt
    traceback nor in death by signal.
    """
    prometheus_client.disable_created_metrics()  # plinth exposes no `_created` series
    for signum in HANDLED_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    return trio.run(partial(serve, config_path, version=version))

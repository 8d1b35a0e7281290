"""`interlock serve`: the composition root of a running gateway (plinth §7).

Start-up, in this order: handle signals (from the start, so none is lost), load the config,
bind both listen addresses, lock the decision log, and only then start the control plane (it
locks the event log before probing or writing), so a gateway that cannot bind, or whose logs
another gateway holds, probes nothing and writes nothing. The control plane runs around
everything else: the API listener (`gateway.listen`, served here or by worker processes), the
metrics listener (`gateway.metrics_listen`), the decision-log writer, and the control plane's
signal handler.

Signals, as `interlock serve --help` documents them: SIGHUP reloads. SIGTERM/SIGINT shut down
in plinth's order: log `shutting down`, drain both listeners (streams in flight finish, for up
to `gateway.shutdown_grace`, as the config in force says; those still open then end with an
error event) and the decision log, then stop the control plane (`gateway stopped`), so
requests finishing during the drain still report to a running control plane. A
second SIGTERM/SIGINT during the drain closes the connections still open at once (and kills the
workers); the rest of the shutdown is the same. A SIGTERM/SIGINT while the config is read ends
`serve` at once (exit 0), however long the read would take.

Exit codes: 0 after a signalled shutdown, graceful or forced; 1 when the config cannot be
loaded (`fatal: loading config: …` on stderr), a listener cannot bind (`server error`), or a log
is locked by another gateway (`fatal: event log X is in use by another process (pid N)`).
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

import hypercorn.trio
import prometheus_client
import trio
from hypercorn.config import Config as HypercornConfig
from prometheus_client import CollectorRegistry

import dataplane.hypercorn_private  # noqa: F401  (hypercorn's connections as the gateway serves them: see there)
from controlplane.effects.control_plane import ControlPlane, load_config_logging_unknown_keys, open_control_plane
from controlplane.effects.lifecycle import HANDLED_SIGNALS
from controlplane.infrastructure.config import NO_OVERRIDES, ConfigError, Overrides
from controlplane.infrastructure.gocompat import parse_listen_address
from controlplane.infrastructure.logs import JsonLog
from controlplane.rules.balancer import Balancer
from dataplane.admission.admit import Admission
from dataplane.admission.limits import Limits
from dataplane.admission.occupancy import Occupancy
from dataplane.admission.queue import AdmissionQueue
from dataplane.admission.quota import LocalQuota, Quota
from dataplane.asgi import ApiApp
from dataplane.attempts import Attempts, new_upstream_pool
from dataplane.control import ControlPlaneView
from dataplane.decisions import DecisionFanOut, DecisionLog, DecisionRecorder, NumberedRecords, open_decision_log
from dataplane.finish import Finish
from dataplane.ledger import Books
from dataplane.metrics import RequestMetrics, metrics_app
from dataplane.planning import Planning
from dataplane.proxy import Proxy
from dataplane.views import SnapshotViews
from events.config import DEFAULT_SHUTDOWN_GRACE, LOG_FORMATS, LOG_LEVELS, Config, GatewayConfig, Workers
from events.decisions import Decision
from fleet.jetstream import NameHeld
from fleet.replica import FleetControlPlane
from interlock.workers import WorkerMetrics, WorkerPool, WorkerSamples, usable_cores
from kvcache.index import KvIndex
from journal.writer import LogInUse
from kvcache.subscriptions import following_kv_events
from transport.http11 import HttpClient

EXIT_OK = 0
EXIT_FAILURE = 1

STREAM_END_SECONDS = 2.0
"""How long the streams still open when the shutdown grace ends have to send their error event
and end, before hypercorn closes every connection left (a client that reads nothing, say)."""

KEEP_ALIVE_SECONDS = 90.0
"""How long an idle client connection stays open (hypercorn's default is 5 s)."""

LISTEN_BACKLOG = 100
"""Connections the kernel queues before a listener accepts them (hypercorn's default)."""


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
    workers: Workers | None = None,
    overrides: Overrides = NO_OVERRIDES,
    ready: Callable[[Listening], None] | None = None,
    log: JsonLog | None = None,
) -> int:
    """Run the gateway until SIGTERM or SIGINT; returns the exit code.

    `workers` overrides `gateway.workers`, `overrides` the other settings the command line
    gives. `ready` is called once both listeners accept connections and signals are handled;
    `log` replaces the log on stdout (which follows the config's log settings). SIGTERM/SIGINT
    while the config is read end it (`_config_unless_stopped`); other signals that come before
    the gateway is serving wait for it; those left when it returns are re-raised (see `run_serve`).
    """
    if log is None:
        log = JsonLog(level=overrides.log_level or LOG_LEVELS[0], format=overrides.log_format or LOG_FORMATS[0])
    with trio.open_signal_receiver(*HANDLED_SIGNALS) as signals:
        config = await _config_unless_stopped(config_path, log, overrides, signals)
        if config is None:
            return EXIT_OK
        if isinstance(config, ConfigError):
            print(f"fatal: loading config: {config}", file=sys.stderr)
            return EXIT_FAILURE
        log.configure(config.gateway)
        try:
            sockets = _bind_listeners(config.gateway)
        except ListenError as error:
            log.error("server error", error=str(error))
            return EXIT_FAILURE
        decisions: DecisionLog | None = None
        try:
            registry = CollectorRegistry()
            count = worker_count(workers if workers is not None else config.gateway.workers)
            decisions = await trio.to_thread.run_sync(open_decision_log, config.gateway, log, registry)
            kind = FleetControlPlane if config.fleet is not None else ControlPlane
            async with open_control_plane(
                config_path, kind=kind, config=config, overrides=overrides, version=version, log=log, registry=registry
            ) as control_plane:
                return await _run(control_plane, config, signals, sockets, registry, log, ready, count, decisions)
        except LogInUse as error:
            print(f"fatal: {error.strerror}", file=sys.stderr)
            return EXIT_FAILURE
        except NameHeld as error:
            print(f"fatal: fleet: {error}", file=sys.stderr)
            return EXIT_FAILURE
        finally:
            for sock in sockets:
                sock.close()
            if decisions is not None:
                decisions.appender.file.close()


async def _config_unless_stopped(
    config_path: str, log: JsonLog, overrides: Overrides, signals: AsyncIterator[int]
) -> Config | ConfigError | None:
    """The config, or why it will not do, loaded while SIGTERM and SIGINT are heeded: None when
    one comes first (the read may wait for ever: a config file that is a FIFO nobody writes, a
    stalled mount). A SIGHUP meanwhile is dropped: the config being loaded is the newest."""
    loaded: Config | ConfigError | None = None
    async with trio.open_nursery() as nursery:

        async def load() -> None:
            nonlocal loaded
            try:
                loaded = await load_config_logging_unknown_keys(config_path, log, overrides)
            except ConfigError as error:
                loaded = error
            nursery.cancel_scope.cancel()

        nursery.start_soon(load)
        async for signum in signals:
            if signum != signal.SIGHUP:
                nursery.cancel_scope.cancel()
    return loaded


def worker_count(workers: Workers) -> int:
    """How many API processes `workers` asks for: 1 is the gateway alone, `auto` one per usable core."""
    return usable_cores() if workers == "auto" else workers


def new_proxy(
    control_plane: ControlPlaneView,
    upstream_pool: HttpClient,
    metrics: RequestMetrics,
    log: JsonLog,
    decisions: DecisionRecorder | None = None,
    *,
    quota: Quota | None = None,
    views: SnapshotViews | None = None,
    kv_index: KvIndex | None = None,
) -> Proxy:
    """The request path's parts, built once per process and handed to the proxy: the in-flight
    counts the queue and the picks share (`Occupancy`), the two balancers (the prefill leg's
    own), the admission queue, the books every request writes to, and the four stages. `quota`:
    where tenants' quota is taken (by default this process holds it); `kv_index`: the
    process's KV index, which `kv_aware` matches prompts against (its nodes: those with
    `kv_events` in the config in force; None: none ever)."""
    views = views if views is not None else SnapshotViews(control_plane)
    occupancy = Occupancy(views)
    queue = AdmissionQueue(control_plane, views, occupancy, metrics)
    books = Books(control_plane, metrics, log, occupancy, decisions, queue)
    admission = Admission(Limits(quota or LocalQuota(), metrics), queue, views)
    planning = Planning(books, Balancer(occupancy.in_flight), Balancer(occupancy.in_flight), metrics, log, kv_index)
    attempts = Attempts(control_plane, upstream_pool, metrics, log, occupancy)
    return Proxy(admission, planning, attempts, Finish(log))


@asynccontextmanager
async def api_application(
    control_plane: ControlPlaneView,
    log: JsonLog,
    decisions: DecisionRecorder | None,
    *,
    worker: int = 0,
    quota: Quota | None = None,
    registry: CollectorRegistry | None = None,
) -> AsyncIterator[ApiApp]:
    """The API listener's application on a control plane (the gateway's own, a worker's
    follower, a fleet replica's), with its connections to the nodes and its subscriptions to the
    nodes' KV events, open until the block ends. `quota`: where tenants' quota is taken (a
    worker's leases; by default this process holds it)."""
    registry = registry if registry is not None else CollectorRegistry()
    config = control_plane.snapshot.config
    async with (
        new_upstream_pool() as upstream_pool,
        following_kv_events(control_plane.config_listeners, config, registry, log) as kv_index,
    ):
        views = SnapshotViews(control_plane)
        metrics = RequestMetrics(registry)
        numbered = NumberedRecords(decisions, worker) if decisions is not None else None
        proxy = new_proxy(
            control_plane, upstream_pool, metrics, log, numbered, quota=quota, views=views, kv_index=kv_index
        )
        yield ApiApp(control_plane, proxy, views, worker)


async def _run(
    control_plane: ControlPlane,
    config: Config,
    signals: AsyncIterator[int],
    sockets: tuple[socket.socket, socket.socket],
    registry: CollectorRegistry,
    log: JsonLog,
    ready: Callable[[Listening], None] | None,
    workers: int,
    decisions: DecisionLog | None,
) -> int:
    """`config` is the file's as loaded: its listeners' keys are this process's own (in a fleet the
    state's config is the fleet's, without them)."""
    _log_topology(log, config)
    recorder = decision_recorder(control_plane, decisions)
    stop_listening = trio.Event()
    drained = trio.Event()

    def shutdown_grace() -> float:
        return control_plane.view.snapshot.config.gateway.shutdown_grace

    async def drain() -> None:
        """SIGTERM's step before the control plane stops: both listeners stop accepting and
        finish what is in flight, then the decision log writes what is left."""
        stop_listening.set()
        await drained.wait()

    async def serve_api(api_socket: socket.socket, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """This process serves the API, or its workers do (then until `stop_listening`)."""
        if workers == 1:
            async with api_application(control_plane.view, log, recorder, registry=registry) as app:
                await serve_on_socket(
                    app,
                    api_socket,
                    stop_listening,
                    http2=config.gateway.http2,
                    tls=tls_files(config.gateway),
                    shutdown_grace=shutdown_grace,
                    end_streams=app.end_streams,
                    task_status=task_status,
                )
            return
        with tempfile.TemporaryDirectory(prefix="interlock-metrics-") as metrics_dir:
            WorkerSamples(registry, path=metrics_dir)
            pool = WorkerPool(
                control_plane,
                api_socket,
                workers,
                log=log,
                record_decision=recorder.record if recorder is not None else _discard,
                metrics=WorkerMetrics(registry),
                metrics_dir=metrics_dir,
                tls=tls_files(config.gateway),
            )
            async with trio.open_nursery() as nursery:
                await nursery.start(pool.run)
                task_status.started()
                await stop_listening.wait()
                await pool.stop(shutdown_grace() + STREAM_END_SECONDS)

    api_socket, metrics_socket = sockets
    api, metrics = (sock.getsockname()[:2] for sock in sockets)  # before serving takes the sockets over
    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as serving:
            if decisions is not None:
                serving.start_soon(decisions.appender.run)
            async with trio.open_nursery() as listeners:
                await listeners.start(serve_api, api_socket)
                log.info("api server listening", addr=config.gateway.listen)
                await listeners.start(
                    partial(serve_on_socket, shutdown_grace=shutdown_grace),
                    metrics_app(registry),
                    metrics_socket,
                    stop_listening,
                )
                log.info("metrics server listening", addr=config.gateway.metrics_listen)
                handle_signals = partial(
                    control_plane.lifecycle.serve_signals,
                    signals,
                    before_stop=drain,
                    force=listeners.cancel_scope.cancel,
                    on_hangup=decisions.appender.check_file if decisions is not None else None,
                )
                await nursery.start(handle_signals)
                if ready is not None:
                    ready(Listening(api=api, metrics=metrics, control_plane=control_plane))
            serving.cancel_scope.cancel()  # the listeners are done: no request records any more
        if decisions is not None:
            with trio.CancelScope(shield=True):
                await decisions.appender.aclose()
        drained.set()
    return EXIT_OK


def decision_recorder(control_plane: ControlPlane, decisions: DecisionLog | None) -> DecisionRecorder | None:
    """Where the data plane's decision records go: the decision log, and in a fleet the fleet's
    decision stream too (`fleet.decisions`), both naming the replica."""
    if not isinstance(control_plane, FleetControlPlane):
        return decisions
    sinks = [control_plane.decisions] if decisions is None else [decisions.appender, control_plane.decisions]
    return DecisionFanOut(control_plane.replica, sinks, control_plane.partitions.partition_of)


def _discard(decision: Decision) -> None:
    """Where decision records go without a decision log."""


class ListenError(Exception):
    """A listen address that cannot be bound: `cannot listen on ADDRESS (KEY): REASON`."""


def _bind_listeners(gateway: GatewayConfig) -> tuple[socket.socket, socket.socket]:
    """The listening sockets of `gateway.listen` and `gateway.metrics_listen` (both validated by
    the config loader)."""
    api = listening_socket(gateway.listen, "listen")
    try:
        return api, listening_socket(gateway.metrics_listen, "metrics_listen")
    except ListenError:
        api.close()
        raise


HTTP2_MAX_CONCURRENT_STREAMS = 100
"""Streams an HTTP/2 client may have open at once on one connection (with `gateway.http2`)."""


def tls_files(gateway: GatewayConfig) -> tuple[str, str] | None:
    """The API listener's certificate and key files, when it serves HTTPS."""
    return (gateway.tls_certificate, gateway.tls_key) if gateway.tls_certificate else None


def _hypercorn_config(http2: bool) -> HypercornConfig:
    """hypercorn as every listener of the gateway runs it; HTTP/1.1 only unless `http2`.

    hypercorn has no switch for HTTP/2 in cleartext: without `http2`, an HTTP/2 client is told
    it may open no stream at all (SETTINGS_MAX_CONCURRENT_STREAMS 0), and the connection ends
    with GOAWAY at its first request."""
    config = HypercornConfig()
    config.h2_max_concurrent_streams = HTTP2_MAX_CONCURRENT_STREAMS if http2 else 0  # see `http2_on`
    config.backlog = LISTEN_BACKLOG
    config.include_server_header = False
    config.accesslog = None
    config.errorlog = _hypercorn_errors
    return config


def listening_socket(address: str, key: str) -> socket.socket:
    """A socket bound to `address` (a valid listen address, the value of `gateway.<key>`) and
    listening, set up as hypercorn sets up its own. ListenError names the address and the key."""
    host, port = parse_listen_address(address)
    listening = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listening.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind((host, port))
        listening.listen(LISTEN_BACKLOG)
    except OSError as error:
        listening.close()
        reason = error.strerror or str(error)
        raise ListenError(f"cannot listen on {address} ({key}): {reason[:1].lower()}{reason[1:]}") from None
    listening.setblocking(False)
    return listening


async def serve_on_socket(
    app,
    listening: socket.socket,
    stopped: trio.Event,
    *,
    http2: bool = False,
    tls: tuple[str, str] | None = None,
    keep_alive_timeout: float = KEEP_ALIVE_SECONDS,
    shutdown_grace: Callable[[], float] = lambda: DEFAULT_SHUTDOWN_GRACE,
    end_streams: Callable[[], None] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` on a listening socket until `stopped` is set, then drain; HTTP/1.1 only
    unless `http2`. A connection idle for `keep_alive_timeout` seconds (no request yet, or
    none since the last answer) is closed. hypercorn takes the socket over (by its descriptor,
    as `fd://`) and closes it when serving ends: new connections are refused during the drain.
    With `tls` (a certificate file and its key file, loaded once, here) it serves HTTPS, its
    ALPN offering h2 only with `http2`.

    The drain lasts `shutdown_grace()` seconds (asked when it starts, so that a reload applies).
    Then `end_streams` has the responses still flowing end themselves (an event stream with its
    error event, and its terminating chunk), and STREAM_END_SECONDS later hypercorn closes the
    connections left (its `graceful_timeout`, else a bare cut of every stream)."""
    config = _hypercorn_config(http2)
    config.keep_alive_timeout = keep_alive_timeout
    if tls is not None:
        config.certfile, config.keyfile = tls
        config.alpn_protocols = ["h2", "http/1.1"] if http2 else ["http/1.1"]
    config.bind = [f"fd://{listening.detach()}"]

    async with trio.open_nursery() as grace:

        async def drain() -> None:
            await stopped.wait()
            seconds = shutdown_grace()
            config.graceful_timeout = seconds + STREAM_END_SECONDS  # read by hypercorn once the trigger returns
            if end_streams is not None:
                grace.start_soon(_end_streams_after, seconds, end_streams)

        await hypercorn.trio.serve(app, config, shutdown_trigger=drain, task_status=task_status, mode="asgi")
        grace.cancel_scope.cancel()


async def _end_streams_after(seconds: float, end_streams: Callable[[], None]) -> None:
    await trio.sleep(seconds)
    end_streams()


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


def run_serve(
    config_path: str, version: str, workers: Workers | None = None, overrides: Overrides = NO_OVERRIDES
) -> int:
    """The `interlock serve` entry point.

    The handled signals are `serve`'s. Outside its signal receiver (the instant before it opens,
    and once the gateway has stopped, when the receiver re-raises the signals it has not
    handled) they are ignored: a late SIGINT or SIGTERM must end neither in a KeyboardInterrupt
    traceback nor in death by signal.
    """
    prometheus_client.disable_created_metrics()  # plinth exposes no `_created` series
    for signum in HANDLED_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    return trio.run(partial(serve, config_path, version=version, workers=workers, overrides=overrides))

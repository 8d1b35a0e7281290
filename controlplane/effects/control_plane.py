"""The live control plane: one reducer task owns the state; probes and the data plane feed it events.

Who owns what (all tasks are children of `ControlPlane.run`):

- the reducer (run's own task) is the only writer of state. It takes events from one memory
  channel, numbers them, applies `reduce`, publishes the result as `ControlPlane.snapshot` (one
  attribute, replaced, never mutated), then hands the step on: the encoded event to the event
  log, the transitions to the JSON log, the metrics, the listeners, and the effects to the prober;
- the prober (`Prober`) runs one ticker for every node: each tick starts model discovery (not
  awaited) and then runs a health round (awaited, so a slow round drops ticks), with separate
  per-node in-flight guards for health and discovery. Rechecks and nodes added by a reload are
  probed at once under the same guards. A second ticker scrapes every node's load (vLLM's
  `/metrics`) at the config's load interval, none while it is 0, with its own in-flight guard.
  Every probe runs in the prober's one `Readiness` (one wait for all their sockets); probes read
  addresses, timeouts and the intervals from the current snapshot and only ever send events;
- the event-log writer (`journal.writer.LogAppender`) writes encoded events in batches
  in a worker thread, so a slow or failing disk never stalls the reducer. Each new segment
  opens with a checkpoint of the state before its first event.

Everyone else (the data plane, replay tools) reads `snapshot` and calls `observe`.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from functools import partial

import msgspec
import prometheus_client
import trio

from controlplane.infrastructure.config import NO_OVERRIDES, ConfigError, Overrides, UnknownKey, load_config
from controlplane.infrastructure.journals import open_configured_log
from controlplane.infrastructure.keyfiles import UpstreamKeys
from controlplane.infrastructure.logs import JsonLog
from controlplane.effects.metrics import ControlPlaneMetrics
from controlplane.effects.probes import ProbeClient, check_node, list_models, load_adapter, scrape_load
from controlplane.rules.reducer import INITIAL_STATE, reduce
from controlplane.rules.transitions import Effect, LoadAdapter, Recheck, StartProbing, Step, StopProbing
from events.config import Config, GatewayConfig, ModelEntry, NodeConfig
from events.log import encode_event, last_seq
from events.state import ClusterState
from events.types import (
    AdapterLoadRequested,
    Checkpoint,
    ConfigReloaded,
    Event,
    ReloadRejected,
    RunStarted,
    RunStopped,
)
from journal.writer import LogAppender
from transport.readiness import Readiness

EVENT_QUEUE_SIZE = 16_384
"""Events waiting for the reducer. Probes wait for room; data-plane observations are dropped."""

REDUCER_BATCH = 64
"""Queued events the reducer applies in a row before it lets other tasks run."""

EVENT_LOG_BACKLOG = 100_000
"""Encoded events waiting for the disk; beyond that the newest are dropped (and counted)."""

STOP_TIMEOUT = 30.0
"""How long `open_control_plane` waits for a clean stop when its caller is being cancelled."""

HANDLED_SIGNALS = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)
"""The signals `ControlPlane.serve_signals` handles."""

Listener = Callable[[Event, ClusterState, Step], None]


async def load_config_logging_unknown_keys(
    config_path: str, log: JsonLog, overrides: Overrides = NO_OVERRIDES
) -> Config:
    """`load_config` in a worker thread; each unknown key is logged as a warning (`unknown config
    key`: file, key and the closest known key), also when the file is then rejected."""
    unknown_keys: list[UnknownKey] = []
    try:
        load = partial(load_config, config_path, warn=unknown_keys.append, overrides=overrides)
        return await trio.to_thread.run_sync(load)
    finally:
        for unknown in unknown_keys:
            fields = {"file": unknown.path, "key": unknown.key}
            if unknown.closest:
                fields["did_you_mean"] = unknown.closest
            log.warn("unknown config key", **fields)


class ControlPlane:
    """The running control plane of one gateway (see the module docstring for its tasks)."""

    def __init__(
        self,
        config_path: str | os.PathLike[str],
        *,
        version: str,
        config: Config | None = None,
        overrides: Overrides = NO_OVERRIDES,
        log: JsonLog | None = None,
        registry: prometheus_client.CollectorRegistry | None = None,
        now: Callable[[], float] = time.time,
    ) -> None:
        """`config` is the file at `config_path` already loaded (by `serve`, which needs the
        listen addresses first); without it, `run` loads the file. `overrides` (the command
        line's) apply to every load, reloads included."""
        self.config_path = os.fspath(config_path)
        self._initial_config = config
        self._overrides = overrides
        self.version = version
        self._clock = now
        self.log = log if log is not None else JsonLog(clock=now)
        self.registry = registry if registry is not None else prometheus_client.CollectorRegistry()
        self.metrics = ControlPlaneMetrics(self.registry)
        self._snapshot: ClusterState = INITIAL_STATE
        self.upstream_keys = UpstreamKeys()
        self._queue_in, self._queue_out = trio.open_memory_channel[tuple[Event, trio.Event | None]](EVENT_QUEUE_SIZE)
        self._listeners: list[Listener] = []
        self._seq = 0
        self._event_log: LogAppender | None = None
        self._prober: Prober | None = None
        self._started = False
        self._stopping = False
        self._reloading = False
        self._shutting_down = False
        self._finished = trio.Event()

    @property
    def snapshot(self) -> ClusterState:
        """The current state: read it once per decision; it is replaced, never mutated."""
        return self._snapshot

    @property
    def upstream_authorizations(self) -> dict[str, bytes]:
        """The `Authorization` each node with a key file gets under the snapshot's config."""
        return self.upstream_keys.in_force

    @property
    def upstream_tls(self) -> dict[str, ssl.SSLContext]:
        """The context each https node's connections are made with under the snapshot's config."""
        return self.upstream_keys.tls_in_force

    def now(self) -> float:
        """The clock events are stamped with."""
        return self._clock()

    def stale_reason(self) -> str:
        """The control plane numbers the events itself: its state is current once it has started."""
        return "" if self._snapshot.config is not None else "the control plane has not started"

    def fleet_headers(self) -> dict[str, str]:
        """None: a single-host gateway is in no fleet."""
        return {}

    def add_listener(self, fn: Listener) -> None:
        """Call `fn(event, state, step)` in the reducer task after each publish, with the numbered
        event; it must not block."""
        self._listeners.append(fn)

    def observe(self, event: Event) -> None:
        """Hand a data-plane observation to the reducer. Never blocks or raises: when the queue
        is full the observation is dropped and counted."""
        try:
            self._queue_in.send_nowait((event, None))
        except trio.WouldBlock:
            self.metrics.observations_dropped.inc()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # stopped: nothing listens any more

    async def emit(self, event: Event) -> None:
        """Queue an event from a probe, waiting for room (back-pressure on the probes). With
        room in the queue it returns at once, without a trip through the scheduler."""
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            try:
                self._queue_in.send_nowait((event, None))
            except trio.WouldBlock:
                await self._queue_in.send((event, None))

    # --- lifecycle ---------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the config unless given (a ConfigError propagates before `started`), apply
        RunStarted, start probing, and apply events until `stop()`; returns once the event log is
        flushed."""
        if self._started or self._stopping:
            raise RuntimeError("a ControlPlane runs only once")
        self._started = True
        try:
            config = self._initial_config
            if config is None:
                config = await load_config_logging_unknown_keys(self.config_path, self.log, self._overrides)
            await self.upstream_keys.read(config)
            gateway = config.gateway
            if gateway.event_log:
                self._event_log = await self._open_event_log(gateway)
            async with ProbeClient() as client, trio.open_nursery() as nursery:
                if self._event_log is not None:
                    nursery.start_soon(self._event_log.run)
                self._apply(
                    RunStarted(
                        at=self.now(),
                        version=self.version,
                        config_path=self.config_path,
                        config=config,
                    )
                )
                self._prober = Prober(client, self)
                await nursery.start(self._prober.run)
                task_status.started()
                await self._apply_until_stopped()
                nursery.cancel_scope.cancel()  # the prober and the event-log writer
        finally:
            self._release_waiters()
            self._queue_out.close()
            if self._event_log is not None:
                with trio.CancelScope(shield=True):
                    await self._event_log.aclose()
            self._finished.set()

    async def _open_event_log(self, gateway: GatewayConfig) -> LogAppender:
        """Lock the event log (LogInUse when another gateway holds it) before writing a byte,
        and continue its numbering."""
        file = await trio.to_thread.run_sync(open_configured_log, gateway, "event_log", "event log")
        self._seq = await trio.to_thread.run_sync(_last_seq_or_zero, gateway.event_log)
        return LogAppender(
            file,
            log=self.log,
            write_errors=self.metrics.event_log_write_errors,
            dropped=self.metrics.event_log_dropped_events,
            backlog_limit=EVENT_LOG_BACKLOG,
            head=segment_head,
        )

    async def stop(self) -> None:
        """Stop probing, apply RunStopped, flush and close the event log; idempotent. Probes
        still in flight are cancelled; events they queued before RunStopped are applied."""
        if not self._stopping:
            self._stopping = True
            if not self._started:
                self._finished.set()
            else:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self._queue_in.send((RunStopped(at=self.now()), None))
        await self._finished.wait()

    async def reload(self) -> bool:
        """SIGHUP's work: re-read the config file and apply ConfigReloaded (True) or
        ReloadRejected (False). A reload while one is running is ignored (plinth's try-lock)."""
        if self._reloading:
            self.log.info("config reload already in progress; ignoring SIGHUP")
            return False
        if self._shutting_down or self._stopping or not self._started:
            return False
        self._reloading = True
        try:
            try:
                config = await load_config_logging_unknown_keys(self.config_path, self.log, self._overrides)
            except ConfigError as exc:
                event: Event = ReloadRejected(at=self.now(), config_path=self.config_path, error=str(exc))
            else:
                await self.upstream_keys.read(config)
                event = ConfigReloaded(at=self.now(), config_path=self.config_path, config=config)
            applied = trio.Event()
            try:
                await self._queue_in.send((event, applied))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return False
            await applied.wait()
            return isinstance(event, ConfigReloaded)
        finally:
            self._reloading = False

    async def serve_signals(
        self,
        signals: AsyncIterator[int] | None = None,
        *,
        before_stop: Callable[[], Awaitable[None]] | None = None,
        force: Callable[[], None] | None = None,
        on_hangup: Callable[[], None] | None = None,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Handle the gateway's signals until the control plane has stopped, then return.

        - SIGHUP: reload() (ignored once shutting down, as in plinth); first, the event log and
          `on_hangup` (the decision log) look whether their segment was moved away (logrotate);
        - the first SIGTERM or SIGINT: log `shutting down`, await `before_stop()` (the gateway
          draining its listeners: requests in flight still have a running control plane to
          report to), stop();
        - a second SIGTERM or SIGINT: log `forced shutdown`, call `force()`, which ends the drain
          at once; the stop goes on as before. Any more are ignored.

        `signals` is a receiver of HANDLED_SIGNALS opened by the caller (`serve` opens it before
        anything starts, so that no signal is lost); without it, serve_signals opens its own.
        (hypercorn installs no signal handlers; this is the gateway's only one.)
        """
        if signals is None:
            with trio.open_signal_receiver(*HANDLED_SIGNALS) as own_signals:
                await self.serve_signals(
                    own_signals, before_stop=before_stop, force=force, on_hangup=on_hangup, task_status=task_status
                )
            return
        forced = False
        async with trio.open_nursery() as nursery:

            async def shut_down() -> None:
                if before_stop is not None:
                    await before_stop()
                await self.stop()
                nursery.cancel_scope.cancel()  # stop handling signals: the gateway has stopped

            task_status.started()
            async for signum in signals:
                if signum == signal.SIGHUP:
                    if self._event_log is not None:
                        self._event_log.check_file()  # logrotate's convention: reopen a moved log
                    if on_hangup is not None:
                        on_hangup()
                    nursery.start_soon(self.reload)
                elif not self._shutting_down:
                    self._shutting_down = True
                    self.log.info("shutting down")
                    nursery.start_soon(shut_down)
                elif not forced:
                    forced = True
                    self.log.warn("forced shutdown", reason=f"second {signal.Signals(signum).name}")
                    if force is not None:
                        force()

    # --- the reducer task --------------------------------------------------------------------

    async def _apply_until_stopped(self) -> None:
        """Apply events until RunStopped. The events already waiting are taken without a
        checkpoint each (at most REDUCER_BATCH in a row): at thousands of events a second the
        scheduler round trips cost more than the reducer."""
        queue = self._queue_out
        while True:
            if self._apply_queued(await queue.receive()):
                return
            for _ in range(REDUCER_BATCH - 1):
                try:
                    item = queue.receive_nowait()
                except trio.WouldBlock:
                    break
                if self._apply_queued(item):
                    return

    def _apply_queued(self, item: tuple[Event, trio.Event | None]) -> bool:
        """Apply one event from the queue and wake whoever waits for it; True after RunStopped."""
        event, applied = item
        self._apply(event)
        if applied is not None:
            applied.set()
        return isinstance(event, RunStopped)

    def _apply(self, event: Event) -> None:
        self._seq += 1
        self.apply_numbered(msgspec.structs.replace(event, seq=self._seq))

    def apply_numbered(self, event: Event) -> None:
        """Apply an event that already has its number (this process's, or a fleet leader's):
        reduce, publish the snapshot, then hand the step to the logs, metrics, listeners and
        prober. Called by the reducer task only, once the keys of a config it puts in force are
        read (`UpstreamKeys.read`)."""
        self._seq = event.seq
        before = self._snapshot
        state, step = reduce(before, event)
        self._snapshot = state
        if state.config is not before.config:
            self.upstream_keys.take_up(state.config)
        if self._event_log is not None:
            self._event_log.submit(encode_event(event), base=before)
        if isinstance(event, (RunStarted, ConfigReloaded)):
            self.log.configure(state.config.gateway)
            if self._prober is not None:
                self._prober.config_changed()
        for transition in step.transitions:
            self.log.write(transition.at, transition.level, transition.msg, transition.log_fields())
        self.metrics.record(event, state, step)
        for listener in self._listeners:
            try:
                listener(event, state, step)
            except Exception as exc:
                self.log.error("control plane listener failed", error=f"{type(exc).__name__}: {exc}")
        if self._prober is not None:
            self._prober.run_effects(step.effects)

    def _release_waiters(self) -> None:
        """Wake reloads whose events will never be applied because the run has ended."""
        while True:
            try:
                _, applied = self._queue_out.receive_nowait()
            except trio.WouldBlock:
                return
            if applied is not None:
                applied.set()


def segment_head(state: ClusterState) -> bytes:
    """The first line of a new event-log segment: a checkpoint of the state before its first
    event (none before a run's `run_started`, which carries the whole state itself)."""
    return encode_event(Checkpoint.of(state)) if state.config is not None else b""


def _last_seq_or_zero(path: str) -> int:
    try:
        return last_seq(path)
    except OSError:
        return 0  # an unreadable log: writing it will fail too, and say so


@asynccontextmanager
async def open_control_plane(
    config_path: str | os.PathLike[str], *, kind: type[ControlPlane] | None = None, **kwargs
) -> AsyncIterator[ControlPlane]:
    """Run a ControlPlane (or a subclass: `kind`) in its own nursery until the block ends, then
    stop it cleanly (even when the block is cancelled). A ConfigError at start, or an exception
    from the block, is raised as it is (not wrapped in an ExceptionGroup)."""
    control_plane = (kind or ControlPlane)(config_path, **kwargs)
    failure: Exception | None = None
    async with trio.open_nursery() as nursery:
        try:
            await nursery.start(control_plane.run)
            try:
                yield control_plane
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(STOP_TIMEOUT):
                    await control_plane.stop()
        except Exception as exc:
            failure = exc
    if failure is not None:
        raise failure


# --- probing ---------------------------------------------------------------------------------


class Prober:
    """Runs the probes of every configured node and sends their events to the control plane.

    One ticker task for all nodes (not a sleeping task per node): per tick, discovery for
    every node is started and not awaited (plinth's discoverAll), then a health check for every
    node, and the ticker waits until that round's checks have all ended (plinth's blocking
    round). A second ticker task starts the load scrapes (`_scrape_load_ticks`). The probes are
    step generators run together by one `Readiness` (one wait for every socket, one timer), whose
    results a third task turns into events. A step's `LoadAdapter` starts the load of a LoRA
    adapter (`controlplane.rules.adapters`), a task each: they are rare, and may take long.
    """

    def __init__(self, client: ProbeClient, control_plane: ControlPlane) -> None:
        self._client = client
        self._control_plane = control_plane
        self._readiness: Readiness | None = None
        self._nursery: trio.Nursery | None = None
        self._health_in_flight: set[str] = set()
        self._models_in_flight: set[str] = set()
        self._round: set[str] = set()
        """The nodes whose health checks the current round waits for."""
        self._round_ended = trio.Event()
        self._load_in_flight: set[str] = set()
        self._adapter_loads_in_flight: set[tuple[str, str]] = set()
        """(node, adapter) of each LoRA adapter load under way."""
        self._config_changed = trio.Event()
        """Set when a reload is applied, for the load ticker to read the new interval."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._readiness = Readiness(nursery)
                self._nursery = nursery
                nursery.start_soon(self._report)
                nursery.start_soon(self._scrape_load_ticks)
                task_status.started()
                await self._tick()
        finally:
            self._nursery = None
            if self._readiness is not None:
                self._readiness.close()  # the probes still in flight: their connections close

    def run_effects(self, effects: Iterable[Effect]) -> None:
        """Start the probes a step asks for (called by the reducer task; never blocks)."""
        for effect in effects:
            if isinstance(effect, Recheck):
                self._start_probes(effect.node, discovery=False)
            elif isinstance(effect, StartProbing):
                self._start_probes(effect.node, discovery=True)
            elif isinstance(effect, LoadAdapter):
                self._start_adapter_load(effect.node, effect.adapter)
            elif isinstance(effect, StopProbing) and self._nursery is not None:
                # Rounds only probe the nodes of the current snapshot; its connections can go.
                self._nursery.start_soon(self._client.forget, effect.node)

    def _start_probes(self, ip: str, *, discovery: bool) -> None:
        if self._nursery is None:
            return  # not ticking yet: the first round probes every node
        config = self._control_plane.snapshot.config
        node = config.node(ip) if config is not None else None
        if node is None:
            return
        if discovery:
            self._start_discovery(node)
        self._start_health_check(node)

    async def _tick(self) -> None:
        tick = trio.current_time()
        while True:
            config = self._control_plane.snapshot.config
            for node in config.nodes:
                self._start_discovery(node)
            self._round_ended = trio.Event()
            for node in config.nodes:
                if self._start_health_check(node):
                    self._round.add(node.ip)
            if self._round:
                await self._round_ended.wait()
            tick = next_tick(tick, self._control_plane.snapshot.config.gateway.health_interval, trio.current_time())
            await trio.sleep_until(tick)

    def _start_health_check(self, node: NodeConfig) -> bool:
        """Start a health check unless one is in flight (skipped, not queued); True if started."""
        if node.ip in self._health_in_flight:
            return False
        self._health_in_flight.add(node.ip)
        self._readiness.start(
            (_HEALTH, node.ip), check_node(
                self._client, node, timeout=self._timeout(), now=self._control_plane.now, tls=self._tls(node.ip)
            )
        )
        return True

    def _start_discovery(self, node: NodeConfig) -> None:
        if node.ip in self._models_in_flight:
            return
        self._models_in_flight.add(node.ip)
        listing = list_models(
            self._client,
            node,
            timeout=self._timeout(),
            now=self._control_plane.now,
            authorization=self._authorization(node.ip),
            tls=self._tls(node.ip),
        )
        self._readiness.start((_MODELS, node.ip), listing)

    def _start_adapter_load(self, ip: str, name: str) -> None:
        """Load a configured LoRA adapter onto a node (a step's `LoadAdapter`), unless a load of
        it is under way there."""
        config = self._control_plane.snapshot.config
        node = config.node(ip) if config is not None else None
        adapter = config.loaded_adapters().get(name) if config is not None else None
        if self._nursery is None or node is None or adapter is None or (ip, name) in self._adapter_loads_in_flight:
            return
        self._adapter_loads_in_flight.add((ip, name))
        self._nursery.start_soon(self._load_adapter, node, adapter)

    async def _load_adapter(self, node: NodeConfig, adapter: ModelEntry) -> None:
        """One load: its request as an event, the node's answer as another, then the node's
        model list fetched again (so that routing sees the adapter at once)."""
        control_plane = self._control_plane
        try:
            requested = AdapterLoadRequested(
                at=control_plane.now(), node=node.ip, adapter=adapter.name, parent=adapter.parent,
                lora_path=adapter.lora_path,
            )  # fmt: skip
            await control_plane.emit(requested)
            answered = await load_adapter(
                self._client, node, adapter, now=control_plane.now,
                authorization=self._authorization(node.ip), tls=self._tls(node.ip),
            )  # fmt: skip
            await control_plane.emit(answered)
            self._start_discovery(node)
        finally:
            self._adapter_loads_in_flight.discard((node.ip, adapter.name))

    def config_changed(self) -> None:
        """A config was applied (called by the reducer task; never blocks)."""
        self._config_changed.set()

    async def _scrape_load_ticks(self) -> None:
        """Scrape every node's load every `load_scrape_interval()` seconds (the ticks drop as
        the health ticker's do), and nothing while it is 0. A reload that changes the interval
        takes effect at once: the next scrape is due one new interval after the last one."""
        last_tick = None
        while True:
            changed = self._config_changed = trio.Event()
            interval = self._control_plane.snapshot.config.load_scrape_interval()
            if interval <= 0:
                last_tick = None
                await changed.wait()
                continue
            due = trio.current_time() if last_tick is None else last_tick + interval
            with trio.move_on_at(due) as waiting:
                await changed.wait()
            if not waiting.cancelled_caught:
                continue  # a reload: read the interval again
            now = trio.current_time()
            last_tick = now if last_tick is None else next_tick(last_tick, interval, now)
            for node in self._control_plane.snapshot.config.nodes:
                self._start_load_scrape(node)

    def _start_load_scrape(self, node: NodeConfig) -> None:
        if node.ip in self._load_in_flight:
            return
        self._load_in_flight.add(node.ip)
        scrape = scrape_load(
            self._client,
            node,
            timeout=self._timeout(),
            now=self._control_plane.now,
            authorization=self._authorization(node.ip),
            tls=self._tls(node.ip),
        )
        self._readiness.start((_LOAD, node.ip), scrape)

    async def _report(self) -> None:
        """Send each ended probe's events, then let the node be probed again."""
        while True:
            for (kind, ip), events, error in await self._readiness.finished():
                if error is not None:
                    raise error  # the probes turn every failure into an event: this is a bug
                if kind == _HEALTH:
                    for event in events:
                        await self._control_plane.emit(event)
                    self._health_in_flight.discard(ip)
                    if ip in self._round:
                        self._round.discard(ip)
                        if not self._round:
                            self._round_ended.set()
                elif kind == _LOAD:
                    await self._control_plane.emit(events)
                    self._load_in_flight.discard(ip)
                else:
                    await self._control_plane.emit(events)
                    self._models_in_flight.discard(ip)

    def _timeout(self) -> float:
        return self._control_plane.snapshot.config.gateway.probe_timeout

    def _authorization(self, ip: str) -> bytes:
        return self._control_plane.upstream_authorizations.get(ip, b"")

    def _tls(self, ip: str) -> ssl.SSLContext | None:
        return self._control_plane.upstream_tls.get(ip)


_HEALTH, _MODELS, _LOAD = "health", "models", "load"
"""The kinds of probe a node has in flight at most one of each."""


def next_tick(last_tick: float, interval: float, now: float) -> float:
    """When the next round starts, given the tick that started the last one.

    As with Go's time.Ticker: ticks fall every `interval`; of the ticks a slow round overran,
    the latest starts the next round at once and the others are dropped.
    """
    due = last_tick + interval
    if due > now:
        return due
    return last_tick + interval * math.floor((now - last_tick) / interval)

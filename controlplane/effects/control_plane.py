"""The live control plane: one reducer task owns the state; probes and the data plane feed it events.

Who owns what (all tasks are children of `ControlPlane.run`):

- the reducer (run's own task) is the only writer of state. It takes events from the event
  queue (`EventQueue`), numbers them and applies them (`Applier`): `reduce`, the result
  published as the held state's snapshot (`HeldState`: one attribute, replaced, never mutated),
  then the step handed on: the encoded event to the event log, the transitions to the JSON
  log, the metrics, the listeners, and the effects to the prober;
- the prober (`controlplane.effects.prober.Prober`) runs one ticker for every node: each tick
  starts model discovery (not awaited) and then runs a health round (awaited, so a slow round
  drops ticks), with separate per-node in-flight guards for health and discovery. Rechecks and nodes added by a reload are
  probed at once under the same guards. A second ticker scrapes every node's load (vLLM's
  `/metrics`) at the config's load interval, none while it is 0, with its own in-flight guard.
  Every probe runs in the prober's one `Readiness` (one wait for all their sockets); probes read
  addresses, timeouts and the intervals from the current snapshot and only ever send events;
- the event-log writer (`journal.writer.LogAppender`) writes encoded events in batches
  in a worker thread, so a slow or failing disk never stalls the reducer. Each new segment
  opens with a checkpoint of the state before its first event.

Everyone else (the data plane) reads `view`, the held state: its `snapshot`, and `observe`.
A fleet replica (`fleet.replica`) is built of the same parts: the held state, the queue, the
applier, the prober, the lifecycle.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import msgspec
import prometheus_client
import trio

from controlplane.effects.applier import Applier
from controlplane.effects.event_queue import EventQueue, Queued
from controlplane.effects.held_state import HeldState
from controlplane.effects.lifecycle import Lifecycle
from controlplane.effects.metrics import ControlPlaneMetrics
from controlplane.effects.prober import Prober
from controlplane.effects.probes import ProbeClient
from controlplane.infrastructure.config import NO_OVERRIDES, ConfigError, Overrides, UnknownKey, load_config
from controlplane.infrastructure.journals import open_configured_log
from controlplane.infrastructure.logs import JsonLog
from events.config import Config, GatewayConfig
from events.log import encode_event, last_seq
from events.state import ClusterState
from events.types import Checkpoint, ConfigReloaded, Event, ReloadRejected, RunStarted, RunStopped
from journal.writer import LogAppender, SegmentedFile

REDUCER_BATCH = 64
"""Queued events the reducer applies in a row before it lets other tasks run."""

EVENT_LOG_BACKLOG = 100_000
"""Encoded events waiting for the disk; beyond that the newest are dropped (and counted)."""

STOP_TIMEOUT = 30.0
"""How long `open_control_plane` waits for a clean stop when its caller is being cancelled."""


async def load_config_logging_unknown_keys(
    config_path: str, log: JsonLog, overrides: Overrides = NO_OVERRIDES
) -> Config:
    """`load_config` in a worker thread; each unknown key is logged as a warning (`unknown config
    key`: file, key and the closest known key), also when the file is then rejected. Cancelled,
    it leaves the thread to end by itself (a read may wait for ever: a FIFO nobody writes)."""
    unknown_keys: list[UnknownKey] = []
    try:
        load = partial(load_config, config_path, warn=unknown_keys.append, overrides=overrides)
        return await trio.to_thread.run_sync(load, abandon_on_cancel=True)
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
        self.log = log if log is not None else JsonLog(clock=now)
        self.registry = registry if registry is not None else prometheus_client.CollectorRegistry()
        self.metrics = ControlPlaneMetrics(self.registry)
        self.queue = EventQueue(self.metrics.observations_dropped)
        self.view = HeldState(now=now, observe=self.queue.observe, stale_reason=self._stale_reason)
        """What the data plane reads (`dataplane.control.ControlPlaneView`)."""
        self.applier = Applier(self.view, self.log, self.metrics)
        self.lifecycle = Lifecycle(self.log, reload=self.reload, stop=self.stop, reopen_logs=self._reopen_logs)
        """Its run, stop, reload, and the gateway's signals (`lifecycle.serve_signals`)."""
        self._seq = 0
        self._reloading = False

    def _stale_reason(self) -> str:
        """The control plane numbers the events itself: its state is current once it has started."""
        return "" if self.view.snapshot.config is not None else "the control plane has not started"

    # --- lifecycle ---------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the config unless given (a ConfigError propagates before `started`), apply
        RunStarted, start probing, and apply events until `stop()`; returns once the event log is
        flushed."""
        self.lifecycle.start()
        applier = self.applier
        try:
            config = self._initial_config
            if config is None:
                config = await load_config_logging_unknown_keys(self.config_path, self.log, self._overrides)
            await self.view.upstream_keys.read(config)
            gateway = config.gateway
            if gateway.event_log:
                applier.event_log = await self._open_event_log(gateway)
            async with ProbeClient() as client, trio.open_nursery() as nursery:
                if applier.event_log is not None:
                    nursery.start_soon(applier.event_log.run)
                self._apply(
                    RunStarted(
                        at=self.view.now(),
                        version=self.version,
                        config_path=self.config_path,
                        config=config,
                    )
                )
                applier.prober = Prober(client, self.view, self.queue.emit)
                await nursery.start(applier.prober.run)
                task_status.started()
                await self._apply_until_stopped()
                nursery.cancel_scope.cancel()  # the prober and the event-log writer
        finally:
            self.queue.close()
            if applier.event_log is not None:
                with trio.CancelScope(shield=True):
                    await applier.event_log.aclose()
            self.lifecycle.finished.set()

    async def _open_event_log(self, gateway: GatewayConfig) -> LogAppender:
        """Lock the event log (LogInUse when another gateway holds it) before writing a byte,
        and continue its numbering."""
        file = await trio.to_thread.run_sync(open_configured_log, gateway, "event_log", "event log")
        self._seq = await trio.to_thread.run_sync(_last_seq_or_zero, gateway.event_log)
        return event_log_appender(file, self.log, self.metrics)

    async def stop(self) -> None:
        """Stop probing, apply RunStopped, flush and close the event log; idempotent. Probes
        still in flight are cancelled; events they queued before RunStopped are applied."""
        if self.lifecycle.stop() and self.lifecycle.started:
            await self.queue.emit(RunStopped(at=self.view.now()))
        await self.lifecycle.finished.wait()

    async def reload(self) -> bool:
        """SIGHUP's work: re-read the config file and apply ConfigReloaded (True) or
        ReloadRejected (False). A reload while one is running is ignored (plinth's try-lock)."""
        if self._reloading:
            self.log.info("config reload already in progress; ignoring SIGHUP")
            return False
        if not self.lifecycle.may_reload:
            return False
        self._reloading = True
        try:
            try:
                config = await load_config_logging_unknown_keys(self.config_path, self.log, self._overrides)
            except ConfigError as exc:
                event: Event = ReloadRejected(at=self.view.now(), config_path=self.config_path, error=str(exc))
            else:
                await self.view.upstream_keys.read(config)
                event = ConfigReloaded(at=self.view.now(), config_path=self.config_path, config=config)
            return await self.queue.emit_and_wait(event) and isinstance(event, ConfigReloaded)
        finally:
            self._reloading = False

    def _reopen_logs(self) -> None:
        if self.applier.event_log is not None:
            self.applier.event_log.check_file()  # logrotate's convention: reopen a moved log

    # --- the reducer task --------------------------------------------------------------------

    async def _apply_until_stopped(self) -> None:
        """Apply events until RunStopped. The events already waiting are taken without a
        checkpoint each (at most REDUCER_BATCH in a row): at thousands of events a second the
        scheduler round trips cost more than the reducer."""
        queue = self.queue
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

    def _apply_queued(self, item: Queued) -> bool:
        """Apply one event from the queue and wake whoever waits for it; True after RunStopped."""
        event, applied = item
        self._apply(event)
        if applied is not None:
            applied.set()
        return isinstance(event, RunStopped)

    def _apply(self, event: Event) -> None:
        self._seq += 1
        self.applier.apply(msgspec.structs.replace(event, seq=self._seq))


def event_log_appender(file: SegmentedFile, log: JsonLog, metrics: ControlPlaneMetrics) -> LogAppender:
    """An event log's appender (the gateway's, or a fleet replica's partition's): batched off
    the trio thread, bounded by EVENT_LOG_BACKLOG, each segment opening with a checkpoint of
    the state before its first event."""
    return LogAppender(
        file,
        log=log,
        write_errors=metrics.event_log_write_errors,
        dropped=metrics.event_log_dropped_events,
        backlog_limit=EVENT_LOG_BACKLOG,
        head=segment_head,
    )


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
    config_path: str | os.PathLike[str], *, kind: Callable[..., Any] | None = None, **kwargs
) -> AsyncIterator[Any]:
    """Run a ControlPlane (or another kind with its `run` and `stop`: `fleet.replica`'s) in its
    own nursery until the block ends, then stop it cleanly (even when the block is cancelled). A
    ConfigError at start, or an exception from the block, is raised as it is (not wrapped in an
    ExceptionGroup)."""
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


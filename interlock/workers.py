"""`serve --workers N`: the leader's side. Worker processes serve the API and follow its events.

The leader (the process the operator starts) owns the probes, the reducer's numbering, the
event and decision logs, the metrics listener, the signals, and the workers' lifecycle. Each
worker is a process of its own (`interlock.worker`) serving the API listener, which the leader
binds once and every worker inherits: a connection waits in one accept queue until a worker that
is free to take it does, a worker that dies leaves its waiting connections to the others, and a
restarted worker needs no port of its own. (With SO_REUSEPORT the kernel would hash
connections to workers whatever their load, and drop the ones queued on a dying worker.)

Each worker has a socketpair to the leader. Down it, the leader sends a checkpoint (its state at
the moment the worker is registered) and then every numbered event after it, in order, encoded
as in the event log; the worker applies them with the same `reduce`, so it holds the leader's
state at every seq. A leader that is a fleet replica also sends its `ReplicaStatus` whenever it
changes (its name, the fleet's leader, why its state may not be current), which the worker's
`/health` and `/ready` answer with. Up it, the worker sends what its requests observed (a node refused a
connection, or answered again), which the leader numbers like any event, and its decision
records, which the leader appends to the one decision log.

A worker that exits is started again (after a pause, if it keeps dying) and catches up from a
new checkpoint. A worker whose leader is gone (its socket ends) drains and exits. SIGTERM to the
leader drains every worker before the control plane stops.
"""

from __future__ import annotations

import glob
import os
import signal
import socket
import sys
from collections.abc import Callable
from functools import partial

import msgspec
import prometheus_client
import trio
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from controlplane.infrastructure.logs import JsonLog
from controlplane.effects.control_plane import ControlPlane
from dataplane.admission.quota import LeaseAuthority, QuotaAsk, QuotaGrant, QuotaReturn
from dataplane.admission.tenants import TenantLimits
from events.decisions import Decision
from events.log import encode_event
from events.state import ClusterState
from events.types import Checkpoint, Event, UpstreamFailed, UpstreamRecovered
from journal.stream import receive_lines

RESTART_PAUSE_SECONDS = 1.0
"""How long the leader waits before starting a worker again that ran for less than this."""

MAX_LAG_EVENTS = 100_000
"""Events a worker may fall behind before the leader restarts it (it catches up from a checkpoint)."""

REPLICA_STATUS_SECONDS = 0.5
"""How often the leader looks whether its `ReplicaStatus` has changed."""

STOP_MARGIN_SECONDS = 5.0
"""How much longer than a worker's own drain the leader waits for it after SIGTERM before it
kills it."""


class DecisionMade(msgspec.Struct, frozen=True, tag="decision", tag_field="type"):
    """A worker's decision record, on its way to the leader's decision log."""

    record: Decision


class ReplicaStatus(msgspec.Struct, frozen=True, tag="replica_status", tag_field="type"):
    """What a leader that is a fleet replica says of itself to its workers: the `/health`
    headers naming it and the fleet's leader, and why its state may not be current ("")."""

    headers: dict[str, str]
    stale: str


NOT_IN_A_FLEET = ReplicaStatus(headers={}, stale="")

Report = UpstreamFailed | UpstreamRecovered | DecisionMade | QuotaAsk | QuotaReturn
"""What a worker sends its leader."""

encode_report = msgspec.json.Encoder().encode
decode_report = msgspec.json.Decoder(Report).decode
encode_status = msgspec.json.Encoder().encode
encode_grant = msgspec.json.Encoder().encode
decode_from_leader = msgspec.json.Decoder(Event | ReplicaStatus | QuotaGrant).decode
"""A line down a worker's socketpair: an event (as in the event log), a `ReplicaStatus`, or a
`QuotaGrant` (the leader's answer to the worker's `QuotaAsk`, `dataplane.admission.quota`)."""


def usable_cores() -> int:
    """The cores this process may run on (`workers = "auto"`)."""
    return len(os.sched_getaffinity(0))


class WorkerMetrics:
    """The leader's own metrics about its workers."""

    def __init__(self, registry: prometheus_client.CollectorRegistry) -> None:
        self.restarts = prometheus_client.Counter(
            "interlock_worker_restarts_total", "Worker processes started again after they exited", registry=registry
        )
        self.running = prometheus_client.Gauge(
            "interlock_workers_running", "Worker processes running", registry=registry
        )


class WorkerSamples(MultiProcessCollector):
    """The workers' request metrics, read from their sample files, leaving out a file a worker is
    still creating: it is empty until its creator sizes it (and stays empty if the worker dies in
    between), and prometheus_client would fail the whole scrape on it (client_python #1199)."""

    def __init__(self, registry: prometheus_client.CollectorRegistry, path: str) -> None:
        self.directory = path  # set first: registering collects
        super().__init__(registry, path=path)

    def collect(self):
        files = [path for path in glob.glob(os.path.join(self.directory, "*.db")) if os.path.getsize(path) > 0]
        return self.merge(files, accumulate=True)


class _Link:
    """The leader's end of one worker's socketpair: events go down, reports come up."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._pending: list[bytes] = []
        self._wakeup = trio.Event()
        self.lagging = False

    def push(self, line: bytes) -> None:
        """Queue one encoded event; never blocks (a worker too far behind is marked lagging)."""
        if len(self._pending) >= MAX_LAG_EVENTS:
            self.lagging = True
            self._wakeup.set()
            return
        self._pending.append(line)
        self._wakeup.set()

    async def send_events(self) -> None:
        """Send the queued events in order until the worker's end closes, or it lags."""
        while not self.lagging:
            await self._wakeup.wait()
            self._wakeup = trio.Event()
            batch, self._pending = self._pending, []
            if batch:
                try:
                    await self.stream.send_all(b"".join(batch))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return

    async def receive_reports(self, handle: Callable[[Report], None]) -> None:
        """Hand every report line to `handle` until the worker's end closes."""
        async for line in receive_lines(self.stream):
            handle(decode_report(line))


class WorkerPool:
    """Starts, feeds, watches and stops the worker processes of one gateway."""

    def __init__(
        self,
        control_plane: ControlPlane,
        api_socket: socket.socket,
        count: int,
        *,
        log: JsonLog,
        record_decision: Callable[[Decision], None],
        metrics: WorkerMetrics,
        metrics_dir: str,
        tls: tuple[str, str] | None = None,
    ) -> None:
        """`tls`: the API listener's certificate and key files, handed to each worker (this
        process's own: a fleet's config does not carry a replica's)."""
        self._control_plane = control_plane
        self._tls = tls
        self._api_socket = api_socket
        self._count = count
        self._log = log
        self._record_decision = record_decision
        self._metrics = metrics
        self._metrics_dir = metrics_dir
        self._links: dict[int, _Link] = {}
        self._processes: dict[int, trio.Process] = {}
        self._stopping = False
        self._finished = trio.Event()
        self._status = NOT_IN_A_FLEET
        self._sharing_status = trio.CancelScope()
        self._tenant_limits = TenantLimits(control_plane.view.snapshot.config)
        self.leases = LeaseAuthority(self._quota_limits)
        """The host's tenant quota: the workers lease it (`dataplane.admission.quota`)."""
        control_plane.applier.add_listener(self._fan_out)

    def _quota_limits(self) -> dict[tuple[str, str], int]:
        """The limits of the config in force, computed once per config."""
        config = self._control_plane.view.snapshot.config
        if self._tenant_limits.config is not config:
            self._tenant_limits = TenantLimits(config)
        return self._tenant_limits.quota_limits

    def _fan_out(self, event: Event, state: ClusterState, step: object) -> None:
        """Every applied event, to every registered worker (called in the reducer task)."""
        if self._links:
            line = encode_event(event)
            for link in self._links.values():
                link.push(line)

    async def _share_replica_status(self) -> None:
        """Send the control plane's `ReplicaStatus` to every worker when it changes (never off
        a fleet: a single host's is always NOT_IN_A_FLEET once it runs)."""
        with self._sharing_status:
            while True:
                status = ReplicaStatus(self._control_plane.view.fleet_headers(), self._control_plane.view.stale_reason())
                if status != self._status:
                    self._status = status
                    line = encode_status(status) + b"\n"
                    for link in self._links.values():
                        link.push(line)
                await trio.sleep(REPLICA_STATUS_SECONDS)

    def _handle_report(self, index: int, link: _Link, report: Report) -> None:
        if isinstance(report, DecisionMade):
            self._record_decision(report.record)
        elif isinstance(report, QuotaAsk):
            link.push(encode_grant(self.leases.ask(index, report)) + b"\n")
        elif isinstance(report, QuotaReturn):
            self.leases.returned(index, report)
        else:
            self._control_plane.view.observe(report)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep `count` workers running until `stop()`; `started` once each has been launched."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._share_replica_status)
                for index in range(1, self._count + 1):
                    await nursery.start(self._supervise, index)
                task_status.started()
        finally:
            self._finished.set()

    async def stop(self, drain_seconds: float) -> None:
        """Drain every worker (SIGTERM), killing those still running STOP_MARGIN_SECONDS after
        their drain (`drain_seconds` long) should have ended."""
        self._stopping = True
        self._sharing_status.cancel()
        for process in self._processes.values():
            _signal(process, signal.SIGTERM)
        with trio.move_on_after(drain_seconds + STOP_MARGIN_SECONDS):
            await self._finished.wait()
        for process in self._processes.values():
            _signal(process, signal.SIGKILL)
        await self._finished.wait()

    async def _supervise(self, index: int, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        while not self._stopping:
            started_at = trio.current_time()
            exit_code = await self._run_worker(index, task_status)
            task_status = trio.TASK_STATUS_IGNORED
            if self._stopping:
                return
            self._metrics.restarts.inc()
            self._log.error("worker exited; starting it again", worker=index, code=exit_code)
            if trio.current_time() - started_at < RESTART_PAUSE_SECONDS:
                await trio.sleep(RESTART_PAUSE_SECONDS)

    async def _run_worker(self, index: int, task_status: trio.TaskStatus[None]) -> int:
        """Start worker `index`, feed it until it exits; its exit code."""
        leader_end, worker_end = socket.socketpair()
        link = _Link(trio.SocketStream(trio.socket.from_stdlib_socket(leader_end)))
        # No checkpoint between reading the snapshot and registering: the worker gets the state
        # at seq S, then every event after S.
        link.push(encode_event(Checkpoint.of(self._control_plane.view.snapshot)))
        if self._status != NOT_IN_A_FLEET:
            link.push(encode_status(self._status) + b"\n")
        self._links[index] = link
        try:
            with worker_end:
                process = await trio.lowlevel.open_process(
                    [
                        sys.executable, "-m", "interlock.worker",
                        "--index", str(index),
                        "--api-fd", str(self._api_socket.fileno()),
                        "--leader-fd", str(worker_end.fileno()),
                        *(("--tls-certificate", self._tls[0], "--tls-key", self._tls[1]) if self._tls else ()),
                    ],  # fmt: skip
                    pass_fds=(self._api_socket.fileno(), worker_end.fileno()),
                    env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": self._metrics_dir},
                )
            self._processes[index] = process
            self._metrics.running.inc()
            self._log.info("worker started", worker=index, pid=process.pid)
            task_status.started()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._feed, link, process)
                nursery.start_soon(link.receive_reports, partial(self._handle_report, index, link))
                try:
                    await process.wait()
                finally:
                    if process.returncode is None:  # cancelled (a forced shutdown): the worker goes too
                        process.kill()
                        with trio.CancelScope(shield=True):
                            await process.wait()
                nursery.cancel_scope.cancel()
            return process.returncode
        finally:
            del self._links[index]
            self.leases.worker_gone(index)
            if (process := self._processes.pop(index, None)) is not None:
                self._metrics.running.dec()
                mark_process_dead(process.pid, self._metrics_dir)  # its requests are no longer in flight
            await link.stream.aclose()

    async def _feed(self, link: _Link, process: trio.Process) -> None:
        await link.send_events()
        if link.lagging:
            self._log.error("worker fell behind the event stream; restarting it", pid=process.pid)
            _signal(process, signal.SIGKILL)


def _signal(process: trio.Process, signum: int) -> None:
    if process.returncode is None:
        try:
            process.send_signal(signum)
        except ProcessLookupError:
            pass

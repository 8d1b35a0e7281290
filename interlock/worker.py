"""One worker process of `serve --workers N` (started by the leader, `interlock.workers`).

It serves the API on the listening socket it inherits, routing on the state it follows from the
leader's events (`controlplane.effects.follower`), and reports its observations and decision records to
the leader. It stops when told to (SIGTERM: drain, then exit) or when its leader is gone (the
leader's socket ends, or breaks as the worker writes to it: drain, then exit, dropping the
reports from then on). SIGINT and SIGHUP are the leader's to act on: a Ctrl-C
in a terminal reaches every process of the group, and the leader then stops its workers in order.

    python -m interlock.worker --index N --api-fd FD --leader-fd FD
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys

import prometheus_client
import trio

from controlplane.effects.follower import Follower, OutOfStep
from controlplane.infrastructure.logs import JsonLog
from dataplane.admission.quota import LeasedQuota, QuotaGrant
from events.decisions import Decision
from events.types import Checkpoint
from interlock.serve import api_application, serve_on_socket
from interlock.workers import DecisionMade, ReplicaStatus, Report, decode_from_leader, encode_report
from journal.stream import frame_lines, receive_lines

REPORT_BACKLOG = 10_000
"""Reports waiting to go to the leader; beyond that they are dropped (and counted in the log)."""

EXIT_OUT_OF_STEP = 3


class _Reports:
    """What goes up to the leader: observations and decision records, never blocking a request."""

    def __init__(self, log: JsonLog) -> None:
        self._log = log
        self._send, self._receive = trio.open_memory_channel[Report](REPORT_BACKLOG)
        self.dropped = 0

    def report(self, item: Report) -> None:
        try:
            self._send.send_nowait(item)
        except trio.WouldBlock:
            self.dropped += 1
        except trio.BrokenResourceError:
            pass  # the leader is gone (`send_to` returned): nobody to report to

    def record(self, decision: Decision) -> None:
        """The data plane's decision log, as far as this worker is concerned (its records named
        and numbered by `NumberedRecords`)."""
        self.report(DecisionMade(decision))

    async def send_to(self, leader: trio.SocketStream) -> None:
        """Send the reports as they come; returns when the leader is gone, after which the
        reports are dropped as they are made."""
        async for first in self._receive:
            batch = [first]
            while True:
                try:
                    batch.append(self._receive.receive_nowait())
                except trio.WouldBlock:
                    break
            try:
                await leader.send_all(frame_lines(map(encode_report, batch)))
            except trio.BrokenResourceError:
                self._receive.close()
                return
            if self.dropped:
                self._log.warn("reports to the leader dropped", dropped=self.dropped)
                self.dropped = 0


async def _events(leader: trio.SocketStream):
    """The leader's events (and, from a fleet replica, its `ReplicaStatus`), decoded, until its
    end closes."""
    async for line in receive_lines(leader):
        yield decode_from_leader(line)


async def run_worker(
    index: int, api_socket: socket.socket, leader_socket: socket.socket, log: JsonLog, tls: tuple[str, str] | None = None
) -> int:
    """Serve until SIGTERM or the leader's end of the socketpair closes; the exit code. `tls`:
    the API listener's certificate and key files, its leader's own (in a fleet, the replica's
    file's, which the fleet's config does not carry)."""
    leader = trio.SocketStream(trio.socket.from_stdlib_socket(leader_socket))
    reports = _Reports(log)
    leases = LeasedQuota(reports.report)
    follower = Follower(reports.report)
    events = _events(leader)
    first = await anext(events, None)
    if not isinstance(first, Checkpoint):
        log.error("worker got no checkpoint from the leader")
        return EXIT_OUT_OF_STEP
    await follower.view.upstream_keys.read_before(first)
    follower.apply(first)
    _follow_log_settings(log, follower)
    stop = trio.Event()
    exit_code = 0

    def leader_gone() -> None:
        """Its socket ended (a read saw the end, or a write found it broken): drain and exit."""
        follower.mark_stale("the leader is gone")
        if not stop.is_set():
            log.warn("leader gone: finishing the requests in flight, then exiting")
        stop.set()

    async def follow() -> None:
        """Apply the leader's events in order, each config's upstream keys read (in a thread)
        before the event that puts it in force; the log follows the config in force, as the
        leader's does."""
        nonlocal exit_code
        try:
            async for event in events:
                if isinstance(event, ReplicaStatus):
                    follower.follow_replica(event.headers, event.stale)
                    continue
                if isinstance(event, QuotaGrant):
                    leases.granted(event)
                    continue
                await follower.view.upstream_keys.read_before(event)
                config = follower.view.snapshot.config
                follower.apply(event)
                if follower.view.snapshot.config is not config:
                    _follow_log_settings(log, follower)
        except OutOfStep as error:
            log.error("worker out of step with the leader", error=str(error))
            follower.mark_stale("out of step with the leader")
            exit_code = EXIT_OUT_OF_STEP
            stop.set()  # we cannot follow it: drain and exit
            return
        leader_gone()

    async def report() -> None:
        await reports.send_to(leader)
        leader_gone()

    async def stop_on_sigterm() -> None:
        with trio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                stop.set()
                return

    async with (
        api_application(follower.view, log, reports, worker=index, quota=leases) as api_app,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(follow)
        nursery.start_soon(leases.return_unused)
        nursery.start_soon(report)
        nursery.start_soon(stop_on_sigterm)
        await serve_on_socket(
            api_app,
            api_socket,
            stop,
            http2=follower.view.snapshot.config.gateway.http2,
            tls=tls,
            shutdown_grace=lambda: follower.view.snapshot.config.gateway.shutdown_grace,
            end_streams=api_app.end_streams,
        )
        nursery.cancel_scope.cancel()
    return exit_code


def _follow_log_settings(log: JsonLog, follower: Follower) -> None:
    """The leader's log level and format, from the config in force."""
    if follower.view.snapshot.config is not None:
        log.configure(follower.view.snapshot.config.gateway)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="interlock.worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--api-fd", type=int, required=True)
    parser.add_argument("--leader-fd", type=int, required=True)
    parser.add_argument("--tls-certificate", help="the API listener's certificate file (HTTPS, with --tls-key)")
    parser.add_argument("--tls-key", help="the API listener's key file")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    prometheus_client.disable_created_metrics()
    api_socket = socket.socket(fileno=args.api_fd)
    leader_socket = socket.socket(fileno=args.leader_fd)
    tls = (args.tls_certificate, args.tls_key) if args.tls_certificate else None
    log = JsonLog(context={"worker": args.index})
    return trio.run(run_worker, args.index, api_socket, leader_socket, log, tls)


if __name__ == "__main__":
    sys.exit(main())

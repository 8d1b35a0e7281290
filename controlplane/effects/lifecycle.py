"""Where a control plane (the gateway's, or a fleet replica's) is in its life, and the signals
that move it on: it runs once; SIGHUP reloads its config while it runs; the first SIGTERM or
SIGINT shuts the gateway down (drain, then stop), a second forces the drain to end."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Awaitable, Callable

import trio

from controlplane.infrastructure.logs import JsonLog

HANDLED_SIGNALS = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)
"""The signals `Lifecycle.serve_signals` handles."""


class Lifecycle:
    def __init__(
        self,
        log: JsonLog,
        *,
        reload: Callable[[], Awaitable[object]],
        stop: Callable[[], Awaitable[None]],
        reopen_logs: Callable[[], None] = lambda: None,
    ) -> None:
        """The owner's `reload` and `stop`, which the signals call, and what looks whether the
        owner's logs were moved away (SIGHUP: logrotate's convention)."""
        self._log = log
        self._reload = reload
        self._stop = stop
        self._reopen_logs = reopen_logs
        self.started = False
        self.stopping = False
        self.shutting_down = False
        """Set by the first SIGTERM or SIGINT: no reload from then on (as in plinth)."""
        self.finished = trio.Event()
        """Set once the run has ended (or, stopped before it started, at once)."""

    def start(self) -> None:
        """The run begins; a control plane runs only once."""
        if self.started or self.stopping:
            raise RuntimeError("a control plane runs only once")
        self.started = True

    def stop(self) -> bool:
        """The stop begins; False when it had begun already. Stopped before it started, the
        run counts as finished."""
        if self.stopping:
            return False
        self.stopping = True
        if not self.started:
            self.finished.set()
        return True

    @property
    def may_reload(self) -> bool:
        return self.started and not self.stopping and not self.shutting_down

    async def serve_signals(
        self,
        signals: AsyncIterator[int] | None = None,
        *,
        on_hangup: Callable[[], None] | None = None,
        before_stop: Callable[[], Awaitable[None]] | None = None,
        force: Callable[[], None] | None = None,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Handle the gateway's signals until the control plane has stopped, then return.

        - SIGHUP: the owner's logs, then `on_hangup` (the decision log), look whether their
          segment was moved away (logrotate's convention); then reload (ignored once shutting
          down, as in plinth);
        - the first SIGTERM or SIGINT: log `shutting down`, await `before_stop()` (the gateway
          draining its listeners: requests in flight still have a running control plane to
          report to), stop;
        - a second SIGTERM or SIGINT: log `forced shutdown`, call `force()`, which ends the drain
          at once; the stop goes on as before. Any more are ignored.

        `signals` is a receiver of HANDLED_SIGNALS opened by the caller (`serve` opens it before
        anything starts, so that no signal is lost); without it, serve_signals opens its own.
        (hypercorn installs no signal handlers; this is the gateway's only one.)
        """
        if signals is None:
            with trio.open_signal_receiver(*HANDLED_SIGNALS) as own_signals:
                await self.serve_signals(
                    own_signals, on_hangup=on_hangup, before_stop=before_stop, force=force, task_status=task_status
                )
            return
        forced = False
        async with trio.open_nursery() as nursery:

            async def shut_down() -> None:
                if before_stop is not None:
                    await before_stop()
                await self._stop()
                nursery.cancel_scope.cancel()  # stop handling signals: the gateway has stopped

            task_status.started()
            async for signum in signals:
                if signum == signal.SIGHUP:
                    self._reopen_logs()
                    if on_hangup is not None:
                        on_hangup()
                    nursery.start_soon(self._reload)
                elif not self.shutting_down:
                    self.shutting_down = True
                    self._log.info("shutting down")
                    nursery.start_soon(shut_down)
                elif not forced:
                    forced = True
                    self._log.warn("forced shutdown", reason=f"second {signal.Signals(signum).name}")
                    if force is not None:
                        force()

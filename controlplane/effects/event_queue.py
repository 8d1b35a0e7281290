"""Events on their way to be numbered: the gateway's reducer task takes them, or, in a fleet,
the leader's appends. Probes wait for room; a data-plane observation never waits (with the
queue full it is dropped and counted); a reload waits until its event is applied."""

from __future__ import annotations

import contextlib

import prometheus_client
import trio

from events.types import Event

EVENT_QUEUE_SIZE = 16_384
"""Events waiting to be numbered. Probes wait for room; data-plane observations are dropped."""

Queued = tuple[Event, trio.Event | None]
"""An event, and what to set once it is applied (or appended), for whoever waits for it."""


class EventQueue:
    def __init__(self, dropped: prometheus_client.Counter) -> None:
        """`dropped` counts the observations dropped because the queue was full."""
        self._in, self._out = trio.open_memory_channel[Queued](EVENT_QUEUE_SIZE)
        self._dropped = dropped

    def observe(self, event: Event) -> None:
        """Queue a data-plane observation. Never blocks or raises: when the queue is full the
        observation is dropped and counted."""
        try:
            self._in.send_nowait((event, None))
        except trio.WouldBlock:
            self._dropped.inc()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # stopped: nothing listens any more

    async def emit(self, event: Event) -> None:
        """Queue an event from a probe, waiting for room (back-pressure on the probes). With
        room in the queue it returns at once, without a trip through the scheduler."""
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            try:
                self._in.send_nowait((event, None))
            except trio.WouldBlock:
                await self._in.send((event, None))

    async def emit_and_wait(self, event: Event) -> bool:
        """Queue an event and wait until it is applied; False when the queue has closed."""
        applied = trio.Event()
        try:
            await self._in.send((event, applied))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        await applied.wait()
        return True

    async def receive(self) -> Queued:
        return await self._out.receive()

    def receive_nowait(self) -> Queued:
        """The next event waiting; trio.WouldBlock when none is."""
        return self._out.receive_nowait()

    def close(self) -> None:
        """No more events are taken; whoever waits for one left in the queue is woken."""
        while True:
            try:
                _, applied = self._out.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            if applied is not None:
                applied.set()
        self._out.close()

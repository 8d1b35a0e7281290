"""Many non-blocking step generators driven by one trio task, with one wait for all of their
sockets.

A step generator (`Steps`) does its socket work without blocking and yields a `Wait` (this
socket, readable or writable, by this deadline) whenever it cannot go on; it is sent the
readiness it waited for, or has `TimedOut` thrown in once the deadline has passed, and returns
its result. Written so, a thousand probes cost one epoll set, one trio wait per batch of ready
sockets and one timer, where a trio task per probe costs a task, a cancel scope and a trio wait
(with its epoll registration) per request.

- `Readiness` runs any number of step generators together: `start` one (its first step runs at
  once), and `finished()` waits until some have ended and returns their results (or
  exceptions). They make progress only while a task waits in `finished()`.
- `drive` runs one step generator in the calling task (a one-off request).

A step generator may also yield a `Lookup` (a host name to resolve) or an `InThread` (work too
long for the event loop, such as parsing a large answer); `Readiness` does either in a task of
the nursery it was given.

With many step generators waiting (GATHER_FROM or more), `finished()` looks at the sockets at
most once every GATHER_SECONDS: a thousand probes against nodes that answer one at a time would
otherwise wake the task for one or two sockets each time, and the wake-ups, not the probes, would
take most of the CPU. The cost is that a result is seen up to GATHER_SECONDS late, so a probe's
measured latency can include it, and a deadline can pass by as much before it is acted on.
"""

from __future__ import annotations

import heapq
import math
import select
import socket
from collections.abc import Callable, Generator, Hashable
from typing import Any, NamedTuple

import trio

READ = select.EPOLLIN
WRITE = select.EPOLLOUT
_ONESHOT = select.EPOLLONESHOT

GATHER_FROM = 32
GATHER_SECONDS = 0.002
"""With at least GATHER_FROM step generators waiting, the sockets are looked at every GATHER_SECONDS
at most (see the module docstring)."""


class Wait(NamedTuple):
    """What a step generator waits for: `socket` readable (READ) or writable (WRITE), until
    `deadline` (trio's clock)."""

    socket: socket.socket
    events: int
    deadline: float


class Lookup(NamedTuple):
    """What a step generator waits for: the addresses of a host name; it is sent `getaddrinfo`'s
    list, or has its OSError thrown in."""

    host: str
    port: int


class InThread(NamedTuple):
    """What a step generator waits for: `function(argument)`, run in a worker thread; it is sent the
    result, or has the exception thrown in."""

    function: Callable[[Any], Any]
    argument: Any


class TimedOut(Exception):
    """Thrown into a step generator whose deadline passed while it waited."""


Steps = Generator[Wait | Lookup | InThread, Any, Any]


async def drive(steps: Steps) -> Any:
    """Run one step generator in the calling task and return its result (or raise its exception)."""
    sent: Any = None
    thrown: BaseException | None = None
    while True:
        try:
            want = steps.throw(thrown) if thrown is not None else steps.send(sent)
        except StopIteration as done:
            return done.value
        sent, thrown = None, None
        if isinstance(want, Lookup | InThread):
            sent, thrown = await _in_task(want)
            continue
        with trio.move_on_at(want.deadline):
            if want.events & WRITE:
                await trio.lowlevel.wait_writable(want.socket)
            else:
                await trio.lowlevel.wait_readable(want.socket)
            sent = want.events
            continue
        thrown = TimedOut()


async def _in_task(want: Lookup | InThread) -> tuple[Any, Exception | None]:
    """What to send or throw into a step generator that yielded `want`."""
    if isinstance(want, Lookup):
        try:
            return await trio.socket.getaddrinfo(want.host, want.port, type=trio.socket.SOCK_STREAM), None
        except OSError as error:
            return None, error
    try:
        return await trio.to_thread.run_sync(want.function, want.argument), None
    except Exception as error:
        return None, error


class _Running:
    """One step generator in a `Readiness`: what it waits for, and whether that wait is still
    current."""

    __slots__ = ("key", "steps", "waiting_on", "deadline")

    def __init__(self, key: Hashable, steps: Steps) -> None:
        self.key = key
        self.steps = steps
        self.waiting_on = -1
        """The file descriptor it waits on, or -1 once it has finished."""
        self.deadline = math.inf


class Readiness:
    """Step generators run together: every socket they wait on is in one epoll set (armed one-shot),
    and the task that calls `finished()` makes one trio wait on that set, bounded by the earliest
    deadline. Not thread-safe; one trio run. `close()` ends every step generator still running."""

    def __init__(self, tasks: trio.Nursery) -> None:
        """`tasks` runs the tasks that resolve host names and wait for threads."""
        self._tasks = tasks
        self._in_tasks: set[_Running] = set()
        self._epoll = select.epoll()
        self._waiting: dict[int, _Running] = {}
        self._deadlines: list[tuple[float, int, _Running]] = []
        self._order = 0
        self._finished: list[tuple[Hashable, Any, BaseException | None]] = []
        self._wait_scope: trio.CancelScope | None = None
        self._looked_at = -math.inf
        """When `finished()` last looked at which sockets were ready."""

    def __len__(self) -> int:
        """Step generators started and not finished."""
        return len(self._waiting)

    def start(self, key: Hashable, steps: Steps) -> None:
        """Run `steps`' first step now; `finished()` reports its result under `key`."""
        self._step(_Running(key, steps), None, None)
        self._wake_if_finished()

    def _wake_if_finished(self) -> None:
        if self._finished and self._wait_scope is not None:
            self._wait_scope.cancel()  # wake the waiting task: there is something to report

    async def finished(self) -> list[tuple[Hashable, Any, BaseException | None]]:
        """Wait until some step generators have ended; (key, result, None) or (key, None,
        exception) each."""
        while not self._finished:
            ready = []
            if len(self._waiting) >= GATHER_FROM:
                gathered = self._looked_at + GATHER_SECONDS
                if gathered > trio.current_time():
                    await self._wait(min(gathered, self._earliest_deadline()), readable=False)
                ready = self._epoll.poll(0)
            if not ready and not self._finished:
                await self._wait(self._earliest_deadline(), readable=True)
                ready = self._epoll.poll(0)
            self._looked_at = trio.current_time()
            for fd, events in ready:
                running = self._waiting.pop(fd, None)
                if running is not None:
                    running.waiting_on = -1
                    self._step(running, events, None)
            self._expire(trio.current_time())
        done, self._finished = self._finished, []
        return done

    async def _wait(self, deadline: float, *, readable: bool) -> None:
        """Sleep until `deadline` (or until a step generator's wait needs an earlier one, or an
        step generator ended in `start`), and, if `readable`, no later than some socket is ready."""
        with trio.CancelScope(deadline=deadline) as self._wait_scope:
            if readable:
                await trio.lowlevel.wait_readable(self._epoll.fileno())
            else:
                await trio.sleep_forever()
        self._wait_scope = None

    def close(self) -> None:
        """End every step generator still running (their connections close); call it once no task
        waits in `finished()` any more."""
        for running in [*self._waiting.values(), *self._in_tasks]:
            running.steps.close()
        self._waiting.clear()
        self._in_tasks.clear()
        self._deadlines.clear()
        self._epoll.close()

    def _earliest_deadline(self) -> float:
        """The earliest deadline of a step generator still waiting (dropping those of waits that
        are over)."""
        deadlines = self._deadlines
        while deadlines:
            deadline, _, running = deadlines[0]
            if running.waiting_on >= 0 and running.deadline == deadline:
                return deadline
            heapq.heappop(deadlines)
        return math.inf

    def _expire(self, now: float) -> None:
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            deadline, _, running = heapq.heappop(deadlines)
            if running.waiting_on >= 0 and running.deadline == deadline:
                self._waiting.pop(running.waiting_on, None)
                self._unwatch(running.waiting_on)
                running.waiting_on = -1
                self._step(running, None, TimedOut())

    def _step(self, running: _Running, sent: Any, thrown: BaseException | None) -> None:
        try:
            want = running.steps.throw(thrown) if thrown is not None else running.steps.send(sent)
        except StopIteration as done:
            self._finished.append((running.key, done.value, None))
            return
        except Exception as error:
            self._finished.append((running.key, None, error))
            return
        if isinstance(want, Lookup | InThread):
            self._in_tasks.add(running)
            self._tasks.start_soon(self._run_task, running, want)
            return
        fd = want.socket.fileno()
        self._watch(fd, want.events)
        self._waiting[fd] = running
        running.waiting_on = fd
        if want.deadline != running.deadline:
            running.deadline = want.deadline
            self._order += 1
            heapq.heappush(self._deadlines, (want.deadline, self._order, running))
            if self._wait_scope is not None and want.deadline < self._wait_scope.deadline:
                self._wait_scope.deadline = want.deadline

    async def _run_task(self, running: _Running, want: Lookup | InThread) -> None:
        sent, error = await _in_task(want)
        if running in self._in_tasks:  # not closed meanwhile
            self._in_tasks.discard(running)
            self._step(running, sent, error)
            self._wake_if_finished()

    def _watch(self, fd: int, events: int) -> None:
        # A closed socket leaves the set by itself, and its number may come back as a new socket.
        try:
            self._epoll.modify(fd, events | _ONESHOT)
        except FileNotFoundError:
            self._epoll.register(fd, events | _ONESHOT)

    def _unwatch(self, fd: int) -> None:
        try:
            self._epoll.unregister(fd)
        except (FileNotFoundError, OSError, ValueError):
            pass  # already closed

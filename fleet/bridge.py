"""The one place trio meets asyncio: nats-py runs on an asyncio loop owned by a thread of its own.

Interlock runs on trio; the NATS client (nats-py) is asyncio. Rather than run both on one thread
(trio-asyncio), the client gets a private asyncio loop in a daemon thread, and trio code reaches
it only through `AsyncioThread`:

- `call(fn, ...)` runs the coroutine `fn(...)` on the loop and waits for its result in trio. The
  wait is cancellable: a cancelled trio call cancels the asyncio task (it then sees
  `CancelledError` wherever it waits) and waits a moment for it to end;
- `submit(fn, ...)` starts a coroutine and returns at once (what never-blocking callers, the data
  plane's observations, use); a failure goes to `on_error`;
- `to_trio(fn)` is a thread-safe function that runs `fn(*args)` on the trio thread soon, for
  asyncio callbacks to hand their work to trio, never blocking the loop;
- `delivery(capacity, on_drop)` is a bounded channel from the loop to trio (`Delivery`), for a
  subscription's messages: a subscriber that falls behind loses messages, counted (and, unless
  the channel is `lossy`, learns it), rather than the loop waiting on trio or messages piling
  up without bound;
- closing it cancels every task left on the loop, waits for them, and joins the thread, so
  nothing of NATS outlives the block.

Every callable that crosses into trio (`to_trio`'s, `on_error`, a delivery's hand-over) runs
guarded: what it raises is counted (`failures`, and the owner's `count_failure`, a metric) and
logged (to the owner's log, or to stderr when that write fails too), never let into trio's run
loop, where it would be a `TrioInternalError` that cancels every task, the data plane's included.

Why a thread: the asyncio side (the client's reader, pinger, reconnect loop) never competes with
the gateway's trio tasks for a turn of one scheduler, a stuck asyncio call cannot stall the data
plane, and each side keeps its own library's semantics (trio's cancel scopes, asyncio's tasks)
with one crossing, this module, to get right.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, Generic, Protocol, TypeVar

import trio

T = TypeVar("T")

CANCEL_WAIT_SECONDS = 5.0
"""How long a cancelled call waits for its asyncio task to end."""

CLOSE_WAIT_SECONDS = 10.0
"""How long closing waits for the loop's tasks to end and its thread to exit."""


class BridgeClosed(Exception):
    """A call on an AsyncioThread that has been closed."""


class DeliveryOverflowed(Exception):
    """A `Delivery` dropped messages: what was received before is whole, what came after is
    lost; the receiver reads again from its last message (a stream by sequence)."""


class FailureLog(Protocol):
    def error(self, msg: str, **fields: object) -> None: ...


class AsyncioThread:
    """An asyncio loop in a thread of its own, driven from trio (see the module docstring)."""

    def __init__(
        self,
        on_error: Callable[[BaseException], None],
        name: str = "interlock-asyncio",
        *,
        log: FailureLog | None = None,
        count_failure: Callable[[], None] = lambda: None,
    ) -> None:
        """`on_error` gets a submitted call's failure; `log` and `count_failure` a guarded
        callable's (see the module docstring)."""
        self._on_error = on_error
        self._log = log
        self._count_failure = count_failure
        self.failures = 0
        """Callables handed to trio that raised."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name=name, daemon=True)
        self._token = trio.lowlevel.current_trio_token()
        self._closed = False

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """`await fn(*args, **kwargs)` on the loop; its result or exception here."""
        ended = trio.Event()
        task = self._start(fn(*args, **kwargs), lambda _: self._wake(ended.set))
        try:
            await ended.wait()
        except BaseException:
            self._loop.call_soon_threadsafe(lambda: task[0].cancel())  # after _start's callback
            with trio.CancelScope(shield=True), trio.move_on_after(CANCEL_WAIT_SECONDS):
                await ended.wait()
            raise
        if task[0].cancelled():
            raise BridgeClosed("the asyncio thread was closed during the call")
        return task[0].result()

    def submit(self, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> None:
        """Start `fn(*args, **kwargs)` on the loop without waiting; never blocks. A failure (or
        a closed bridge) goes to `on_error`, called on the trio thread."""

        def report(task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is not None:
                self._wake(self._on_error, task.exception())

        try:
            self._start(fn(*args, **kwargs), report)
        except BridgeClosed as error:
            self._guarded(self._on_error, error)

    def to_trio(self, fn: Callable[..., None]) -> Callable[..., None]:
        """A function that any thread may call to have `fn(*args)` run on the trio thread soon
        (dropped once trio has stopped)."""

        def run_soon(*args: Any) -> None:
            self._wake(fn, *args)

        return run_soon

    def delivery(self, capacity: int, on_drop: Callable[[], None], *, lossy: bool = False) -> Delivery:
        """A bounded channel from the loop to trio (see `Delivery`)."""
        return Delivery(self, capacity, on_drop, lossy=lossy)

    def _start(self, coroutine: Coroutine, when_done: Callable[[asyncio.Task], None]) -> list[asyncio.Task]:
        """Make `coroutine` a task on the loop (soon), calling `when_done` (on the loop's thread)
        once the task has ended, however; the list holds the task once it exists."""
        if self._closed:
            coroutine.close()
            raise BridgeClosed("the asyncio thread is closed")
        task: list[asyncio.Task] = []

        def create() -> None:
            task.append(self._loop.create_task(coroutine))
            task[0].add_done_callback(when_done)

        self._loop.call_soon_threadsafe(create)
        return task

    def _wake(self, fn: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(self._guarded, fn, *args)

    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        """`fn(*args)` on the trio thread; what it raises is counted and logged, never raised."""
        try:
            fn(*args)
        except Exception as error:
            self._failed(fn, error)

    def _failed(self, fn: Callable[..., None], error: Exception) -> None:
        """Count a guarded callable's failure and log it: to the owner's log, or to stderr when
        there is none or writing to it fails as well (the failure may have been that write)."""
        self.failures += 1
        with contextlib.suppress(Exception):
            self._count_failure()
        callback = getattr(fn, "__qualname__", repr(fn))
        with contextlib.suppress(Exception):
            if self._log is not None:
                self._log.error("fleet: a callback from the NATS thread failed", callback=callback, error=repr(error))
                return
        with contextlib.suppress(Exception):
            print(f"interlock: fleet: a callback from the NATS thread failed: {callback}", file=sys.stderr)
            traceback.print_exception(error, file=sys.stderr)

    async def aclose(self) -> None:
        """Cancel every task on the loop, wait for them, stop the loop and join its thread."""
        if self._closed:
            return
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_WAIT_SECONDS):
            try:
                await self.call(_cancel_other_tasks)
            finally:
                self._closed = True
                self._loop.call_soon_threadsafe(self._loop.stop)
                await trio.to_thread.run_sync(self._thread.join, abandon_on_cancel=True)


class Delivery(Generic[T]):
    """Messages from the asyncio loop to trio, at most `capacity` waiting (handed over or in
    the channel). `put` (any thread) never blocks: with `capacity` waiting it drops the message
    and calls `on_drop` (a metric, counted from the loop's thread). Then, for a stream read
    again by sequence, it drops every later message too, and `receive` (trio) returns the
    messages accepted, in order, then raises DeliveryOverflowed; a `lossy` delivery (messages
    sent at most once) goes on with the next message that finds room."""

    def __init__(self, bridge: AsyncioThread, capacity: int, on_drop: Callable[[], None], *, lossy: bool) -> None:
        self._bridge = bridge
        self._capacity = capacity
        self._on_drop = on_drop
        self._lossy = lossy
        self._send, self._receive = trio.open_memory_channel[T](capacity)
        self._lock = threading.Lock()
        self._waiting = 0
        self._overflowed = False

    def put(self, message: T) -> None:
        with self._lock:
            dropped = self._overflowed or self._waiting >= self._capacity
            if not dropped:
                self._waiting += 1
            elif not self._lossy:
                self._overflowed = True
        if dropped:
            self._on_drop()
        else:
            self._bridge._wake(self._hand_over, message)

    def _hand_over(self, message: T) -> None:
        with contextlib.suppress(trio.BrokenResourceError):  # the receiver has closed
            self._send.send_nowait(message)  # room: `_waiting` counts it

    async def receive(self) -> T:
        with self._lock:
            if self._overflowed and self._waiting == 0:
                raise DeliveryOverflowed("messages were dropped: the receiver fell behind")
        message = await self._receive.receive()
        with self._lock:
            self._waiting -= 1
        return message

    def close(self) -> None:
        """The receiver is done: messages still handed over are discarded."""
        self._receive.close()


async def _cancel_other_tasks() -> None:
    current = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()


@asynccontextmanager
async def open_asyncio_thread(
    on_error: Callable[[BaseException], None],
    *,
    log: FailureLog | None = None,
    count_failure: Callable[[], None] = lambda: None,
) -> AsyncIterator[AsyncioThread]:
    """An AsyncioThread for the block; closed (no task, no thread left) when the block ends."""
    bridge = AsyncioThread(on_error, log=log, count_failure=count_failure)
    bridge._thread.start()
    try:
        yield bridge
    finally:
        await bridge.aclose()

"""Everything the gateway knows of hypercorn beyond its public API, fenced in one module.

The API app reads hypercorn's `receive` as what it is, a trio memory channel's (`queued_message`:
a message already queued is taken without waiting). Four of hypercorn's classes are replaced by
subclasses that override private methods, and hypercorn offers no way to choose them: it looks
them up by name in its own modules, so this module assigns them there, for the whole process
(the data plane imports it), when it is imported. What they rely on is
checked at the same moment (`check_private_surface`): a hypercorn whose private names or
signatures differ stops the import with `HypercornChanged`, naming hypercorn's version and what
changed, instead of serving without the hardening. `tests/test_private_surface.py` runs the
check and the behaviour behind each override and the `receive` shortcut; pyproject.toml pins
the hypercorn it was tested on. ARCHITECTURE.md's pitfalls list which replaced class each defect
needs.
"""

from __future__ import annotations

import http
import inspect
from collections.abc import Awaitable, Callable
from importlib.metadata import version

import h2.errors
import h2.events
import h11
import hypercorn.protocol
import hypercorn.trio
import hypercorn.trio.run
import hypercorn.trio.tcp_server
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import TrioSingleTask

from dataplane.private_surface import require_surface, untested

HTTP2_RESETS_PER_CONNECTION = 100
"""Streams an HTTP/2 client may reset on one connection; the next reset ends it with GOAWAY."""


class HypercornChanged(RuntimeError):
    """The installed hypercorn lacks a private name the gateway overrides or relies on."""


def _global_names(function: Callable) -> set[str]:
    """The global and attribute names a function looks up when it runs."""
    return set(inspect.unwrap(function).__code__.co_names)


def _async_method(cls: type, name: str, *parameters: str) -> tuple[bool, str]:
    """Whether `cls.name` is a coroutine function of these parameters (after `self`), and what
    that is in words."""
    method = getattr(cls, name, None)
    present = inspect.iscoroutinefunction(method) and list(inspect.signature(method).parameters) == [
        "self",
        *parameters,
    ]
    return present, f"async {cls.__name__}.{name}({', '.join(('self', *parameters))})"


def check_private_surface() -> None:
    """Raise HypercornChanged unless hypercorn still has what this module's overrides rely on:
    the methods they override or call (async, with these parameters) and the module globals by
    which hypercorn picks the classes they replace."""
    expected = [
        _async_method(H2Protocol, "_handle_events", "events"),
        _async_method(H2Protocol, "_flush"),
        _async_method(H11Protocol, "_check_protocol", "event"),
        ("_check_protocol" in _global_names(H11Protocol._handle_events), "H11Protocol._handle_events calling it"),
        _async_method(H11Protocol, "_send_h11_event", "event"),
        (
            "_send_h11_event" in _global_names(H11Protocol.stream_send)
            and "Response" in _global_names(H11Protocol.stream_send),
            "H11Protocol.stream_send sending its h11.Response through _send_h11_event",
        ),
        (
            any("reason" in getattr(cls, "__slots__", ()) for cls in h11.Response.__mro__)
            and "__setattr__" in _global_names(h11.Response.__init__),
            f"h11 {version('h11')}'s Response keeping its reason in a slot that its constructor sets",
        ),
        _async_method(TCPServer, "_close"),
        _async_method(TCPServer, "_read_data"),
        (
            "_read_data" in _global_names(TCPServer.run) and "TaskGroup" in _global_names(TCPServer.run),
            "TCPServer.run reading with _read_data inside the connection's TaskGroup",
        ),
        (
            "send_eof" in _global_names(TCPServer._close) and "send_lock" in _global_names(TCPServer.protocol_send),
            "TCPServer._close ending the stream with send_eof, TCPServer.protocol_send sending under send_lock",
        ),
        _async_method(TCPServer, "protocol_send", "event"),
        (
            {"RawData", "send_lock", "CancelScope", "shield", "send_all", "data", "BrokenResourceError", "Closed"}
            <= _global_names(TCPServer.protocol_send),
            "TCPServer.protocol_send sending RawData with send_all under send_lock, shielded, handling Closed",
        ),
        _async_method(TrioSingleTask, "restart", "task_group", "action"),
        _async_method(TrioSingleTask, "stop"),
        (
            {"TrioSingleTask", "idle_task"} <= _global_names(TCPServer.__init__)
            and {"idle_task", "restart", "_idle_timeout"} <= _global_names(TCPServer.run)
            and {"idle_task", "restart", "stop", "_idle_timeout"} <= _global_names(TCPServer.protocol_send),
            "TCPServer keeping its keep-alive timeout in idle_task, a TrioSingleTask restarted with _idle_timeout",
        ),
        _async_method(TCPServer, "_idle_timeout"),
        (
            {"keep_alive_timeout", "terminated", "_initiate_server_close"} <= _global_names(TCPServer._idle_timeout),
            "TCPServer._idle_timeout waiting keep_alive_timeout or the server's end, then _initiate_server_close",
        ),
        _async_method(TCPServer, "_initiate_server_close"),
        (callable(getattr(TaskGroup, "spawn", None)), "hypercorn.trio.task_group.TaskGroup.spawn"),
        _async_method(TaskGroup, "spawn_app", "app", "config", "scope", "send"),
        (
            {"open_memory_channel", "send"} <= _global_names(TaskGroup.spawn_app)
            and "TaskGroup" in _global_names(TCPServer.run),
            "TCPServer.run making its TaskGroup by module global, whose spawn_app returns a trio memory channel's send",
        ),
        (
            {"H2Protocol", "H11Protocol"} <= _global_names(hypercorn.protocol.ProtocolWrapper.__init__)
            and "H2Protocol" in _global_names(hypercorn.protocol.ProtocolWrapper.handle),
            "hypercorn.protocol.ProtocolWrapper picking H2Protocol and H11Protocol by module global",
        ),
        (
            "TCPServer" in _global_names(hypercorn.trio.run.worker_serve),
            "hypercorn.trio.run.worker_serve picking TCPServer by module global",
        ),
        (
            "worker_serve" in _global_names(hypercorn.trio.serve)
            and hypercorn.trio.worker_serve is hypercorn.trio.run.worker_serve,
            "hypercorn.trio.serve running hypercorn.trio.run.worker_serve",
        ),
    ]
    require_surface("hypercorn", expected, HypercornChanged)


def http2_on(config: HypercornConfig) -> bool:
    """Whether a listener's hypercorn config serves HTTP/2: off, it allows no stream at all
    (hypercorn has no switch for HTTP/2 in cleartext; `interlock.serve` sets the stream limit)."""
    return config.h2_max_concurrent_streams > 0


class _H2WithResetBudget(H2Protocol):
    """hypercorn's HTTP/2 protocol, hardened against the rapid-reset attack (streams opened and
    reset at once: the open-stream limit never binds, and each stream would start a completion
    on a node).

    A stream the client opens and resets in the same read never reaches the application, and a
    connection whose client has reset more than HTTP2_RESETS_PER_CONNECTION streams is ended
    with GOAWAY (ENHANCE_YOUR_CALM)."""

    resets = 0

    async def _handle_events(self, events: list[h2.events.Event]) -> None:
        reset = {event.stream_id for event in events if isinstance(event, h2.events.StreamReset) and event.remote_reset}
        if not reset:
            return await super()._handle_events(events)
        self.resets += len(reset)
        if self.resets > HTTP2_RESETS_PER_CONNECTION:
            self.connection.close_connection(error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
            await self._flush()
            await self.send(Closed())
            return
        opened_here = {event.stream_id for event in events if isinstance(event, h2.events.RequestReceived)}
        stillborn = reset & opened_here
        await super()._handle_events([event for event in events if getattr(event, "stream_id", None) not in stillborn])


class _H11AsServed(H11Protocol):
    """hypercorn's HTTP/1.1 protocol, with two changes.

    - It ignores `Upgrade: h2c` (answers the request in HTTP/1.1, as RFC 9110 lets a server)
      when HTTP/2 is off: hypercorn would switch to HTTP/2 and answer the upgraded request
      whatever the stream limit.
    - Its status lines carry the status's reason phrase (`HTTP/1.1 200 OK`): hypercorn builds
      every response without one (`HTTP/1.1 200 `), which some clients and tools show as is."""

    async def _check_protocol(self, event: h11.Request) -> None:
        if not http2_on(self.config):
            for name, value in event.headers:
                if name == b"upgrade" and value.strip().lower() == b"h2c":
                    return
        await super()._check_protocol(event)

    def _send_h11_event(self, event) -> Awaitable[None]:
        # A plain function returning hypercorn's coroutine: no frame of ours to resume per piece sent.
        if type(event) is h11.Response and not event.reason:
            # The response hypercorn has just built for this send, given its reason as h11's own
            # constructor sets its fields (h11's events refuse plain assignment).
            object.__setattr__(event, "reason", _REASON_PHRASES.get(event.status_code, b""))
        return super()._send_h11_event(event)


_REASON_PHRASES = {status.value: status.phrase.encode("ascii") for status in http.HTTPStatus}


class _TCPServerClosingOnce(TCPServer):
    """hypercorn's connection (trio), whose close never meets a send, with a cheaper keep-alive
    timeout (`_KeepAliveTimer`) that ends when the client closes its side.

    hypercorn sends under a lock but ends the connection (`send_eof`) outside it, so a send
    by one task (an answer, or hypercorn's own 400 to a client that closed mid-body) could meet
    the other task's `send_eof`: trio raises BusyResourceError, which hypercorn lets out of the
    connection (a traceback per connection, or the end of `serve_listeners` and the process).
    Here the close takes the send lock: a send waiting for it then finds the stream closed,
    which hypercorn takes as a client gone. With a send in progress, the close only closes the
    stream, which wakes that send the same way (as hypercorn does when `send_eof` fails).

    A send takes a free lock without trio's `Lock.acquire`, which lets every other task run
    first even when the lock is free: the stream's `send_all` does that once already, and each
    turn resumes the whole chain of the app's frames. Otherwise the sends are hypercorn's.

    The connection is closed once its tasks are over, and the keep-alive timer is one of them:
    when the client closes its side (or the read times out), the timer ends, so that the socket
    is closed as soon as the app has seen the client leave, not when the timer's deadline comes
    (hypercorn stops its own idle task at each request)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.idle_task = _KeepAliveTimer(self)

    async def protocol_send(self, event: Event) -> None:
        if type(event) is not RawData or self.send_lock.locked():
            return await super().protocol_send(event)
        if not event.data:  # the end of a body of known length: nothing to send
            return await trio.lowlevel.checkpoint_if_cancelled()
        await trio.lowlevel.checkpoint_if_cancelled()  # as `Lock.acquire` does
        self.send_lock.acquire_nowait()
        try:
            with trio.CancelScope(shield=True):
                await self.stream.send_all(event.data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await self.protocol.handle(Closed())
        finally:
            self.send_lock.release()

    async def _read_data(self) -> None:
        await super()._read_data()
        self.idle_task.end()

    async def _close(self) -> None:
        self.idle_task.end()
        if self.send_lock.locked():
            await self.stream.aclose()
            return
        self.send_lock.acquire_nowait()
        try:
            await super()._close()
        finally:
            self.send_lock.release()


class _TaskGroupPuttingAtOnce(TaskGroup):
    """hypercorn's task group of a connection (trio), whose requests' messages are queued for the
    app at once while the queue has room: a trio channel's `send` lets every other task run
    first, which, a request's body, its end and the client's leaving each time, resumes the
    connection's whole chain of frames; so a body that comes with its head is all queued, its
    end too, when the app starts (`dataplane.asgi._read_body` takes it without waiting)."""

    async def spawn_app(self, app, config, scope, send) -> Callable[[dict], Awaitable[None]]:
        put = await super().spawn_app(app, config, scope, send)
        channel = getattr(put, "__self__", None)
        if not isinstance(channel, trio.MemorySendChannel):
            raise HypercornChanged(
                untested("hypercorn", ["TaskGroup.spawn_app returning a trio memory channel's send"])
            )

        async def put_at_once(message: dict) -> None:
            await trio.lowlevel.checkpoint_if_cancelled()  # as the channel's `send` does
            try:
                channel.send_nowait(message)
            except trio.WouldBlock:
                await channel.send(message)

        return put_at_once


class _KeepAliveTimer:
    """A connection's keep-alive timeout, in place of hypercorn's `TrioSingleTask` as the
    connection's `idle_task`, with the same effect: a connection idle for the keep-alive timeout,
    or idle while the server ends, is closed (`TCPServer._idle_timeout`).

    hypercorn stops the timeout when a request arrives and restarts it when the answer is over,
    each time under a lock and by cancelling a task and starting another. Here one task waits
    while the connection goes from one request to the next: the end of an answer moves its
    deadline and the start of a request only marks the connection busy. The task ends when its
    deadline finds the connection busy (hypercorn's would have been cancelled by then; the next
    idle spell starts another), or when the server closes the connection (`end`): a connection
    that ends never waits for it longer than the timeout, as with hypercorn's."""

    __slots__ = ("_ended", "_idle", "_scope", "_server")

    def __init__(self, server: TCPServer) -> None:
        self._server = server
        self._scope: trio.CancelScope | None = None
        self._idle = False
        self._ended = False

    async def restart(self, task_group: TaskGroup, action: Callable[[], Awaitable[None]]) -> None:
        """The connection is idle (its `action`, `TCPServer._idle_timeout`, is what `_run` does)."""
        self._idle = True
        deadline = trio.current_time() + self._server.config.keep_alive_timeout
        if self._scope is None:
            self._scope = trio.CancelScope(deadline=deadline)
            task_group.spawn(self._run)
        else:
            self._scope.deadline = deadline

    async def stop(self) -> None:
        """The connection is busy: a request arrived."""
        self._idle = False

    def end(self) -> None:
        """The server is closing the connection."""
        self._ended = True
        if self._scope is not None:
            self._scope.cancel()

    async def _run(self) -> None:
        terminated = self._server.context.terminated
        while True:
            with self._scope as waiting:
                await terminated.wait()
            if self._ended or not self._idle:
                break
            if terminated.is_set() or trio.current_time() >= waiting.deadline:
                with trio.CancelScope(shield=True):
                    await self._server._initiate_server_close()
                break
            # The deadline passed in a request, and the answer, over since, moved it on.
            self._scope = trio.CancelScope(deadline=waiting.deadline)
        self._scope = None


def queued_message(receive) -> dict | None:
    """The next message of a hypercorn `receive` when one is queued already; None when none is
    (or `receive` is not hypercorn's channel): then `await receive()`. Most bodies come with
    their head and so are queued whole when the app starts (`_TaskGroupPuttingAtOnce`): taking
    them this way spares the body reader a cancel scope with deadlines."""
    if not is_queue_receive(receive):
        return None
    try:
        return receive.__self__.receive_nowait()
    except trio.WouldBlock:
        return None


def is_queue_receive(receive) -> bool:
    """Whether `receive` is what `queued_message` reads without waiting: a trio memory channel's
    (hypercorn.trio.task_group.TaskGroup.spawn_app's)."""
    return isinstance(getattr(receive, "__self__", None), trio.MemoryReceiveChannel)


check_private_surface()
hypercorn.protocol.H2Protocol = _H2WithResetBudget
hypercorn.protocol.H11Protocol = _H11AsServed
hypercorn.trio.run.TCPServer = _TCPServerClosingOnce
hypercorn.trio.tcp_server.TaskGroup = _TaskGroupPuttingAtOnce

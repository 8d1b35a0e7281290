"""The trio/asyncio bridge (`fleet.bridge`) driving a real nats-py client against a real
nats-server on loopback: results and errors cross, a cancelled trio call cancels its asyncio
task, a subscription keeps delivering after the server restarts, closing leaves no thread or
asyncio task behind, and a callback that raises on its way into trio (the error callback's own
failed write included) is counted and logged while trio, and a fleet replica's gateway, serve on."""

from __future__ import annotations

import asyncio
import errno
import io
import threading
from functools import partial

import nats
import pytest
import trio

from fixtures.node import serve_nodes
from fleet.bridge import AsyncioThread, BridgeClosed, open_asyncio_thread
from harness import CapturedLog, chat, node_specs, running_gateway
from nats_cluster import nats_servers


def unexpected(error: BaseException) -> None:
    raise AssertionError(f"unexpected asyncio failure: {error!r}")


async def connect(bridge: AsyncioThread, url: str):
    return await bridge.call(nats.connect, url, reconnect_time_wait=0.1, max_reconnect_attempts=-1)


async def test_results_and_errors_cross_the_bridge():
    async def add(a, b):
        await asyncio.sleep(0)
        return a + b

    async def fail():
        raise ValueError("from asyncio")

    async with open_asyncio_thread(unexpected) as bridge:
        assert await bridge.call(add, 2, 3) == 5
        with pytest.raises(ValueError, match="from asyncio"):
            await bridge.call(fail)


async def test_a_cancelled_call_cancels_its_asyncio_task(tmp_path):
    cancelled = threading.Event()

    async def request_nobody_answers(nc):
        try:
            await nc.request("nobody.answers", b"?", timeout=60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async with nats_servers(tmp_path) as [server], open_asyncio_thread(unexpected) as bridge:
        nc = await connect(bridge, server.url)
        await bridge.call(nc.subscribe, "nobody.answers")  # a responder that never replies
        with trio.move_on_after(0.3) as waiting:
            await bridge.call(request_nobody_answers, nc)
        assert waiting.cancelled_caught
        assert cancelled.is_set()
        assert (await bridge.call(nc.request, "$JS.API.INFO", b"", timeout=5)).data  # the bridge still works
        await bridge.call(nc.close)


async def test_a_subscription_delivers_again_after_the_server_restarts(tmp_path):
    async with nats_servers(tmp_path) as [server], open_asyncio_thread(unexpected) as bridge:
        received_in, received_out = trio.open_memory_channel[bytes](100)
        deliver = bridge.to_trio(received_in.send_nowait)

        async def on_message(msg):
            deliver(msg.data)

        reconnected = trio.Event()
        on_reconnect = bridge.to_trio(reconnected.set)

        async def reconnected_cb():
            on_reconnect()

        nc = await bridge.call(
            nats.connect, server.url, reconnect_time_wait=0.1, max_reconnect_attempts=-1, reconnected_cb=reconnected_cb
        )
        await bridge.call(nc.subscribe, "greetings", cb=on_message)
        await bridge.call(nc.publish, "greetings", b"before")
        with trio.fail_after(60):
            assert await received_out.receive() == b"before"
        await server.kill()
        await server.start()
        with trio.fail_after(60):
            await reconnected.wait()
        await bridge.call(nc.publish, "greetings", b"after")
        with trio.fail_after(60):
            assert await received_out.receive() == b"after"
        await bridge.call(nc.close)


async def test_closing_leaves_no_thread_or_task_behind(tmp_path):
    threads_before = set(threading.enumerate())
    async with nats_servers(tmp_path) as [server]:
        async with open_asyncio_thread(unexpected) as bridge:
            nc = await connect(bridge, server.url)  # left open on purpose: closing cancels its tasks
            await bridge.call(nc.subscribe, "anything")
            loop = bridge._loop
            assert len(threading.enumerate()) > len(threads_before)
        assert set(threading.enumerate()) == threads_before
        assert loop.is_closed()
        with pytest.raises(BridgeClosed):
            await bridge.call(asyncio.sleep, 0)


async def test_submit_reports_a_failure_and_never_blocks():
    failures = []

    async def fail():
        raise ValueError("fire and forget")

    async with open_asyncio_thread(failures.append) as bridge:
        bridge.submit(fail)
        with trio.fail_after(60):
            while not failures:
                await trio.sleep(0.01)
    assert [str(error) for error in failures] == ["fire and forget"]


class RecordedLog:
    """A log that keeps its error lines (the bridge's `log`)."""

    def __init__(self) -> None:
        self.errors: list[dict] = []

    def error(self, msg: str, **fields: object) -> None:
        self.errors.append({"msg": msg, **fields})


async def test_a_callback_that_raises_is_counted_and_logged_and_trio_serves_on(tmp_path):
    """The error callback itself raising (a failed write of its warning), and a `to_trio`
    callable raising, reach neither trio's run loop nor the other tasks: each is counted and
    logged, and the bridge and a trio server beside it keep working."""

    def error_callback_that_fails(error: BaseException) -> None:
        raise OSError(f"cannot write the warning about {error!r}")

    def handler_that_fails(data: bytes) -> None:
        raise ValueError(f"cannot handle {data!r}")

    async def fail():
        raise ValueError("fire and forget")

    async def echo(stream: trio.SocketStream) -> None:
        async with stream:
            async for data in stream:
                await stream.send_all(data)

    counted = []
    log = RecordedLog()
    async with (
        nats_servers(tmp_path) as [server],
        open_asyncio_thread(error_callback_that_fails, log=log, count_failure=lambda: counted.append(1)) as bridge,
        trio.open_nursery() as nursery,
    ):
        listeners = await nursery.start(partial(trio.serve_tcp, echo, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        handle = bridge.to_trio(handler_that_fails)

        async def on_message(msg):
            handle(msg.data)

        nc = await connect(bridge, server.url)
        await bridge.call(nc.subscribe, "greetings", cb=on_message)
        await bridge.call(nc.publish, "greetings", b"hello")
        bridge.submit(fail)
        with trio.fail_after(60):
            while bridge.failures < 2:
                await trio.sleep(0.01)
        assert len(counted) == 2
        assert sorted(line["callback"] for line in log.errors) == [
            "test_a_callback_that_raises_is_counted_and_logged_and_trio_serves_on.<locals>.error_callback_that_fails",
            "test_a_callback_that_raises_is_counted_and_logged_and_trio_serves_on.<locals>.handler_that_fails",
        ]
        assert {line["msg"] for line in log.errors} == {"fleet: a callback from the NATS thread failed"}

        client = await trio.open_tcp_stream("127.0.0.1", port)  # the task beside the bridge serves on
        async with client:
            await client.send_all(b"still here")
            assert await client.receive_some() == b"still here"
        assert (await bridge.call(nc.request, "$JS.API.INFO", b"", timeout=5)).data  # so does the bridge
        await bridge.call(nc.close)
        nursery.cancel_scope.cancel()


async def test_a_callback_failure_the_log_cannot_take_goes_to_stderr(capfd):
    class BrokenLog:
        def error(self, msg: str, **fields: object) -> None:
            raise BrokenPipeError("the log's reader is gone")

    def handler_that_fails() -> None:
        raise ValueError("cannot handle it")

    async with open_asyncio_thread(unexpected, log=BrokenLog()) as bridge:
        bridge.to_trio(handler_that_fails)()
        with trio.fail_after(60):
            while not bridge.failures:
                await trio.sleep(0.01)
        assert await bridge.call(asyncio.sleep, 0, result=7) == 7
    err = capfd.readouterr().err
    assert "a callback from the NATS thread failed" in err and "ValueError: cannot handle it" in err


class WarningsFail(io.StringIO):
    """A log stream on which the NATS client's warning cannot be written (a full disk), while
    every other line can."""

    def write(self, text: str) -> int:
        if "fleet: NATS client error" in text:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(text)


async def test_a_replica_whose_nats_error_callback_fails_serves_on(tmp_path):
    """A fleet replica's NATS client reports an error (its server gone) through the bridge to a
    callback whose warning cannot be written: the failure is counted and logged, and the
    gateway, data plane included, serves on."""
    log = CapturedLog()
    log.stream = WarningsFail()
    async with nats_servers(tmp_path) as [server], serve_nodes(node_specs(1)) as nodes:
        fleet = f'[fleet]\nnats = ["{server.url}"]\nname = "bridged"\nreplica = "solo"\nlease = "2s"\n'
        fleet += f'partition_dir = "{tmp_path / "partitions"}"\n'
        async with running_gateway(tmp_path, nodes, health_interval="1s", extra=fleet, log=log) as gateway:

            async def answered() -> int:
                return (await gateway.http.post(gateway.url + "/v1/chat/completions", json=chat())).status_code

            with trio.fail_after(60):
                while await answered() != 200:  # the replica leads, probes, and routes to the node
                    await trio.sleep(0.05)
            await server.kill()
            with trio.fail_after(60):
                while await bridge_failures(gateway) < 1:
                    await trio.sleep(0.05)
            assert await answered() == 200
            assert "fleet: a callback from the NATS thread failed" in log.messages()


async def bridge_failures(gateway) -> float:
    metrics = (await gateway.http.get(gateway.metrics_url + "/metrics")).text
    name = "interlock_fleet_bridge_failures_total"
    [value] = [line.split()[-1] for line in metrics.splitlines() if line.startswith(name + " ")]
    return float(value)

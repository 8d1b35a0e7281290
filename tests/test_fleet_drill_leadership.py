"""Leadership that says the truth, with real nats-servers and three replicas (`interlock serve`
subprocesses with `[fleet]`).

A leader paused in the middle of an append (its append on the wire, held by a TCP proxy
between it and its NATS server, and the process SIGSTOPped at that moment) loses its lease; a
new leader appends; the held append, delivered late, is refused by JetStream and lands nothing:
the stream stays contiguous and the paused leader follows. With all of NATS stopped and back,
no replica's `/health` names a leader while none holds the lease, and a replica takes the
lease at its first request once JetStream answers.
"""

from __future__ import annotations

import asyncio
import re
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
import nats
import nats.js.errors
import trio

from fixtures.node import serve_nodes
from harness import node_specs
from nats_cluster import NatsServer, nats_servers, stream_info
from test_fleet import (
    WAIT,
    Observed,
    Replica,
    _seq_passed,
    agreed,
    assert_gapless,
    fleet_events,
    fleet_of,
    named,
    until,
)

APPEND = b"HPUB interlock.events "
"""How the NATS protocol starts a publish with headers on the event stream's subject: an append."""
REFUSED = b"wrong last sequence"
"""JetStream's answer to an append whose expected last sequence is not the stream's."""


@dataclass
class HoldingProxy:
    """A TCP proxy between replicas and one nats-server (every connection forwarded both ways).
    Armed, it holds the first append a client sends, and everything that client sends after it,
    calls `on_hold` at that moment, and forwards what it holds on `release`. It counts
    JetStream's refusals of appends sent to that client after the release."""

    upstream: NatsServer
    port: int = 0
    armed: Callable[[], None] | None = None
    """`on_hold`, while armed."""
    held: bytearray = field(default_factory=bytearray)
    holding: trio.Event = field(default_factory=trio.Event)
    released: trio.Event = field(default_factory=trio.Event)
    refusals_after_release: int = 0

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def arm(self, on_hold: Callable[[], None]) -> None:
        self.armed = on_hold

    def release(self) -> None:
        self.released.set()

    def held_append(self) -> tuple[int, bytes]:
        """The held append's expected last message sequence and its batch of events."""
        line, rest = bytes(self.held).split(b"\r\n", 1)
        header_length, total_length = (int(part) for part in line.split()[-2:])
        headers, payload = rest[:header_length], rest[header_length:total_length]
        [expected] = re.findall(rb"Nats-Expected-Last-Sequence: *(\d+)", headers)
        return int(expected), payload

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        [listener] = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listener.socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._connection, [listener])

    async def _connection(self, client: trio.SocketStream) -> None:
        try:
            server = await trio.open_tcp_stream("127.0.0.1", self.upstream.port)
        except OSError:
            await client.aclose()  # the server is down: the client reconnects later
            return
        async with client, server, trio.open_nursery() as nursery:
            nursery.start_soon(self._to_server, client, server, nursery.cancel_scope)
            nursery.start_soon(self._to_client, server, client, nursery.cancel_scope)

    async def _to_server(self, client: trio.SocketStream, server: trio.SocketStream, done: trio.CancelScope) -> None:
        holding_here = False
        try:
            while data := await client.receive_some():
                if holding_here and not self.released.is_set():
                    self.held += data
                    continue
                if self.armed is not None and (start := data.find(APPEND)) >= 0:
                    await server.send_all(data[:start])
                    self.held += data[start:]
                    on_hold, self.armed = self.armed, None
                    holding_here = True
                    on_hold()
                    self.holding.set()
                    await self.released.wait()
                    await server.send_all(bytes(self.held))
                    continue
                await server.send_all(data)
        except trio.BrokenResourceError:
            pass
        done.cancel()

    async def _to_client(self, server: trio.SocketStream, client: trio.SocketStream, done: trio.CancelScope) -> None:
        try:
            while data := await server.receive_some():
                if self.released.is_set():
                    self.refusals_after_release += data.count(REFUSED)
                await client.send_all(data)
        except trio.BrokenResourceError:
            pass
        done.cancel()


@asynccontextmanager
async def proxies_to(servers: list[NatsServer]) -> AsyncIterator[list[HoldingProxy]]:
    async with trio.open_nursery() as nursery:
        proxies = [HoldingProxy(server) for server in servers]
        for proxy in proxies:
            await nursery.start(proxy.serve)
        yield proxies
        nursery.cancel_scope.cancel()


async def test_a_leader_paused_in_the_middle_of_an_append_is_refused_when_it_lands_late(tmp_path):
    """Each replica reaches its own server of three through a proxy. The leader's proxy holds
    its next append and the leader is SIGSTOPped at that moment: the append is sent, not
    answered. Its lease runs out, another replica leads and appends; then the held append
    reaches JetStream (and the leader resumes): it is refused, none of its events lands, the
    stream stays contiguous, and the paused leader follows the new one."""
    async with (
        nats_servers(tmp_path, 3, advertise=False) as servers,
        proxies_to(servers) as proxies,
        serve_nodes(node_specs(2)) as nodes,
        fleet_of(tmp_path, nodes, proxies, one_server_each=True) as replicas,
        httpx.AsyncClient() as http,
    ):
        observed = Observed()
        before = await agreed(http, replicas, observed)
        paused = named(replicas, before.leader)
        proxy = proxies[replicas.index(paused)]
        proxy.arm(lambda: paused.signal(signal.SIGSTOP))  # its next append is the probes' events
        with trio.fail_after(WAIT):
            await proxy.holding.wait()
        expected, late_batch = proxy.held_append()
        others = [replica for replica in replicas if replica is not paused]

        async def another_leader_appended() -> bool:
            answers = [await replica.health(http) for replica in others]
            info = await stream_info(servers[0].url, "interlock-events")
            leaders = {answer.leader for answer in answers if answer is not None}
            return info.state.last_seq > expected and len(leaders) == 1 and leaders.isdisjoint({"", paused.name})

        await until(another_leader_appended, "another replica leading and appending after the held append")
        proxy.release()
        paused.signal(signal.SIGCONT)

        async def refused() -> bool:
            return proxy.refusals_after_release >= 1

        await until(refused, "JetStream refusing the late append")
        with trio.fail_after(WAIT):
            while "fleet: following" not in paused.messages():
                await trio.sleep(0.05)
        after = await agreed(http, replicas, observed, excluding=paused.name)
        assert after.seq > before.seq
        assert observed.disagreements() == {}
        messages = await fleet_events(servers[1].url)
        assert_gapless(messages)
        assert late_batch not in [data for _, data in messages]


async def lease_holder(url: str) -> str | None:
    """The replica holding the fleet's lease as JetStream answers a client now ("" when none
    does), or None when JetStream does not answer: the lease bucket's stream has no leader to
    answer its state (a lease request would fail too; a key's value may be read without one)."""

    async def read() -> str | None:
        try:
            nc = await nats.connect(url, connect_timeout=1, allow_reconnect=False)
        except (nats.errors.Error, OSError):
            return None
        try:
            js = nc.jetstream(timeout=1)
            await js.stream_info("KV_interlock-leader")
            kv = await js.key_value("interlock-leader")
            return ((await kv.get("leader")).value or b"").decode()
        except nats.js.errors.KeyNotFoundError:
            return ""
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError):
            return None
        finally:
            await nc.close()

    return await trio.to_thread.run_sync(lambda: asyncio.run(read()))


def failed_lease_requests(replica: Replica) -> int:
    return replica.messages().count("fleet: lease request failed")


async def test_after_nats_returns_no_leader_is_named_until_one_holds_the_lease(tmp_path):
    """All of NATS stopped until every replica names no leader, then started again. From then
    until JetStream says a replica holds the lease, every replica's `/health` names none (it
    never names the leader of before the outage); the replica that takes the lease takes it at
    its first request after JetStream answers (at most the one request in flight then failed),
    and the fleet appends again."""
    async with (
        nats_servers(tmp_path, 3) as servers,
        serve_nodes(node_specs(2)) as nodes,
        fleet_of(tmp_path, nodes, servers) as replicas,
        httpx.AsyncClient() as http,
    ):
        observed = Observed()
        before = await agreed(http, replicas, observed)
        for server in servers:
            await server.kill()

        async def no_leader_named() -> bool:
            return [(await replica.health(http)).leader for replica in replicas] == [""] * len(replicas)

        await until(no_leader_named, "no replica naming a leader while NATS is down")
        for server in servers:
            await server.start()
        named_while_none_held: list[str] = []
        failed_at_answer: list[int] | None = None
        with trio.fail_after(WAIT):
            while True:
                holder = await lease_holder(servers[0].url)
                if holder and failed_at_answer is not None:
                    break
                if holder is not None and failed_at_answer is None:  # JetStream answers
                    failed_at_answer = [failed_lease_requests(replica) for replica in replicas]
                answers = [await replica.health(http) for replica in replicas]
                if holder == "" and await lease_holder(servers[1].url) == "":  # none held it all along
                    named_while_none_held += [answer.leader for answer in answers if answer and answer.leader]
                await trio.sleep(0.05)
        assert named_while_none_held == []
        leader = named(replicas, holder)
        assert failed_lease_requests(leader) - failed_at_answer[replicas.index(leader)] <= 1
        await until(lambda: _seq_passed(http, replicas, before.seq + 5), "every replica applying events again")
        after = await agreed(http, replicas, observed)
        assert after.leader == holder
        assert observed.disagreements() == {}
        assert_gapless(await fleet_events(servers[0].url))

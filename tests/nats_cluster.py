"""Real `nats-server` processes for the fleet tests: one, or three clustered on loopback, each
with JetStream on and its own store directory, on free ports; killed at the end of the block."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import nats
import trio
from nats.js.api import StreamInfo

from harness import free_port, required_program

START_TIMEOUT = 15.0


@dataclass
class NatsServer:
    """One nats-server; `start` (again, after `kill`) runs it on the same ports and store."""

    name: str
    store: Path
    port: int = field(default_factory=free_port)
    cluster_port: int = field(default_factory=free_port)
    routes: list[int] = field(default_factory=list)
    clustered: bool = False
    advertise: bool = True
    """False: clients learn of no other server of the cluster (`--no_advertise`), so a client
    that lists this server alone is cut off while it is down."""
    config: Path | None = None
    """A nats-server config file (`-c`: users, permissions, TLS); the command line's flags win."""
    process: trio.Process | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def start(self) -> None:
        command = [
            required_program("nats-server", "apt-get install nats-server"),
            "-js", "-sd", str(self.store), "-a", "127.0.0.1", "-p", str(self.port), "-n", self.name,
        ]  # fmt: skip
        if self.config is not None:
            command += ["-c", str(self.config)]
        if self.clustered:
            command += ["--cluster_name", "interlock-test", "--cluster", f"nats://127.0.0.1:{self.cluster_port}"]
            command += ["--routes", ",".join(f"nats://127.0.0.1:{port}" for port in self.routes)]
            if not self.advertise:
                command += ["--no_advertise"]
        self.process = await trio.lowlevel.open_process(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        with trio.fail_after(START_TIMEOUT):
            while True:
                try:
                    stream = await trio.open_tcp_stream("127.0.0.1", self.port)
                except OSError:
                    if self.process.returncode is not None:
                        raise RuntimeError(f"nats-server {self.name} exited with {self.process.returncode}")
                    await trio.sleep(0.05)
                    continue
                await stream.aclose()
                return

    async def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()


@asynccontextmanager
async def nats_servers(tmp_path: Path, count: int = 1, *, advertise: bool = True) -> AsyncIterator[list[NatsServer]]:
    """`count` JetStream servers (clustered when more than one), all running and killed at the
    end; `advertise` as NatsServer's."""
    servers = [
        NatsServer(name=f"nats{i}", store=tmp_path / f"nats{i}", advertise=advertise) for i in range(1, count + 1)
    ]
    for server in servers:
        server.clustered = count > 1
        server.routes = [other.cluster_port for other in servers if other is not server]
    try:
        for server in servers:
            await server.start()
        yield servers
    finally:
        with trio.CancelScope(shield=True):
            for server in servers:
                await server.kill()


async def stream_info(url: str, stream: str) -> StreamInfo:
    """`stream`'s state as the NATS server at `url` tells a client of its own (on a thread)."""

    async def read() -> StreamInfo:
        nc = await nats.connect(url)
        try:
            return await nc.jetstream().stream_info(stream)
        finally:
            await nc.close()

    return await trio.to_thread.run_sync(lambda: asyncio.run(read()))

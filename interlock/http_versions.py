"""The HTTP versions the gateway's listeners speak (`gateway.http2`), and HTTP/2's bounds.

hypercorn speaks HTTP/2 on a cleartext port to any client that asks (the prior-knowledge
preface, or `Upgrade: h2c`), with no setting to stop it, and starts the application for every
stream a client opens, even one the client resets in the same packet: opening and resetting
streams in quick succession (the "rapid reset" attack) then starts a completion on a node per
stream, GPU work the client never waits for. So every listener runs hypercorn with
`ConnectionProtocol` in place of hypercorn's own choice of protocol (`use_connection_protocol`):
HTTP/1.1 only unless `http2` is on, and then HTTP/2 with a bound on the resets a connection may
send (`_BoundedH2`).
"""

from __future__ import annotations

import h2.errors
import h2.events
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, RawData
from hypercorn.protocol.events import EndBody
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.protocol.h11 import H2CProtocolRequiredError, H2ProtocolAssumedError, H11Protocol
from hypercorn.trio import tcp_server

H2_MAX_CONCURRENT_STREAMS = 100
"""Streams one HTTP/2 connection may have open at once (a client opening more is disconnected)."""

H2_RESET_ALLOWANCE = 10
"""How many more streams an HTTP/2 client may reset than it lets complete: one over, and the
connection gets GOAWAY (ENHANCE_YOUR_CALM) and is closed."""


class ServerConfig(HypercornConfig):
    """hypercorn's config with the gateway's choice of HTTP versions."""

    http2 = False
    """Whether HTTP/2 is spoken (in cleartext: prior knowledge or h2c upgrade) besides HTTP/1.1."""
    h2_max_concurrent_streams = H2_MAX_CONCURRENT_STREAMS


class ConnectionProtocol:
    """hypercorn's `ProtocolWrapper` (one per connection) with the gateway's HTTP versions:
    HTTP/1.1, or with `config.http2` also HTTP/2 with bounded resets. A client sending the
    HTTP/2 preface to an HTTP/1.1-only listener is disconnected."""

    def __init__(self, app, config: ServerConfig, context, task_group, state, ssl, client, server, send, alpn=None):
        self._arguments = (app, config, context, task_group, state, ssl, client, server, send)
        self._http2 = config.http2
        self._send = send
        if not self._http2:
            self.protocol = _Http11Only(*self._arguments)
        elif alpn == "h2":
            self.protocol = _BoundedH2(*self._arguments)
        else:
            self.protocol = H11Protocol(*self._arguments)

    async def initiate(self) -> None:
        await self.protocol.initiate()

    async def handle(self, event) -> None:
        try:
            await self.protocol.handle(event)
        except H2ProtocolAssumedError as error:
            if not self._http2:
                await self._send(Closed())
                return
            self.protocol = _BoundedH2(*self._arguments)
            await self.protocol.initiate()
            if error.data:
                await self.protocol.handle(RawData(data=error.data))
        except H2CProtocolRequiredError as error:  # raised only with http2 on
            self.protocol = _BoundedH2(*self._arguments)
            await self.protocol.initiate(error.headers, error.settings)
            if error.data:
                await self.protocol.handle(RawData(data=error.data))


def use_connection_protocol() -> None:
    """Make hypercorn's trio servers in this process use `ConnectionProtocol` for each
    connection (hypercorn offers no other way to choose)."""
    tcp_server.ProtocolWrapper = ConnectionProtocol


class _Http11Only(H11Protocol):
    """hypercorn's HTTP/1.1 that never switches to HTTP/2: `Upgrade: h2c` is ignored (as RFC 9110
    allows a server to), and the prior-knowledge preface still raises H2ProtocolAssumedError, for
    `ConnectionProtocol` to refuse."""

    async def _check_protocol(self, event) -> None:
        if event.method == b"PRI":
            await super()._check_protocol(event)


class _BoundedH2(H2Protocol):
    """hypercorn's HTTP/2 with an allowance of resets per connection (H2_RESET_ALLOWANCE, one
    back for each response completed) and no application started for a stream the client
    opened and reset in the same read."""

    def __init__(self, *arguments) -> None:
        super().__init__(*arguments)
        self._reset_allowance = H2_RESET_ALLOWANCE

    async def _handle_events(self, events: list[h2.events.Event]) -> None:
        reset_here = {
            event.stream_id
            for event in events
            if isinstance(event, h2.events.StreamReset) and event.remote_reset and event.stream_id not in self.streams
        }
        kept = []
        for event in events:
            if isinstance(event, h2.events.StreamReset) and event.remote_reset:
                self._reset_allowance -= 1
                if self._reset_allowance < 0:
                    await super()._handle_events(kept)
                    self.connection.close_connection(error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
                    await self._flush()
                    await self.send(Closed())
                    return
            if getattr(event, "stream_id", None) in reset_here:
                if isinstance(event, h2.events.DataReceived):  # the connection's window must move on
                    self.connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                continue
            kept.append(event)
        await super()._handle_events(kept)

    async def stream_send(self, event) -> None:
        if isinstance(event, EndBody):
            self._reset_allowance = min(self._reset_allowance + 1, H2_RESET_ALLOWANCE)
        await super().stream_send(event)

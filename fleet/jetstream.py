"""The fleet's JetStream: its streams, its lease key and its subjects, as trio calls.

Every call crosses to nats-py through `fleet.bridge` and has a deadline (OPERATION_SECONDS). The
names all start with the fleet's `name` (N below):

- stream `N-events` (subject `N.events`): the fleet's event log. Each message holds a batch of
  consecutive events, as JSON Lines numbered as the event log writes them (a message's stream
  sequence is the message's, not its events'). Only the leader appends, each append
  conditional on the stream's last message sequence (the `Nats-Expected-Last-Sequence`
  header), so a stale leader's batch is refused whole and the event seqs stay gapless;
- stream `N-checkpoints` (subject `N.checkpoints`): the leader's `Checkpoint`s, each naming the
  event seq its state includes, and in a header (CHECKPOINT_MESSAGE_HEADER) the last message
  of the event stream whose events it includes all of; a replica starts from the newest;
- key-value bucket `N-leader`, key `leader`: the lease. Its TTL is the lease, so a leader that
  stops renewing loses it; the value is the leader's replica name;
- key-value bucket `N-replicas`, a key per replica name: who holds the name (`NameHolder`:
  host, process, listen address), renewed every `lease_renewal`, its TTL the lease, so a name
  is free a lease after its replica stopped;
- key-value bucket `N-config`, key `config`: the fleet's config document (`fleet.document`),
  its revision the config's version; proposed by `fleet config push` and a replica's SIGHUP,
  applied by the leader as the reload event;
- subject `N.observations` (core NATS, no stream): what replicas' data planes observe, for the
  leader to number;
- stream `N-decisions` (subject `N.decisions`): every replica's decision records, a batch of
  JSON Lines per message (`fleet.decisions`).
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import NamedTuple

import msgspec
import nats
import nats.errors
import nats.js.errors
import trio
from nats.js.api import StreamConfig

from events.config import FleetConfig
from events.log import decode_event, decode_events
from events.types import Checkpoint, Event
from fleet.bridge import AsyncioThread, Delivery, DeliveryOverflowed, open_asyncio_thread
from fleet.credentials import connect_options

OPERATION_SECONDS = 5.0
"""The deadline of one JetStream request (an append, a lease renewal, a lookup)."""

EVENT_RETENTION_SECONDS = 7 * 24 * 3600.0
EVENT_RETENTION_BYTES = 4 * 1024**3
CHECKPOINTS_KEPT = 16
MAX_DERIVED_REPLICAS = 3
"""The copies JetStream keeps of each stream unless `fleet.stream_replicas` says: one per
server of the cluster, up to three (a quorum survives one server lost)."""

NATS_ERRORS = (nats.errors.Error, nats.js.errors.Error, trio.TooSlowError, OSError)
"""What a call to NATS may raise when NATS is unreachable, slow or refuses it."""

READ_BATCH = 256
"""Messages one read of a stream asks for (export)."""

CHECKPOINT_MESSAGE_HEADER = "Interlock-Message-Seq"
"""A checkpoint's header: the event stream's last message whose events its state includes."""
CHECKPOINT_STREAM_HEADER = "Interlock-Events-Created"
"""A checkpoint's header: when the event stream it is of was created (a new store makes a new one)."""

LEASE_KEY = "leader"
CONFIG_KEY = "config"
CONFIG_VERSIONS_KEPT = 16
"""Versions of the fleet's config document the bucket keeps (the newest is the one in force)."""
WRONG_LAST_SEQUENCE = 10071
"""JetStream's error code for an append whose expected last sequence is not the stream's."""


def _gone(earlier: NameHolder, holder: NameHolder) -> bool:
    """Whether `earlier` was a process of this host (`holder`'s) that no longer runs."""
    if earlier.host != holder.host:
        return False
    if earlier.pid == holder.pid:
        return True  # this process, or in a container where every run is pid 1
    try:
        os.kill(earlier.pid, 0)  # signal 0: only whether the process exists
    except ProcessLookupError:
        return True
    except PermissionError:  # it exists, another user's
        pass
    return False


class EventMessage(NamedTuple):
    """One message of the event stream as a consumer receives it: its sequence, its batch of
    events, and when JetStream stored it (UNIX seconds by the NATS server's clock)."""

    seq: int
    data: bytes
    appended_at: float


class NameHolder(msgspec.Struct, frozen=True):
    """The process holding a replica name (`N-replicas`)."""

    host: str
    pid: int
    listen: str

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.host}, listening on {self.listen}"


class NameHeld(Exception):
    """The replica name is held by another live replica (`holder`)."""

    def __init__(self, name: str, holder: NameHolder | None) -> None:
        described = "another replica" if holder is None else f"a live replica ({holder})"
        super().__init__(f"the replica name {name!r} is held by {described}; give each replica its own [fleet] replica")
        self.holder = holder


class AppendRefused(Exception):
    """The stream's last sequence was not the one expected: another leader has appended."""


@dataclass(frozen=True)
class StoredCheckpoint:
    """A checkpoint as the checkpoint stream holds it: the encoded `Checkpoint` and the event
    stream's last message its state includes every event of."""

    line: bytes
    message_seq: int
    events_created: str = ""
    """When the event stream it is of was created (`FleetLink.events_created`, as text); "" unknown."""


UNDECODABLE = "undecodable"
OUT_OF_SEQUENCE = "out_of_sequence"


class MessageSetAside(Exception):
    """A message of the event stream whose events do not continue the fleet's: it does not
    decode (`kind` UNDECODABLE) or its events are not the next ones (OUT_OF_SEQUENCE)."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


def continuing_events(message: bytes, expected: int) -> list[Event]:
    """The events of one message of the event stream from seq `expected` on (those before it:
    redelivered, or in the checkpoint a replica started from), in order; MessageSetAside when
    the message does not decode, or its events are not `expected`, `expected + 1`, …"""
    try:
        events = [event for event in decode_events(message) if event.seq >= expected]
    except msgspec.DecodeError as error:
        raise MessageSetAside(UNDECODABLE, f"does not decode: {error}") from None
    if events and [event.seq for event in events] != list(range(expected, expected + len(events))):
        got = ",".join(str(event.seq) for event in events[:3]) + (",…" if len(events) > 3 else "")
        raise MessageSetAside(OUT_OF_SEQUENCE, f"events {got} where event {expected} was next")
    return events


def checkpoint_in(line: bytes) -> Checkpoint:
    """The checkpoint a message of the checkpoint stream holds; ValueError (msgspec's
    DecodeError is one) when it does not decode or holds another event."""
    checkpoint = decode_event(line)
    if not isinstance(checkpoint, Checkpoint):
        raise ValueError(f"a {type(checkpoint).__name__}, not a checkpoint")
    return checkpoint


def stored_checkpoint(data: bytes, headers: dict[str, str] | None) -> StoredCheckpoint:
    """A message of the checkpoint stream as a `StoredCheckpoint`; ValueError when its header
    is not a number, or, without one, its event does not decode."""
    headers = headers or {}
    created = headers.get(CHECKPOINT_STREAM_HEADER, "")
    if CHECKPOINT_MESSAGE_HEADER in headers:
        return StoredCheckpoint(data, int(headers[CHECKPOINT_MESSAGE_HEADER]), created)
    # written before a message held a batch: one event a message, its sequence the event's
    return StoredCheckpoint(data, decode_event(data).seq, created)


@dataclass(frozen=True)
class Names:
    """The fleet's stream, subject and bucket names."""

    fleet: str

    @property
    def events(self) -> str:
        return f"{self.fleet}-events"

    @property
    def checkpoints(self) -> str:
        return f"{self.fleet}-checkpoints"

    @property
    def decisions(self) -> str:
        return f"{self.fleet}-decisions"

    @property
    def lease(self) -> str:
        return f"{self.fleet}-leader"

    @property
    def replicas(self) -> str:
        return f"{self.fleet}-replicas"

    @property
    def config(self) -> str:
        return f"{self.fleet}-config"

    def subject(self, what: str) -> str:
        return f"{self.fleet}.{what}"


@contextlib.asynccontextmanager
async def command_link(fleet: FleetConfig) -> AsyncIterator[FleetLink]:
    """A link of a command's (`fleet export`, `fleet config push`) to the fleet's JetStream, on
    a bridge of its own whose failures are raised: it finds the streams and creates nothing. A
    connection that does not succeed fails naming the errors the servers gave meanwhile."""

    def report(error: BaseException) -> None:
        raise error

    client_errors: collections.deque[str] = collections.deque(maxlen=8)
    async with open_asyncio_thread(report) as bridge:
        link = FleetLink(bridge, fleet, client_errors.append)
        try:
            try:
                await link.connect(create=False)
            except NATS_ERRORS as error:
                if client_errors:  # what the servers said while the client kept trying (an authorization refused)
                    timed_out = isinstance(error, trio.TooSlowError)
                    failed = "no connection in time" if timed_out else str(error) or repr(error)
                    said = "; ".join(dict.fromkeys(client_errors))
                    raise nats.errors.Error(f"{failed} (the servers said: {said})") from None
                raise
            yield link
        finally:
            await link.close()


class FleetLink:
    """One replica's connection to the fleet's JetStream (trio side; see the module docstring)."""

    def __init__(
        self, bridge: AsyncioThread, fleet: FleetConfig, on_error: Callable[[str], None] = lambda _: None
    ) -> None:
        """`on_error(description)` is called on the trio thread with what the client reports in
        the background (a reconnection refused, a connection cut), once per change of it."""
        self._bridge = bridge
        self._fleet = fleet
        self._on_error = on_error
        self._last_error = ""
        self.names = Names(fleet.name)
        self._nc = None
        self._js = None
        self._kv = None
        self._names = None
        self._config = None
        self.events_created = None
        """When the event stream was created, as last read (a new store makes a new stream)."""
        self.connected = trio.Event()
        """Set once connected and the streams exist; a new Event after a disconnection."""

    @property
    def is_connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    async def connect(self, *, create: bool = True) -> None:
        """Connect (nats-py reconnects by itself after that) and find the streams and the lease
        bucket, creating those missing (not with `create` false: a reader), kept
        `stream_replicas` times. An existing stream is used as it is, so replicas need not agree
        on their URL lists. Raises on failure; the caller retries."""
        if self._nc is not None and not self._nc.is_closed:
            await self.close()  # a connection left from a `create=False` connect
        mark_connected = self._bridge.to_trio(self._connection_changed)

        async def changed() -> None:
            mark_connected()

        report_error = self._bridge.to_trio(self._client_error)

        async def error(error: Exception) -> None:
            report_error(str(error) or repr(error))

        self._nc = await self._call(
            nats.connect,
            list(self._fleet.nats),
            name=f"interlock {self._fleet.replica}",
            connect_timeout=2,
            reconnect_time_wait=0.5,
            max_reconnect_attempts=-1,
            disconnected_cb=changed,
            reconnected_cb=changed,
            error_cb=error,
            **connect_options(self._fleet),
        )
        self._js = self._nc.jetstream(timeout=OPERATION_SECONDS)
        if not create:
            return
        await self.create_missing()
        self.connected.set()

    async def create_missing(self) -> None:
        """Find the streams and the buckets, creating those missing (at connect, and when NATS
        comes back without its store)."""
        replicas = self._fleet.stream_replicas or self.derived_stream_replicas()
        names = self.names
        for config in (
            StreamConfig(
                name=names.events,
                subjects=[names.subject("events")],
                max_age=EVENT_RETENTION_SECONDS,
                max_bytes=EVENT_RETENTION_BYTES,
                num_replicas=replicas,
            ),
            StreamConfig(
                name=names.checkpoints,
                subjects=[names.subject("checkpoints")],
                max_msgs=CHECKPOINTS_KEPT,
                num_replicas=replicas,
            ),
            StreamConfig(
                name=names.decisions,
                subjects=[names.subject("decisions")],
                max_age=EVENT_RETENTION_SECONDS,
                max_bytes=EVENT_RETENTION_BYTES,
                num_replicas=replicas,
            ),
        ):
            try:
                await self._call(self._js.stream_info, config.name)
            except nats.js.errors.NotFoundError:
                await self._call(self._js.add_stream, config)
        self._kv = await self._bucket(names.lease, replicas)
        self._names = await self._bucket(names.replicas, replicas)
        await self.open_config_bucket()

    async def _bucket(self, name: str, replicas: int):
        """The key-value bucket `name`, its keys lasting a lease unless renewed (created if missing)."""
        try:
            return await self._call(self._js.key_value, name)
        except nats.js.errors.BucketNotFoundError:
            return await self._call(
                self._js.create_key_value, bucket=name, ttl=self._fleet.lease, history=1, replicas=replicas
            )

    def derived_stream_replicas(self) -> int:
        """The servers this connection knows (configured, and told of by the cluster), up to
        MAX_DERIVED_REPLICAS."""
        return min(MAX_DERIVED_REPLICAS, len({server.netloc for server in self._nc.servers}))

    def _client_error(self, description: str) -> None:
        if description != self._last_error:
            self._last_error = description
            self._on_error(description)

    def _connection_changed(self) -> None:
        if self.is_connected:
            self._last_error = ""
            self.connected.set()
        elif self.connected.is_set():
            self.connected = trio.Event()

    async def close(self) -> None:
        """Close the connection; a failure to flush what was pending (the server gone) is
        not one to report: the connection is closed all the same."""
        if self._nc is not None:
            with trio.move_on_after(OPERATION_SECONDS), contextlib.suppress(nats.errors.Error, OSError):
                await self._bridge.call(self._nc.close)

    async def _call(self, fn, *args, **kwargs):
        return await self._call_within(OPERATION_SECONDS, fn, *args, **kwargs)

    async def _call_within(self, seconds: float, fn, *args, **kwargs):
        with trio.fail_after(seconds):
            return await self._bridge.call(fn, *args, **kwargs)

    # --- the lease ------------------------------------------------------------------------

    async def take_lease(self, replica: str) -> int:
        """Create the lease key (it must not exist); its revision. A key that already names
        `replica` is its own (a create whose answer was lost, or its process restarted within
        the lease: names are unique, `claim_name`): its revision. KeyWrongLastSequenceError
        when another replica holds it. Like every lease call, gives up after half the lease, so
        that after an outage the lease is asked for again soon once JetStream answers."""
        try:
            return await self._call_within(self._fleet.lease / 2, self._kv.create, LEASE_KEY, replica.encode())
        except nats.js.errors.KeyWrongLastSequenceError:
            entry = await self._call_within(self._fleet.lease / 2, self._kv.get, LEASE_KEY)
            if (entry.value or b"").decode() != replica:
                raise
            return entry.revision

    async def renew_lease(self, replica: str, revision: int) -> int:
        """Update the lease key against its last revision; the new one.
        KeyWrongLastSequenceError when the lease has passed to another replica."""
        return await self._call_within(
            self._fleet.lease / 2, self._kv.update, LEASE_KEY, replica.encode(), last=revision
        )

    async def lease_holder(self) -> str:
        """The replica holding the lease, or "" when none does."""
        try:
            entry = await self._call(self._kv.get, LEASE_KEY)
        except nats.js.errors.KeyNotFoundError:
            return ""
        return (entry.value or b"").decode()

    # --- replica names --------------------------------------------------------------------

    async def claim_name(self, holder: NameHolder) -> int:
        """Hold this replica's name for `holder`; the key's revision. Taken over from an earlier
        process of this host that is gone; NameHeld when another replica holds it (the caller
        waits a lease for a name left by a replica that stopped)."""
        name = self._fleet.replica
        try:
            return await self._call(self._names.create, name, msgspec.json.encode(holder))
        except nats.js.errors.KeyWrongLastSequenceError:
            pass
        try:
            entry = await self._call(self._names.get, name)
        except nats.js.errors.KeyNotFoundError:
            raise NameHeld(name, None) from None  # gone meanwhile: the caller tries again
        try:
            earlier = msgspec.json.decode(entry.value or b"", type=NameHolder)
        except msgspec.DecodeError:
            earlier = None
        if earlier is None or not _gone(earlier, holder):
            raise NameHeld(name, earlier)
        return await self._call(self._names.update, name, msgspec.json.encode(holder), last=entry.revision)

    async def renew_name(self, holder: NameHolder, revision: int) -> int:
        """Renew the name's key against its last revision; the new one. NameHeld when another
        replica has taken it (this one's lapsed while it could not renew)."""
        try:
            return await self._call(self._names.update, self._fleet.replica, msgspec.json.encode(holder), last=revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            return await self.claim_name(holder)

    # --- the fleet's config document ------------------------------------------------------

    async def open_config_bucket(self) -> None:
        """Find the config document's bucket, creating it if missing (no TTL: the document
        stays until replaced; CONFIG_VERSIONS_KEPT versions kept)."""
        try:
            self._config = await self._call(self._js.key_value, self.names.config)
        except nats.js.errors.BucketNotFoundError:
            replicas = self._fleet.stream_replicas or self.derived_stream_replicas()
            self._config = await self._call(
                self._js.create_key_value, bucket=self.names.config, history=CONFIG_VERSIONS_KEPT, replicas=replicas
            )

    async def config_document(self) -> tuple[bytes, int] | None:
        """The fleet's config document as stored, and its version (the key's revision); None
        when the fleet has none yet."""
        try:
            entry = await self._call(self._config.get, CONFIG_KEY)
        except nats.js.errors.KeyNotFoundError:
            return None
        return entry.value or b"", entry.revision

    async def seed_config(self, document: bytes) -> int:
        """Store the fleet's first config document; its version. KeyWrongLastSequenceError when
        the fleet has one already (another replica seeded it first)."""
        return await self._call(self._config.create, CONFIG_KEY, document)

    async def propose_config(self, document: bytes) -> int:
        """Store a new version of the fleet's config document (the leader applies it); its version."""
        return await self._call(self._config.put, CONFIG_KEY, document)

    # --- the event stream -----------------------------------------------------------------

    async def message_seqs(self) -> tuple[int, int]:
        """The event stream's first and last message sequences ((0, 0) or (1, 0) when empty);
        when the stream was created is kept in `events_created`."""
        info = await self._call(self._js.stream_info, self.names.events)
        self.events_created = info.created
        return info.state.first_seq, info.state.last_seq

    async def append(self, lines: bytes, expected_last_seq: int, seconds: float = OPERATION_SECONDS) -> int:
        """Append one message (a batch of encoded events) if the stream's last message sequence
        is `expected_last_seq`; its sequence. AppendRefused otherwise: the batch is refused
        whole. Gives up (trio.TooSlowError) after `seconds`: the leader's is a fraction of its
        lease, so an append to a stream whose leading server is lost ends the term soon and
        the next term appends once JetStream has elected another."""
        headers = {"Nats-Expected-Last-Sequence": str(expected_last_seq)}
        subject = self.names.subject("events")
        try:
            ack = await self._call_within(seconds, self._js.publish, subject, lines, headers=headers, timeout=seconds)
        except nats.js.errors.APIError as error:
            if error.err_code == WRONG_LAST_SEQUENCE:
                raise AppendRefused(error.description) from None
            raise
        return ack.seq

    def delivery(self, capacity: int, on_drop: Callable[[], None], *, lossy: bool = False) -> Delivery:
        """A bounded channel for `follow_events` or `receive_observations` (`fleet.bridge.Delivery`)."""
        return self._bridge.delivery(capacity, on_drop, lossy=lossy)

    async def follow_events(self, start_seq: int, delivery: Delivery[EventMessage]):
        """An ordered consumer of the event stream from message `start_seq`, each message put
        in `delivery` in order (the loop never waits for trio: a receiver fallen behind loses
        the rest and reads again from its last). Returns the subscription."""

        async def on_message(msg) -> None:
            delivery.put(EventMessage(msg.metadata.sequence.stream, msg.data, msg.metadata.timestamp.timestamp()))

        return await self._call(
            self._js.subscribe,
            self.names.subject("events"),
            cb=on_message,
            ordered_consumer=True,
            deliver_policy=nats.js.api.DeliverPolicy.BY_START_SEQUENCE,
            config=nats.js.api.ConsumerConfig(opt_start_seq=start_seq),
        )

    async def unsubscribe(self, subscription) -> None:
        with trio.move_on_after(OPERATION_SECONDS):
            await self._bridge.call(subscription.unsubscribe)

    async def read_messages(
        self, start_seq: int, end_seq: int, on_drop: Callable[[], None] = lambda: None
    ) -> list[tuple[int, bytes]]:
        """The stream's messages from `start_seq` through `end_seq` in order, as (seq, data), as
        an ordered consumer delivers them (export; again from the last one read when the reader
        falls behind it, `on_drop` called for each message dropped). Fails when none arrives for
        OPERATION_SECONDS."""
        messages: list[tuple[int, bytes]] = []
        while not messages or messages[-1][0] < end_seq:
            delivery = self.delivery(READ_BATCH, on_drop)
            subscription = await self.follow_events(messages[-1][0] + 1 if messages else start_seq, delivery)
            try:
                while not messages or messages[-1][0] < end_seq:
                    with trio.fail_after(OPERATION_SECONDS):
                        message = await delivery.receive()
                    messages.append((message.seq, message.data))
            except DeliveryOverflowed:
                continue
            finally:
                delivery.close()
                with trio.CancelScope(shield=True):
                    await self.unsubscribe(subscription)
        return messages

    # --- checkpoints and observations -----------------------------------------------------

    async def publish_checkpoint(self, checkpoint: StoredCheckpoint) -> None:
        """Publish `checkpoint`, naming the event stream it is of as last read here."""
        headers = {CHECKPOINT_MESSAGE_HEADER: str(checkpoint.message_seq)}
        if self.events_created is not None:
            headers[CHECKPOINT_STREAM_HEADER] = str(self.events_created)
        await self._call(self._js.publish, self.names.subject("checkpoints"), checkpoint.line, headers=headers)

    async def newest_checkpoint(self) -> StoredCheckpoint | None:
        try:
            message = await self._call(self._js.get_last_msg, self.names.checkpoints, self.names.subject("checkpoints"))
        except nats.js.errors.NotFoundError:
            return None
        return stored_checkpoint(message.data, message.headers)

    async def receive_checkpoints(self, delivery: Delivery[tuple[bytes, dict[str, str] | None]]):
        """Subscribe to the checkpoints as the leader publishes them, each put in `delivery` as
        its data and headers (`stored_checkpoint` reads them; a `lossy` delivery: a checkpoint
        missed is one comparison less); the subscription."""

        async def on_message(msg) -> None:
            delivery.put((msg.data, msg.headers))

        return await self._call(self._nc.subscribe, self.names.subject("checkpoints"), cb=on_message)

    def publish_observation(self, line: bytes) -> None:
        """Send a data-plane observation to the leader; never blocks (at most once)."""
        if self._nc is not None:
            self._bridge.submit(self._nc.publish, self.names.subject("observations"), line)

    async def receive_observations(self, delivery: Delivery[bytes]):
        """Subscribe to the replicas' observations, each put in `delivery` (a `lossy` one: they
        are sent at most once); the subscription."""

        async def on_message(msg) -> None:
            delivery.put(msg.data)

        return await self._call(self._nc.subscribe, self.names.subject("observations"), cb=on_message)

    # --- decision records -----------------------------------------------------------------

    async def publish_decisions(self, lines: bytes, message_id: str) -> None:
        """Append a batch of decision records; JetStream drops a second message with the same
        `message_id` (a batch sent again after an unknown outcome)."""
        headers = {"Nats-Msg-Id": message_id}
        await self._call(self._js.publish, self.names.subject("decisions"), lines, headers=headers)

    async def read_decision_batches(self):
        """Every message of the decision stream, oldest first (export); none when the fleet
        has no decision stream."""
        try:
            info = await self._call(self._js.stream_info, self.names.decisions)
        except nats.js.errors.NotFoundError:
            return
        last = info.state.last_seq
        if info.state.messages == 0:
            return
        config = nats.js.api.ConsumerConfig(
            ack_policy=nats.js.api.AckPolicy.NONE, inactive_threshold=OPERATION_SECONDS * 2, mem_storage=True
        )
        subscription = await self._call(
            self._js.pull_subscribe, self.names.subject("decisions"), stream=self.names.decisions, config=config
        )
        try:
            seq = 0
            while seq < last:
                for message in await self._call(subscription.fetch, READ_BATCH, timeout=OPERATION_SECONDS / 2):
                    seq = message.metadata.sequence.stream
                    yield message.data
        finally:
            await self.unsubscribe(subscription)

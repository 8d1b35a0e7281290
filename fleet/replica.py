"""A replica of the fleet: the control plane of one host, following the fleet's event stream.

`FleetControlPlane` is a control plane built of the gateway's `ControlPlane`'s parts whose
events are numbered by the fleet's leader, not by itself. Its tasks (children of `run`):

- the follower applies the event stream in order, each message's batch of events decoded in
  one call and applied in one go through the runtime's own apply path
  (`Applier.apply`: the same `reduce`, logs, metrics and listeners, so the
  replica's workers follow it as they follow a single-host gateway), starting from the newest
  checkpoint. Messages reach it through a bounded `Delivery`: one it has no room for is dropped
  and counted, and the follower reads the stream again from its last whole message. A message
  whose events do not continue the fleet's (`continuing_events`: it does not decode, or is out
  of sequence, read again a few times first) is set aside, logged and counted. Until the
  first fleet event arrives the replica routes on its own config (the state at seq 0), so the
  data plane never waits on NATS;
- the watch reads, every `lease_renewal`, the stream's last message sequence and the lease
  holder: what `X-Interlock-Degraded` (`degraded_reason`), `interlock_fleet_messages_behind` and
  `X-Interlock-Leader` answer with, and whether the follower has stalled (messages behind the
  stream, nothing applied for a lease since it subscribed: an ordered consumer can stay silent
  with no gap to show it), which then resubscribes. Behind is counted in messages, the
  stream's unit (an event seq is inside a message, not in the stream's state);
- the campaign takes the lease when no one holds it (`kv.create`) and, once leader, renews it
  against its last revision every `lease_renewal`. The term ends when a renewal is refused, an
  append is refused or fails (a NATS failure ends the term, never the process), or the lease
  runs out without a renewal (a cancel scope whose deadline is the lease's end, moved on by
  each renewal);
- while leader, the term reads the stream's last message sequence, follows the stream to it,
  appends the fleet's config numbered after the last event applied (`RunStarted` on an empty
  stream, else `ConfigReloaded`: the fleet's config document's, `fleet.document`, never this
  replica's file's; this first append fences off a deposed leader), publishes a checkpoint,
  appends each new version of the document as the reload event, then probes the nodes and appends the events (the
  prober's, and the replicas' observations): every event waiting in its queue, up to
  BATCH_EVENTS or BATCH_BYTES, numbered on from the last event seq, as one message conditional
  on the stream's last message sequence (one quorum round trip per batch, not per event);
  refused while it still holds the lease, it follows the stream past the message another
  publisher put there and numbers the batch on again. While events keep coming it appends at
  most once every APPEND_INTERVAL, the events of the interval in one message (each message
  costs every follower a delivery and a wake-up); an event after a quiet interval is appended
  at once. A checkpoint follows every CHECKPOINT_SECONDS.

A replica's data-plane observations go to the leader over NATS; the leader numbers them like
any event. After `partition_after` without the stream, a replica that does not lead enters a
partition (`fleet.partition`: it probes and numbers its own events) until the fleet's events
flow again (the follower's next message, a term's start).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import nats.js.errors
import prometheus_client
import trio

from controlplane.effects.applier import Applier
from controlplane.effects.control_plane import load_config_logging_unknown_keys
from controlplane.effects.event_queue import EventQueue
from controlplane.effects.held_state import HeldState
from controlplane.effects.lifecycle import Lifecycle
from controlplane.effects.metrics import ControlPlaneMetrics
from controlplane.effects.prober import Prober
from controlplane.effects.probes import ProbeClient
from controlplane.infrastructure.config import NO_OVERRIDES, Overrides, fleet_config_digest, fleet_wide
from controlplane.infrastructure.logs import JsonLog
from events.config import RESTART_KEYS, Config, FleetConfig
from events.log import decode_event, encode_event
from events.types import Checkpoint, ConfigReloaded, Event, RunStarted
from fleet.agreement import StateAgreement
from fleet.bridge import DeliveryOverflowed, open_asyncio_thread
from fleet.decisions import FleetDecisions
from fleet.document import ConfigDocument, decode_document, encode_document
from fleet.jetstream import (
    NATS_ERRORS,
    OUT_OF_SEQUENCE,
    AppendRefused,
    FleetLink,
    MessageSetAside,
    NameHeld,
    NameHolder,
    StoredCheckpoint,
    checkpoint_in,
    continuing_events,
    stored_checkpoint,
)
from fleet.partition import Partitions

CONNECT_RETRY_SECONDS = 1.0
"""The pause between attempts to reach NATS (the replica serves on meanwhile)."""

CHECKPOINT_SECONDS = 30.0
"""How often the leader publishes a checkpoint (also at the start of each term)."""

FOLLOW_BUFFER = 256
"""Delivered messages waiting to be applied; beyond that they are dropped and the follower
reads the stream again from its last whole message."""

OBSERVATION_BUFFER = 1024
"""Replicas' observations on their way to the leader's queue; beyond that they are dropped
and counted (`interlock_observations_dropped_total`), as the queue's own overflow is."""

CHECKPOINTS_WAITING = 4
"""Checkpoints received and not yet compared with this replica's state; beyond that they are
dropped (one comparison less)."""

OUT_OF_SEQUENCE_RETRIES = 3
OUT_OF_SEQUENCE_FIRST_PAUSE = 0.25
"""A message of the event stream out of sequence is read again (the follower resubscribes,
from a newer checkpoint if there is one) this many times, after a pause doubling from the
first, before the follower sets it aside and goes on: never a tight loop, and every replica
ends where the leader does (it numbers on from the events it applied, not from that message)."""

BEHIND_TOLERATED = 10
"""Messages a replica may be behind the stream's last message and still call itself current
(the messages in flight between the leader's append and this replica's apply)."""

APPEND_INTERVAL = 0.02
"""The leader's least time between the starts of two appends while events keep coming."""

BATCH_EVENTS = 256
BATCH_BYTES = 512 * 1024
"""The bounds of one appended message: the leader stops taking waiting events at either (a
message is at most BATCH_BYTES plus one event, well inside NATS's default 1 MiB payload)."""


@dataclass(frozen=True)
class StreamEnd:
    """The event stream's end as the leader knows it: its last message (the fence of the next
    append) and its last event (the next batch is numbered on from it)."""

    message_seq: int
    event_seq: int


class FleetMetrics:
    def __init__(self, registry: prometheus_client.CollectorRegistry, replica: FleetControlPlane) -> None:
        self.seconds_since_applied = prometheus_client.Gauge(
            "interlock_fleet_seconds_since_applied",
            "Seconds since this replica applied an event of the fleet's stream",
            registry=registry,
        )
        self.seconds_since_applied.set_function(replica.seconds_since_applied)
        self.messages_behind = prometheus_client.Gauge(
            "interlock_fleet_messages_behind",
            "Messages (batches of events) of the fleet's stream (to its last, as last read) this replica has not applied",
            registry=registry,
        )
        self.degraded = prometheus_client.Gauge(
            "interlock_fleet_degraded",
            "1 while this replica, ready, routes on state that may be behind the fleet's (X-Interlock-Degraded says why: "
            "not connected to NATS, behind the stream, no leader, a message out of sequence, a state disagreeing "
            "with the leader's checkpoint)",
            registry=registry,
        )
        self.degraded.set_function(lambda: 1.0 if replica.degraded_reason() else 0.0)
        self.leader = prometheus_client.Gauge(
            "interlock_fleet_leader", "1 while this replica is the fleet's leader", registry=registry
        )
        self.leadership_changes = prometheus_client.Counter(
            "interlock_fleet_leadership_changes_total", "Terms this replica began as the fleet's leader", registry=registry
        )
        self.apply_delay = prometheus_client.Histogram(
            "interlock_fleet_apply_delay_seconds",
            "Per message of the fleet's stream: from its append (the NATS server's clock) to the apply here of its last "
            "event (this host's clock)",
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=registry,
        )
        self.deliveries_dropped = prometheus_client.Counter(
            "interlock_fleet_deliveries_dropped_total",
            "Messages of the fleet's stream dropped on their way to this replica's follower, which had fallen a "
            "whole buffer behind (it then read the stream again from its last whole message: nothing is lost)",
            registry=registry,
        )
        self.bridge_failures = prometheus_client.Counter(
            "interlock_fleet_bridge_failures_total",
            "Callbacks handed from the NATS client's thread to trio that raised (each logged; the gateway serves on)",
            registry=registry,
        )
        self.messages_set_aside = prometheus_client.Counter(
            "interlock_fleet_messages_set_aside_total",
            "Messages on the fleet's subjects this replica set aside (each logged): on the event stream, one that "
            "does not decode or whose events do not continue the fleet's; a checkpoint or an observation that does "
            "not decode",
            ["subject", "reason"],
            registry=registry,
        )
        self.appends_refused = prometheus_client.Counter(
            "interlock_fleet_appends_refused_total",
            "Appends refused because another leader had appended (this replica then stepped down)",
            registry=registry,
        )


class FleetControlPlane:
    """The control plane of one replica: follows, and when elected leads, the fleet (module
    docstring). Built of the parts of the gateway's `ControlPlane`: the state it holds and the
    data plane reads (`view`), the apply path (`applier`: the same `reduce`, logs, metrics and
    listeners), the leader's event queue and prober, the lifecycle and its signals."""

    def __init__(
        self,
        config_path: str | os.PathLike[str],
        *,
        config: Config,
        version: str,
        overrides: Overrides = NO_OVERRIDES,
        log: JsonLog | None = None,
        registry: prometheus_client.CollectorRegistry | None = None,
        now: Callable[[], float] = time.time,
    ) -> None:
        self.config_path = os.fspath(config_path)
        self.version = version
        self._overrides = overrides
        self.log = log if log is not None else JsonLog(clock=now)
        self.registry = registry if registry is not None else prometheus_client.CollectorRegistry()
        self.metrics = ControlPlaneMetrics(self.registry)
        self.queue = EventQueue(self.metrics.observations_dropped)
        """While leading: the prober's events and the replicas' observations, to be appended."""
        self.view = HeldState(
            now=now, observe=self._observe, stale_reason=self._stale_reason, fleet_headers=self._fleet_headers
        )
        """What the data plane reads (`dataplane.control.ControlPlaneView`)."""
        self.applier = Applier(self.view, self.log, self.metrics)
        self.lifecycle = Lifecycle(self.log, reload=self.reload, stop=self.stop)
        """Its run, stop, reload, and the gateway's signals (it writes no event log: the stream is)."""
        self.fleet: FleetConfig = config.fleet
        self.replica = self.fleet.replica
        self.leader = ""
        """The lease holder's replica name as last seen ("" when unknown or none)."""
        self.is_leader = False
        self._own_config = config
        self._link: FleetLink | None = None
        self._applied_at: float | None = None
        self._applied = trio.Event()
        self._stopped = trio.Event()
        self._revision = 0
        self._following: trio.CancelScope | None = None
        """The follower's current subscription (cancelled by the watch when it stalls)."""
        self._subscribed_at = 0.0
        self._applied_message_seq = 0
        """The event stream's last message whose events this replica has applied all of (or set aside)."""
        self._followed = trio.Event()
        """Set (and replaced) each time `_applied_message_seq` moves on."""
        self._out_of_sequence: tuple[int, int, str] | None = None
        """The message the follower found out of sequence, the times it has read it, and why."""
        self._stream_last_message_seq = 0
        """The stream's last message sequence as the watch last read it."""
        self._behind_since: float | None = None
        self._leaderless_since: float | None = None
        self._last_append_started = float("-inf")
        self._new_store = False
        """Whether the event stream is a new one the follower has not started on yet."""
        self._followed_created = None
        """When the event stream the follower follows was created."""
        self._reached = False
        """Whether NATS was reached once (nats-py reconnects by itself after that)."""
        self._name_holder = NameHolder(socket.gethostname(), os.getpid(), config.gateway.listen)
        self._name_claimed = trio.Event()
        self._name_revision = 0
        self._name_refused = ""
        """Why this replica may not serve as its name ("" unless a live replica holds it)."""
        self._digested: tuple[tuple[Config | None, Config | None], tuple[str, str]] = ((None, None), ("", ""))
        self._differs_logged = ""
        self.fleet_metrics = FleetMetrics(self.registry, self)
        self.decisions = FleetDecisions(
            self.replica, self.log, self.registry, spool_bytes=self.fleet.decision_spool_bytes
        )
        """Where this replica's decision records go: the fleet's decision stream."""
        self.agreement = StateAgreement(self.registry)
        """Whether this replica's state agrees with the leader's checkpoints (`_compare_checkpoints`)."""
        self.partitions = Partitions(
            self.fleet,
            view=self.view,
            applier=self.applier,
            log=self.log,
            registry=self.registry,
            may_partition=lambda: not self.is_leader,
        )
        """Its partitions: routing on its own probes while the stream is away (`fleet.partition`)."""

    # --- what serve and the data plane see --------------------------------------------------

    def seconds_since_applied(self) -> float:
        """Seconds since the last event of the fleet was applied (inf before the first)."""
        return float("inf") if self._applied_at is None else time.monotonic() - self._applied_at

    def _stale_reason(self) -> str:
        """Why this replica is not ready ("" when it is): it cannot route as the fleet, having
        no state of the fleet yet, or its name is another replica's. Ready, it may be degraded
        (`degraded_reason`): it routes on the state it has, as a balancer should let it."""
        if self._name_refused:
            return self._name_refused
        if self.view.snapshot.seq == 0:
            connected = self._link is not None and self._link.is_connected
            return "no event of the fleet applied yet" + ("" if connected else " (not connected to NATS)")
        return ""

    def degraded_reason(self) -> str:
        """Why this replica, ready, may be routing on state behind the fleet's ("" when it is
        not), from what the follower and the watch last saw, never waiting on NATS: it goes on
        serving, and says so (`X-Interlock-Degraded`, `interlock_fleet_degraded`)."""
        if partition := self.partitions.current():
            cut_off = "not connected to NATS; " if self._link is None or not self._link.is_connected else ""
            return f"{cut_off}partitioned ({partition.interval()}): routing on this replica's own probes"
        if self._link is None or not self._link.is_connected:
            return "not connected to NATS"
        if self._out_of_sequence is not None:
            message, reads, reason = self._out_of_sequence
            return f"message {message} of the fleet's event stream is out of sequence ({reason}); read {reads} times"
        if self.agreement.disagreement:
            return self.agreement.disagreement
        lease = self.fleet.lease
        now = time.monotonic()
        if self._behind_since is not None and now - self._behind_since > lease:
            behind = self._stream_last_message_seq - self._applied_message_seq
            return f"{behind} messages behind the fleet's stream for more than the lease ({lease:g}s)"
        if self._leaderless_since is not None and now - self._leaderless_since > lease:
            return f"no replica has held the fleet's lease for more than the lease ({lease:g}s)"
        return ""

    def _fleet_headers(self) -> dict[str, str]:
        """This replica, the leader, and, while this replica may be routing on old state, why
        (`X-Interlock-Stale`, `/ready`'s reason: `/health` says it too) or, ready, why it is
        degraded (`X-Interlock-Degraded`)."""
        headers = {"X-Interlock-Replica": self.replica, "X-Interlock-Leader": self.leader, **self._config_headers()}
        if stale := self._stale_reason():
            headers["X-Interlock-Stale"] = stale
        if degraded := self.degraded_reason():
            headers["X-Interlock-Degraded"] = degraded
        if partition := self.partitions.current():
            headers["X-Interlock-Partition"] = partition.interval()
        elif partition := self.partitions.last():
            headers["X-Interlock-Last-Partition"] = partition.interval()
        return headers

    def _observe(self, event: Event) -> None:
        """A data-plane observation, sent to the leader to be numbered (numbered here in a
        partition); never blocks."""
        if self.partitions.observe(event):
            return
        if self._link is not None:
            self._link.publish_observation(encode_event(event))

    # --- lifecycle --------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.lifecycle.start()
        try:
            seq_zero = fleet_wide(self._own_config)
            own = RunStarted(at=self.view.now(), version=self.version, config_path=self.config_path, config=seq_zero)
            await self.view.upstream_keys.read_before(own)
            self.view.apply(own)  # seq 0: routes on its own config until the fleet's
            self.log.configure(self._own_config.gateway)
            bridge_opened = open_asyncio_thread(
                self._asyncio_failed, log=self.log, count_failure=self.fleet_metrics.bridge_failures.inc
            )
            async with bridge_opened as bridge, ProbeClient() as client:
                self._link = FleetLink(bridge, self.fleet, self._nats_client_error)
                try:
                    await self._connect_at_start()
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._connect)
                        nursery.start_soon(self._follow)
                        nursery.start_soon(self._watch)
                        nursery.start_soon(self._compare_checkpoints)
                        nursery.start_soon(self._campaign, client)
                        nursery.start_soon(self.decisions.run, self._link)
                        nursery.start_soon(self.partitions.run, client)
                        task_status.started()
                        await self._stopped.wait()
                        nursery.cancel_scope.cancel()
                finally:
                    with trio.CancelScope(shield=True):
                        await self._link.close()
        finally:
            self.queue.close()
            self.lifecycle.finished.set()

    async def stop(self) -> None:
        """Leave the fleet (the lease lapses, another replica takes it); idempotent."""
        self.lifecycle.stop()
        self._stopped.set()
        await self.lifecycle.finished.wait()

    async def reload(self) -> bool:
        """SIGHUP: read the config file again, validated here, and propose its fleet-wide part as
        the fleet's config document (the leader applies it as the reload event); a replica key
        changed needs a restart, said in the log."""
        if not self.lifecycle.may_reload:
            return False
        try:
            config = await load_config_logging_unknown_keys(self.config_path, self.log, self._overrides)
        except Exception as error:
            self.log.error("config reload failed; keeping current config", error=str(error))
            return False
        previous, self._own_config = self._own_config, config
        for key in RESTART_KEYS:
            old, new = getattr(previous.gateway, key), getattr(config.gateway, key)
            if old != new:
                self.log.warn(f"gateway.{key} changed; requires restart (a replica's own key)", old=old, new=new)
        if previous.fleet != config.fleet:
            self.log.warn("fleet changed; requires restart (the replica's connection to the fleet)")
        await self._propose_own_file()
        self._note_config_in_force()
        return True

    def _nats_client_error(self, description: str) -> None:
        self.log.warn("fleet: NATS client error", error=description)

    def _asyncio_failed(self, error: BaseException) -> None:
        self.log.warn("fleet: NATS call failed", error=f"{type(error).__name__}: {error}")

    async def _connect_at_start(self) -> None:
        """One attempt to reach NATS before the replica starts; once reached, its name held
        (NameHeld, raised, when a live replica holds it: the replica does not start)."""
        if await self._connect_once():
            await self._claim_name(at_start=True)

    async def _connect(self) -> None:
        """Reach NATS (nats-py reconnects by itself after that), and hold this replica's name
        for good (`_hold_name`)."""
        while not self._reached and not await self._connect_once():
            await trio.sleep(CONNECT_RETRY_SECONDS)
        try:
            if not self._name_claimed.is_set():
                await self._claim_name()
            await self._hold_name()
        except NameHeld as error:
            self._name_refused = str(error)
            self.log.error("fleet: this replica's name is another's; it neither leads nor is ready", error=str(error))

    async def _connect_once(self) -> bool:
        try:
            await self._link.connect()
        except NATS_ERRORS as error:
            self.log.warn("fleet: cannot reach NATS; routing on the last state", error=described(error))
            await self._link.close()
            return False
        self._reached = True
        self.log.info("fleet: connected", replica=self.replica, servers=",".join(self.fleet.nats))
        return True

    async def _claim_name(self, *, at_start: bool = False) -> None:
        """Hold this replica's name: at once when free (or left by an earlier process of this
        host), else once the replica that held it has been gone a lease; NameHeld when it is
        still held then (renewed: a live replica). A NATS failure is retried, except at start
        (the replica starts, and `_connect` claims the name later)."""
        held_since = None
        while True:
            try:
                self._name_revision = await self._link.claim_name(self._name_holder)
            except NameHeld:
                now = trio.current_time()
                held_since = now if held_since is None else held_since
                if now - held_since > self.fleet.lease + self.fleet.lease_renewal:
                    raise
                await trio.sleep(self.fleet.lease_renewal)
                continue
            except NATS_ERRORS as error:
                self.log.warn("fleet: claiming this replica's name failed", error=described(error))
                if at_start:
                    return
                await trio.sleep(CONNECT_RETRY_SECONDS)
                continue
            self._name_claimed.set()
            return

    async def _hold_name(self) -> None:
        """Renew the name's key every `lease_renewal` (a renewal lost to NATS is retried next
        time; a name taken meanwhile by another replica raises NameHeld)."""
        while True:
            await trio.sleep(self.fleet.lease_renewal)
            await self._link.connected.wait()
            try:
                self._name_revision = await self._link.renew_name(self._name_holder, self._name_revision)
            except NATS_ERRORS as error:
                self.log.warn("fleet: renewing this replica's name failed", error=described(error))

    # --- following --------------------------------------------------------------------------

    async def _follow(self) -> None:
        """Apply the stream in order, for good; resubscribe after a message out of sequence
        (after a pause, OUT_OF_SEQUENCE_RETRIES times at most), or when the watch finds the
        subscription stalled."""
        while True:
            await self._link.connected.wait()
            with trio.CancelScope() as self._following:
                try:
                    await self._follow_once()
                except NATS_ERRORS as error:
                    self.log.warn("fleet: following the event stream failed; again", error=described(error))
                    await trio.sleep(CONNECT_RETRY_SECONDS)
                except OutOfSequence as gap:
                    reads = self._reads_of(gap.message_seq) + 1
                    self._out_of_sequence = (gap.message_seq, reads, str(gap.aside))
                    self.log.warn(
                        "fleet: a message of the event stream is out of sequence; reading it again",
                        message_seq=gap.message_seq,
                        reason=str(gap.aside),
                        reads=reads,
                    )
                    await trio.sleep(OUT_OF_SEQUENCE_FIRST_PAUSE * 2 ** (reads - 1))

    async def _follow_once(self) -> None:
        start = await self._starting_seq()
        delivery = self._link.delivery(FOLLOW_BUFFER, on_drop=self.fleet_metrics.deliveries_dropped.inc)
        subscription = await self._link.follow_events(start, delivery)
        self._subscribed_at = time.monotonic()
        try:
            while True:
                try:
                    message = await delivery.receive()
                except DeliveryOverflowed:
                    self.log.warn(
                        "fleet: the follower fell behind its deliveries; reading the stream again",
                        message_seq=self._applied_message_seq + 1,
                    )
                    return
                self.partitions.end()  # the fleet's events flow again
                try:
                    events = continuing_events(message.data, self.view.snapshot.seq + 1)
                except MessageSetAside as aside:
                    if aside.kind == OUT_OF_SEQUENCE and self._reads_of(message.seq) < OUT_OF_SEQUENCE_RETRIES:
                        raise OutOfSequence(message.seq, aside) from None
                    self.fleet_metrics.messages_set_aside.labels("events", aside.kind).inc()
                    self.log.warn(
                        "fleet: a message of the event stream set aside", message_seq=message.seq, reason=str(aside)
                    )
                    self._message_followed(message.seq)
                    continue
                await self._apply_fleet_events(events)
                self._message_followed(message.seq)
                self.fleet_metrics.apply_delay.observe(max(0.0, time.time() - message.appended_at))
        finally:
            delivery.close()
            with trio.CancelScope(shield=True):
                await self._link.unsubscribe(subscription)

    async def _starting_seq(self) -> int:
        """The message to follow from: the one after the last applied whole, or after the
        newest checkpoint's when this replica has no fleet state yet or retention removed the
        messages it needs (events of that message the checkpoint includes are skipped)."""
        applied = self._applied_message_seq
        first, last = await self._link.message_seqs()
        self.partitions.stream_answered()
        self._note_new_store(last, applied)
        self._followed_created = self._link.events_created
        if self._new_store:
            return await self._starting_seq_on_a_new_store()
        if self._applied_message_seq > 0 and first <= self._applied_message_seq + 1:
            return self._applied_message_seq + 1
        newest = await self._newest_checkpoint()
        if newest is not None and newest[1].seq >= self.partitions.fleet_seq(self.view.snapshot.seq):
            stored, checkpoint = newest
            await self._apply_fleet_events([checkpoint])
            self._message_followed(stored.message_seq)
            self.log.info("fleet: starting from a checkpoint", seq=checkpoint.seq, message_seq=stored.message_seq)
        return self._applied_message_seq + 1

    async def _starting_seq_on_a_new_store(self) -> int:
        """The message after the newest checkpoint of a new store, once the leader has published
        one (this replica's own, when it leads), its state taken whatever its seq."""
        while (newest := await self._newest_checkpoint()) is None:
            await trio.sleep(self.fleet.lease_renewal)
        stored, checkpoint = newest
        await self._apply_fleet_events([checkpoint])
        self._new_store = False
        self._message_followed(stored.message_seq)
        self.log.info("fleet: starting from a checkpoint", seq=checkpoint.seq, message_seq=stored.message_seq)
        return stored.message_seq + 1

    async def _newest_checkpoint(self) -> tuple[StoredCheckpoint, Checkpoint] | None:
        """The newest checkpoint and the state it holds; None when there is none, or when it
        does not decode (set aside: logged, counted)."""
        try:
            stored = await self._link.newest_checkpoint()
            return None if stored is None else (stored, checkpoint_in(stored.line))
        except ValueError as error:  # msgspec's DecodeError is one
            self._checkpoint_set_aside("fleet: the newest checkpoint set aside", error)
            return None

    def _checkpoint_set_aside(self, what: str, error: ValueError) -> None:
        self.fleet_metrics.messages_set_aside.labels("checkpoints", "undecodable").inc()
        self.log.warn(what, error=str(error))

    def _reads_of(self, message_seq: int) -> int:
        """The times the follower has found message `message_seq` out of sequence."""
        if self._out_of_sequence is None or self._out_of_sequence[0] != message_seq:
            return 0
        return self._out_of_sequence[1]

    def _message_followed(self, message_seq: int) -> None:
        """The follower has applied, or set aside, every message through `message_seq`."""
        self._applied_message_seq = message_seq
        if self._out_of_sequence is not None and self._out_of_sequence[0] <= message_seq:
            self._out_of_sequence = None
        self.agreement.followed(message_seq, self.view.snapshot)
        self._followed.set()
        self._followed = trio.Event()

    async def _apply_fleet_events(self, events: list[Event]) -> None:
        """Apply consecutive events of the stream, the keys of a config one puts in force read
        before it; then wake whoever waits for the seq."""
        if not events:
            return
        self.partitions.end()
        for event in events:
            await self.view.upstream_keys.read_before(event)
            self.applier.apply(event)
        if any(isinstance(event, (RunStarted, ConfigReloaded, Checkpoint)) for event in events):
            self._note_config_in_force()
        self._applied_at = time.monotonic()
        self._applied.set()
        self._applied = trio.Event()

    async def _compare_checkpoints(self) -> None:
        """Compare each checkpoint the leader publishes with this replica's state after the
        same message (`fleet.agreement`), for good. One of another event stream than the one
        followed (NATS lost its store, and one side has not seen it yet) is not compared; one
        that does not decode is set aside (logged, counted)."""
        checkpoints = self._link.delivery(CHECKPOINTS_WAITING, on_drop=lambda: None, lossy=True)
        while True:
            await self._link.connected.wait()
            try:
                subscription = await self._link.receive_checkpoints(checkpoints)
                break
            except NATS_ERRORS as error:
                self.log.warn("fleet: subscribing to the checkpoints failed; again", error=described(error))
                await trio.sleep(CONNECT_RETRY_SECONDS)
        try:
            while True:
                data, headers = await checkpoints.receive()
                try:
                    stored = stored_checkpoint(data, headers)
                    checkpoint = checkpoint_in(stored.line)
                except ValueError as error:  # msgspec's DecodeError is one
                    self._checkpoint_set_aside("fleet: a checkpoint set aside, not compared", error)
                    continue
                if not self._new_store and stored.events_created == str(self._followed_created):
                    self.agreement.checkpoint(checkpoint, stored.message_seq)
        finally:
            checkpoints.close()
            with trio.CancelScope(shield=True):
                await self._link.unsubscribe(subscription)

    async def _watch(self) -> None:
        """Every `lease_renewal`, read the stream's last message sequence and the lease holder:
        the messages this replica is behind, whether a leader holds the lease, and whether the
        follower has stalled (behind, and nothing applied for a lease since it subscribed): then
        it resubscribes. A leader last read more than a lease ago is named no more: its lease
        has run out unless it renewed it, which this replica cannot see. Nothing on the data
        path waits for this."""
        leader_read_at = time.monotonic()
        while True:
            await trio.sleep(self.fleet.lease_renewal)
            applied = self._applied_message_seq
            read = await self._read_stream_state() if self._link.connected.is_set() else None
            if read is None:
                if time.monotonic() - leader_read_at > self.fleet.lease:
                    self.leader = ""
                continue
            last, holder = read
            self.partitions.stream_answered()
            self._note_new_store(last, applied)
            now = leader_read_at = time.monotonic()
            self._stream_last_message_seq = last
            behind = max(0, last - self._applied_message_seq)
            self.fleet_metrics.messages_behind.set(behind)
            if behind <= BEHIND_TOLERATED:
                self._behind_since = None
            elif self._behind_since is None:
                self._behind_since = now
            self.leader = holder
            if holder:
                self._leaderless_since = None
            elif self._leaderless_since is None:
                self._leaderless_since = now
            quiet_since = max(self._applied_at or 0.0, self._subscribed_at)
            if behind and self._following is not None and now - quiet_since > self.fleet.lease:
                self.log.warn(
                    "fleet: the follower stalled; resubscribing",
                    applied=self.view.snapshot.seq,
                    applied_message=self._applied_message_seq,
                    stream_last_message=last,
                )
                self._following.cancel()

    async def _read_stream_state(self) -> tuple[int, str] | None:
        """The stream's last message sequence and the lease holder ("" for none); None when
        NATS does not answer, or has lost the streams (then they are created again)."""
        try:
            _, last = await self._link.message_seqs()
            return last, self.replica if self.is_leader else await self._link.lease_holder()
        except nats.js.errors.NotFoundError as error:
            self.log.warn("fleet: the fleet's streams are gone (NATS lost its store); creating them", error=str(error))
            try:
                await self._link.create_missing()
            except NATS_ERRORS as failure:
                self.log.warn("fleet: creating the fleet's streams failed", error=described(failure))
            return None
        except NATS_ERRORS as error:
            self.log.warn("fleet: reading the stream's state failed", error=described(error))
            return None

    async def _applied_through(self, seq: int) -> None:
        while self.view.snapshot.seq < seq:
            await self._applied.wait()

    async def _stream_end(self) -> StreamEnd:
        """The stream's end once this replica has followed it there: its last message, and the
        last event this replica applied (a message set aside numbers nothing). On a new store
        (`_note_new_store`), at once: this replica's state is the new epoch's start."""
        applied = self._applied_message_seq
        _, message_seq = await self._link.message_seqs()
        self.partitions.end()  # leading: the fleet's state goes on from here
        self._note_new_store(message_seq, applied)
        while not self._new_store and self._applied_message_seq < message_seq:
            await self._followed.wait()
        return StreamEnd(message_seq, self.view.snapshot.seq)

    def _note_new_store(self, stream_last: int, applied_before_read: int) -> None:
        """A stream created after the one this replica follows, or whose last message is before
        the last it had applied when the read began (the follower may have applied more since),
        is a new one (NATS came back without its store): the replica
        follows it from the newest checkpoint its leader publishes there, whatever its seq (the
        new epoch's state is the leader's)."""
        created = self._link.events_created
        recreated = self._followed_created is not None and created != self._followed_created
        if self._new_store or not (recreated or stream_last < applied_before_read):
            return
        self.log.warn(
            "fleet: the event stream is new (NATS lost its store); following it from its first checkpoint",
            stream_last_message=stream_last,
            applied_message=applied_before_read,
        )
        self._new_store = True
        self._applied_message_seq = 0
        self.agreement.new_epoch()
        if self._following is not None:
            self._following.cancel()

    # --- the fleet's config -----------------------------------------------------------------

    async def _fleet_config(self) -> tuple[Config, str]:
        """The config a new term appends, and the path of the file it was read from: the fleet's
        config document's (`fleet.document`), never this replica's file's. A fleet without one yet gets it seeded, from the config
        of this replica's state of the fleet when it has one (NATS lost its store), else from
        its file (the first replica of a new fleet). A document that does not decode is set
        aside (logged, counted) and the config in force stays."""
        stored = await self._link.config_document()
        if stored is None:
            fleets = self.view.snapshot.seq > 0
            seed = self.view.snapshot.config if fleets else self._own_config
            path = self.view.snapshot.config_path if fleets else self.config_path
            try:
                version = await self._link.seed_config(encode_document(seed, path, f"seeded by replica {self.replica}"))
            except nats.js.errors.KeyWrongLastSequenceError:
                stored = await self._link.config_document()  # another replica seeded it first
            else:
                self.log.info(
                    "fleet: config document seeded", version=version, digest=fleet_config_digest(seed), path=path
                )
                return fleet_wide(seed, version), path
        if stored is not None and (document := self._decoded_document(*stored)) is not None:
            return document.in_force(stored[1]), document.path
        if self.view.snapshot.seq > 0:
            return self.view.snapshot.config, self.view.snapshot.config_path
        return fleet_wide(self._own_config), self.config_path

    def _decoded_document(self, data: bytes, version: int) -> ConfigDocument | None:
        """The fleet's document at `version`; None, logged and counted, when it does not decode."""
        try:
            return decode_document(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            self.fleet_metrics.messages_set_aside.labels("config", "undecodable").inc()
            self.log.warn("fleet: the fleet's config document set aside", version=version, reason=str(error))
            return None

    async def _apply_proposals(self) -> None:
        """While leading, every `lease_renewal`: a version of the fleet's config document other
        than the one in force is appended as the reload event (read, not watched: nothing to
        set up again after a reconnection or a new store; a second is nothing for a config)."""
        handled = 0
        """The last version appended (or set aside): the follower may not have applied it yet."""
        while True:
            await trio.sleep(self.fleet.lease_renewal)
            try:
                stored = await self._link.config_document()
            except NATS_ERRORS as error:
                self.log.warn("fleet: reading the fleet's config document failed", error=described(error))
                continue
            if stored is None or stored[1] in (self._version_in_force(), handled):
                continue
            data, handled = stored
            document = self._decoded_document(data, handled)
            if document is None:
                continue
            config = document.in_force(handled)
            self.log.info(
                "fleet: applying the fleet's config document",
                version=handled,
                digest=fleet_config_digest(config),
                origin=document.origin,
            )
            await self.queue.emit_and_wait(ConfigReloaded(at=self.view.now(), config_path=document.path, config=config))

    async def _propose_own_file(self) -> None:
        """Propose this replica's file's fleet-wide part as the fleet's config document, unless
        it is the config in force already; a failure is logged (the file stays unproposed)."""
        digest = fleet_config_digest(self._own_config)
        if self.view.snapshot.seq > 0 and digest == fleet_config_digest(self.view.snapshot.config):
            self.log.info("fleet: the file's fleet-wide keys are the fleet's config already", digest=digest)
            return
        if self._link is None or not self._link.connected.is_set():
            self.log.warn("fleet: not connected to NATS; the file's fleet-wide keys are not proposed", digest=digest)
            return
        document = encode_document(self._own_config, self.config_path, f"SIGHUP of replica {self.replica}")
        try:
            version = await self._link.propose_config(document)
        except NATS_ERRORS as error:
            self.log.warn("fleet: proposing the file's config failed", error=described(error))
            return
        self.log.info("fleet: config proposed", version=version, digest=digest, path=self.config_path)

    def _version_in_force(self) -> int:
        """The version of the fleet's config document in force (0: a config from before the
        fleet had one, or from an event of another kind of writer)."""
        fleet = self.view.snapshot.config.fleet
        return 0 if fleet is None else fleet.config_version

    def _config_differs(self) -> str:
        """Why this replica's file is not the config the fleet runs ("" when its fleet-wide keys
        are, or before the fleet's config has arrived)."""
        in_force = self.view.snapshot.config
        if self.view.snapshot.seq == 0 or in_force is None:
            return ""
        mine, fleets = self._digests()
        if mine == fleets:
            return ""
        return (
            f"{self.config_path}'s fleet-wide keys (digest {mine}) differ from the fleet's config in force "
            f"(version {self._version_in_force()}, digest {fleets})"
        )

    def _digests(self) -> tuple[str, str]:
        """The digests of this replica's file and of the config in force, computed once per config."""
        own, in_force = self._own_config, self.view.snapshot.config
        (digested_own, digested_in_force), digests = self._digested
        if digested_own is not own or digested_in_force is not in_force:
            digests = (fleet_config_digest(own), fleet_config_digest(in_force))
            self._digested = ((own, in_force), digests)
        return digests

    def _config_headers(self) -> dict[str, str]:
        """`/health`'s account of the fleet's config this replica runs: its version and digest,
        and whether this replica's own file differs (`X-Interlock-Config-Differs`)."""
        in_force = self.view.snapshot.config
        if self.view.snapshot.seq == 0 or in_force is None:
            return {}
        headers = {
            "X-Interlock-Config-Version": str(self._version_in_force()),
            "X-Interlock-Config-Digest": self._digests()[1],
        }
        if differs := self._config_differs():
            headers["X-Interlock-Config-Differs"] = differs
        return headers

    def _note_config_in_force(self) -> None:
        """Say in the log, once per pair of configs, that this replica's file differs from the
        fleet's config in force (at start, once the fleet's arrives; after each config change;
        on SIGHUP)."""
        differs = self._config_differs()
        if differs and differs != self._differs_logged:
            self.log.warn(
                "fleet: this replica's config file differs from the fleet's; the fleet's is in force", reason=differs
            )
        self._differs_logged = differs

    # --- leading ----------------------------------------------------------------------------

    async def _campaign(self, client: ProbeClient) -> None:
        """Take the lease whenever it is free (or still ours), and lead until the term ends."""
        renewal = self.fleet.lease_renewal
        await self._name_claimed.wait()
        while not self._name_refused:
            await self._link.connected.wait()
            started = trio.current_time()
            try:
                if self._revision:
                    self._revision = await self._link.renew_lease(self.replica, self._revision)
                else:
                    self._revision = await self._link.take_lease(self.replica)
            except nats.js.errors.KeyWrongLastSequenceError:
                self._revision = 0
                await trio.sleep(renewal)
                continue
            except NATS_ERRORS as error:
                self.log.warn("fleet: lease request failed", error=described(error))
                await trio.sleep(renewal)
                continue
            await self._lead(client, lease_ends=started + self.fleet.lease)
            await trio.sleep(renewal)

    async def _lead(self, client: ProbeClient, lease_ends: float) -> None:
        self.is_leader = True
        self.leader = self.replica
        self.fleet_metrics.leader.set(1)
        self.fleet_metrics.leadership_changes.inc()
        self.log.info("fleet: leading", replica=self.replica)
        try:
            with trio.CancelScope(deadline=lease_ends) as term:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._renew, term)
                    nursery.start_soon(self._hold_office, client, term)
        finally:
            self.applier.prober = None
            self.is_leader = False
            self.leader = ""  # until the watch reads who holds the lease now
            self.fleet_metrics.leader.set(0)
            self.log.info("fleet: following", replica=self.replica)

    async def _renew(self, term: trio.CancelScope) -> None:
        while True:
            await trio.sleep(self.fleet.lease_renewal)
            sent = trio.current_time()
            try:
                self._revision = await self._link.renew_lease(self.replica, self._revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                self._revision = 0
                self.log.warn("fleet: lease lost to another replica", replica=self.replica)
                term.cancel()
                return
            except NATS_ERRORS as error:
                self.log.warn("fleet: lease renewal failed", error=described(error))
                continue  # the term ends when the lease runs out
            term.deadline = sent + self.fleet.lease

    async def _hold_office(self, client: ProbeClient, term: trio.CancelScope) -> None:
        try:
            last = await self._stream_end()
            if self._new_store:  # the new epoch starts from this replica's state, at the stream's end
                state = StoredCheckpoint(encode_event(Checkpoint.of(self.view.snapshot)), last.message_seq)
                await self._link.publish_checkpoint(state)
            config, path = await self._fleet_config()
            if last.event_seq == 0:
                fence: Event = RunStarted(at=self.view.now(), version=self.version, config_path=path, config=config)
            else:
                fence = ConfigReloaded(at=self.view.now(), config_path=path, config=config)
            last = await self._append([fence], [numbered(fence, last.event_seq + 1)], last)
            await self._applied_through(last.event_seq)
            await self._link.publish_checkpoint(self._checkpoint())
            async with trio.open_nursery() as nursery:
                self.applier.prober = Prober(client, self.view, self.queue.emit)
                await nursery.start(self.applier.prober.run)
                await nursery.start(self._number_observations)
                nursery.start_soon(self._checkpoints)
                nursery.start_soon(self._apply_proposals)
                while True:
                    last = await self._append_waiting(last)
        except* AppendRefused as refusals:  # except*: the appends run beside the prober, in a nursery
            self.fleet_metrics.appends_refused.inc()
            self.log.warn("fleet: append refused: another replica leads", error=described(refusals))
            self._revision = 0
        except* NATS_ERRORS as errors:
            self.log.warn("fleet: append failed; standing for the lease again", error=described(errors))
        term.cancel()

    async def _number_observations(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Subscribe to the replicas' observations (started once subscribed) and put them in the
        leader's queue, as its own data plane's go (`EventQueue.observe`: a full queue drops
        and counts); one that does not decode is set aside (logged, counted)."""
        dropped = self.metrics.observations_dropped
        observations = self._link.delivery(OBSERVATION_BUFFER, on_drop=dropped.inc, lossy=True)
        subscription = await self._link.receive_observations(observations)
        try:
            task_status.started()
            while True:
                line = await observations.receive()
                try:
                    event = decode_event(line)
                except msgspec.DecodeError as error:
                    self.fleet_metrics.messages_set_aside.labels("observations", "undecodable").inc()
                    self.log.warn("fleet: an observation set aside", reason=f"does not decode: {error}")
                    continue
                self.queue.observe(event)
        finally:
            observations.close()
            with trio.CancelScope(shield=True):
                await self._link.unsubscribe(subscription)

    async def _append_waiting(self, last: StreamEnd) -> StreamEnd:
        """Take the next event in the queue and, once APPEND_INTERVAL has passed since the last
        append began, those waiting behind it, up to BATCH_EVENTS or BATCH_BYTES, and append
        them as one message; the stream's new end. Whoever waits for
        one of them (a reload) is woken once it is appended."""
        events: list[Event] = []
        lines: list[bytes] = []
        waiting: list[trio.Event] = []
        size = 0
        item = await self.queue.receive()
        await trio.sleep_until(self._last_append_started + APPEND_INTERVAL)  # the interval's events, together
        self._last_append_started = trio.current_time()
        while True:
            event, applied = item
            events.append(event)
            lines.append(numbered(event, last.event_seq + len(lines) + 1))
            size += len(lines[-1])
            if applied is not None:
                waiting.append(applied)
            if len(lines) == BATCH_EVENTS or size >= BATCH_BYTES:
                break
            try:
                item = self.queue.receive_nowait()
            except trio.WouldBlock:
                break
        last = await self._append(events, lines, last)
        for applied in waiting:
            applied.set()
        return last

    async def _append(self, events: list[Event], lines: list[bytes], last: StreamEnd) -> StreamEnd:
        """Append `lines` (`events` numbered on from `last.event_seq`) as one message fenced on
        `last.message_seq`; the stream's new end. Refused while this replica still holds the
        lease, the append met a message some other publisher put on the stream: the leader
        follows the stream to its end (where every replica sets that message aside, or applies
        it if it continues the events), numbers the batch on from there and appends it again.
        AppendRefused when another replica leads."""
        while True:
            try:
                message_seq = await self._link.append(b"".join(lines), last.message_seq, self.fleet.lease / 2)
                return StreamEnd(message_seq, last.event_seq + len(lines))
            except AppendRefused:
                if await self._link.lease_holder() != self.replica:
                    raise
            refused = last
            last = await self._stream_end()
            self.log.warn(
                "fleet: the event stream has a message the leader did not append; numbering on after it",
                expected_last_message=refused.message_seq,
                last_message=last.message_seq,
            )
            lines = [numbered(event, last.event_seq + index) for index, event in enumerate(events, 1)]

    def _checkpoint(self) -> StoredCheckpoint:
        """The state now, with the last message it includes every event of."""
        return StoredCheckpoint(encode_event(Checkpoint.of(self.view.snapshot)), self._applied_message_seq)

    async def _checkpoints(self) -> None:
        while True:
            await trio.sleep(CHECKPOINT_SECONDS)
            try:
                await self._link.publish_checkpoint(self._checkpoint())
            except NATS_ERRORS as error:
                self.log.warn("fleet: publishing a checkpoint failed", error=described(error))


class OutOfSequence(Exception):
    """The follower met message `message_seq` out of sequence and reads the stream again."""

    def __init__(self, message_seq: int, aside: MessageSetAside) -> None:
        super().__init__(message_seq, str(aside))
        self.message_seq = message_seq
        self.aside = aside


def numbered(event: Event, seq: int) -> bytes:
    """`event` numbered `seq`, encoded as the event log writes it."""
    return encode_event(msgspec.structs.replace(event, seq=seq))


def described(error: BaseException) -> str:
    """A NATS failure for the log (the first of a group)."""
    if isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return str(error) or repr(error)

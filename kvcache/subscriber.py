"""One node's KV events followed into its index: a SUB socket (and the replay socket) on a
thread of its own, off the trio thread, as `fleet/bridge.py` keeps nats-py off it.

The thread owns its sockets and is the one writer of the node's `NodeBlocks`; the policy reads
the index from any thread (`kvcache.index`). Nothing here waits on trio or blocks it: a stop is a
message on an inproc socket the thread polls with the others, and the join happens off the loop.

What the thread does with what comes:
- a batch numbered one past the last applied: applied;
- one further on (a gap: batches lost on the way, or while the connection was down): the
  replay socket is asked for what was missed; when its answer holds it all, the gap is
  repaired, else (no replay socket, no answer within REPLAY_SECONDS, its buffer no longer
  reaching back) the index is cleared, since removals may be among what was lost, and the gap
  counted;
- one at or below the last applied: already applied (it came again by replay) when it is not
  newer than the last; a newer one means the node started again and numbers from 0: the index is
  cleared (the node's cache went with its process) and the restart counted;
- each time the connection is made (at start, after the node came back), the replay socket is
  asked for what it still holds, from 0 at first: the index learns what an idle node holds
  without waiting for its next event.
A replay asks from the last batch applied, not the one after: the node's answer for it is the
same batch (the same time stamp) unless the node started again meanwhile and numbered past it,
which a restart while the connection was down would hide otherwise;
- a message that is not a batch: counted as garbage; one whose sequence number is readable clears
  the index (what it held is unknown), an event of an unknown type in a batch is skipped.
Each kind of trouble is logged the first time, then only counted; none ends the thread.

`flowing` (what the policy falls back on) is true while the connection is up (ZeroMQ's
heartbeats find a publisher gone silent) and no gap is being repaired. An idle node publishes
nothing, so silence alone is no sign of trouble.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from enum import Enum

import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge
from zmq.utils.monitor import recv_monitor_message

from controlplane.infrastructure.logs import JsonLog
from kvcache.index import NodeBlocks
from kvcache.subscriptions import KvSource
from kvcache.wire import MAX_BATCH_BYTES, KvBatch, WireError, decode_payload, decode_replayed, read_seq, replay_request

JOIN_SECONDS = 10.0
"""How long the end of a process waits for a subscriber's thread (it ends at once unless a
write of its log blocks: then it is left behind, a daemon thread)."""

REPLAY_SECONDS = 3.0
"""How long a replay may take from the request to its end marker; past it the gap is not repaired."""

HEARTBEAT_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
"""ZeroMQ's heartbeats on the SUB socket: a publisher that stops answering them for this long
(a frozen node, a cut link) counts as gone, so `flowing` turns false."""

RECONNECT_MAX_MS = 5000
"""The longest wait between two attempts to reach a node's publisher."""

RECEIVE_QUEUE = 64
"""Batches ZeroMQ keeps for the thread (its high-water mark): past it they are dropped, and the
thread sees a gap to repair. With MAX_BATCH_BYTES it bounds what a node can make the gateway hold."""

_DRAIN = 64
"""Batches taken at one wake-up before the thread looks at its other sockets again."""

_stop_endpoints = itertools.count()

_MULTIPROCESS = "PROMETHEUS_MULTIPROC_DIR" in os.environ
"""A worker's metrics go to prometheus_client's multiprocess files (as prometheus_client decides)."""


class KvMetrics:
    """The KV event series, by node (the config's nodes only, so bounded). With `serve --workers
    N` each worker subscribes itself: the blocks of a node are the largest any worker holds, its
    bytes the sum, and it is flowing only while it is in every worker."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.blocks = Gauge(
            "interlock_kv_index_blocks", "KV cache blocks the gateway's index holds for each node", ["node"],
            multiprocess_mode="livemax", registry=registry,
        )  # fmt: skip
        self.bytes = Gauge(
            "interlock_kv_index_bytes", "Memory of the gateway's KV index, by node", ["node"],
            multiprocess_mode="livesum", registry=registry,
        )  # fmt: skip
        self.flowing = Gauge(
            "interlock_kv_events_flowing",
            "1 while a node's KV events are followed (connected, no gap left unrepaired), else 0",
            ["node"], multiprocess_mode="livemin", registry=registry,
        )  # fmt: skip
        self.batches = Counter(
            "interlock_kv_events_batches_total", "KV event batches applied to the index, by node", ["node"],
            registry=registry,
        )  # fmt: skip
        self.gaps = Counter(
            "interlock_kv_events_gaps_total",
            "Gaps in a node's KV event numbering, by how they ended: replayed, or cleared (the index "
            "forgot the node's blocks)",
            ["node", "repair"], registry=registry,
        )  # fmt: skip
        self.garbage = Counter(
            "interlock_kv_events_garbage_total",
            "Messages and events from a node's KV event sockets that did not decode", ["node"], registry=registry,
        )  # fmt: skip
        self.restarts = Counter(
            "interlock_kv_events_restarts_total", "Times a node's KV events started numbering again (a restart)",
            ["node"], registry=registry,
        )  # fmt: skip
        self.disconnects = Counter(
            "interlock_kv_events_disconnects_total",
            "Times a node's KV event publisher was lost or could not be reached", ["node"], registry=registry,
        )  # fmt: skip

    def forget(self, node: str) -> None:
        """A node no longer subscribed (or subscribed anew): its gauges go (its counters stay,
        as counters do). A worker's stay at 0 instead, until it exits: prometheus_client's
        multiprocess mode cannot remove a series."""
        for gauge in (self.blocks, self.bytes, self.flowing):
            if _MULTIPROCESS:
                gauge.labels(node).set(0)
                continue
            try:
                gauge.remove(node)
            except KeyError:
                pass


class _Replay(Enum):
    WHOLE = "whole"
    """Every batch asked for came, in order, and the end marker."""
    HOLE = "hole"
    """The replay's buffer no longer reached back to the first batch asked for: the index was
    cleared before the first it held."""
    FAILED = "failed"
    """No replay socket, or no end marker within REPLAY_SECONDS."""
    RESTARTED = "restarted"
    """The node numbered past the last batch applied since it started again: the index was
    cleared and the replay asked again from 0."""


class _Stopped(Exception):
    """The subscriber was asked to stop in the middle of a replay."""


class NodeSubscriber:
    """One node's sockets and the thread that reads them into `blocks`."""

    def __init__(
        self, node: str, source: KvSource, blocks: NodeBlocks, context: zmq.Context, metrics: KvMetrics, log: JsonLog
    ) -> None:
        self.node = node
        self.source = source
        self.blocks = blocks
        self._context = context
        self._metrics = metrics
        self._log = log
        self._topic = source.topic.encode()
        self._stop_endpoint = f"inproc://interlock-kv-stop-{next(_stop_endpoints)}"
        self._stopper = context.socket(zmq.PAIR)
        self._stopper.bind(self._stop_endpoint)
        self._gauges_lock = threading.Lock()
        self._retired = False
        """Asked to stop: its gauges are gone and the thread writes them no more (a subscriber
        that replaces it writes its own)."""
        self._last_ts = 0.0
        """The newest time stamp applied: a batch numbered no further and no newer came again."""
        self._seq_ts: float | None = None
        """The time stamp of the batch at the index's seq (None: not applied, skipped over): the
        replay's batch in its place must carry the same."""
        self._applied_any = False
        self._connected = False
        self._down = False
        """Counted as lost or unreachable, and not connected since."""
        self._logged: set[str] = set()
        self._dealer: zmq.Socket | None = None
        self.thread = threading.Thread(target=self._run, name=f"interlock kv events {node}", daemon=True)

    def start(self) -> None:
        self._set_flowing(False)
        self._count_blocks()
        self.thread.start()

    def stop(self) -> None:
        """Asks the thread to end (it closes its sockets) and drops the node's gauges; `join`
        waits for the thread."""
        with self._gauges_lock:
            self._retired = True
            self._metrics.forget(self.node)
        try:
            self._stopper.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # a stop is queued already

    def join(self) -> bool:
        """Waits for the thread (blocking); False when it is still running after JOIN_SECONDS."""
        self.thread.join(JOIN_SECONDS)
        self._stopper.close(linger=0)
        return not self.thread.is_alive()

    # --- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        monitor = None
        stop = self._context.socket(zmq.PAIR)
        try:
            stop.connect(self._stop_endpoint)
            for option, value in (
                (zmq.LINGER, 0), (zmq.IPV6, 1), (zmq.RCVHWM, RECEIVE_QUEUE), (zmq.MAXMSGSIZE, MAX_BATCH_BYTES + 64),
                (zmq.HEARTBEAT_IVL, HEARTBEAT_MS), (zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS),
                (zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS),
            ):  # fmt: skip
                sub.setsockopt(option, value)
            sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            monitor = sub.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
            )
            sub.connect(self.source.endpoint)
            self._follow(sub, monitor, stop)
        except _Stopped:
            pass
        except Exception as error:  # a fault of the gateway's own: the node's index stops following
            self._set_flowing(False)
            self._log.error("kv events: subscriber failed", node=self.node, error=f"{type(error).__name__}: {error}")
        finally:
            if monitor is not None:
                sub.disable_monitor()
                monitor.close(linger=0)
            self._drop_dealer()
            sub.close(linger=0)
            stop.close(linger=0)

    def _follow(self, sub: zmq.Socket, monitor: zmq.Socket, stop: zmq.Socket) -> None:
        poller = zmq.Poller()
        for socket in (sub, monitor, stop):
            poller.register(socket, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if stop in ready:
                return
            if monitor in ready:
                self._on_connection(recv_monitor_message(monitor)["event"], stop)
            if sub in ready:
                for _ in range(_DRAIN):
                    try:
                        frames = sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_published(frames, stop)

    def _on_connection(self, event: int, stop: zmq.Socket) -> None:
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._connected = True
            self._down = False
            if self._replay(stop) is _Replay.HOLE:
                self._gap_cleared()
            self._set_flowing(True)
        elif not self._down:  # lost (EVENT_DISCONNECTED) or not reached (EVENT_CONNECT_RETRIED): once each time
            self._connected = False
            self._down = True
            self._set_flowing(False)
            self._metrics.disconnects.labels(self.node).inc()
            self._log_once("unreachable", "kv events: the node's publisher is not reachable; retrying")

    def _on_published(self, frames: list[bytes], stop: zmq.Socket) -> None:
        if self._topic and frames[0] != self._topic:
            return  # another topic on the same publisher
        try:
            seq = read_seq(frames[1]) if len(frames) == 3 else None
        except WireError:
            seq = None
        if seq is None:
            self._garbage(WireError(f"a message of {len(frames)} frames, not topic, seq, payload"))
            return
        try:
            batch = decode_payload(seq, frames[2])
        except WireError as error:  # what it changed is unknown: nothing held before is vouched for
            self._garbage(error)
            self._forget()
            self.blocks.seq = seq
            self._seq_ts = None
            self._applied_any = True
            return
        if self._applied_any and batch.seq <= self.blocks.seq:
            if batch.ts <= self._last_ts:
                return  # applied already (it came by replay first)
            self._restarted()
        if not self._applied_any:
            if batch.seq > 0:
                self._replay(stop)  # the start of the node's history, when its buffer still holds it
        elif batch.seq > self.blocks.seq + 1:
            self._repair_gap(batch.seq, stop)
        self._take(batch)

    def _take(self, batch: KvBatch) -> None:
        """Applies a batch that continues the index (or starts it); one applied already is skipped."""
        if self._applied_any and batch.seq <= self.blocks.seq:
            return
        rejected = self.blocks.apply(batch) + batch.undecoded
        if rejected:
            self._garbage(WireError(f"{rejected} events of batch {batch.seq} could not be applied"), rejected)
        self._applied_any = True
        self._last_ts = self._seq_ts = batch.ts
        self._metrics.batches.labels(self.node).inc()
        self._count_blocks()

    def _repair_gap(self, next_seq: int, stop: zmq.Socket) -> None:
        """Batches between the last applied one and `next_seq` were lost: replayed, or the index cleared."""
        self._set_flowing(False)
        outcome = self._replay(stop)
        if outcome is _Replay.RESTARTED:
            pass  # counted as a restart, the index cleared and replayed from 0
        elif outcome is _Replay.WHOLE and self.blocks.seq >= next_seq - 1:
            self._metrics.gaps.labels(self.node, "replayed").inc()
        else:
            if outcome is _Replay.FAILED or self.blocks.seq < next_seq - 1:
                self._forget()
                self.blocks.seq = next_seq - 1
                self._seq_ts = None
            self._gap_cleared()
        self._set_flowing(self._connected)

    def _gap_cleared(self) -> None:
        self._metrics.gaps.labels(self.node, "cleared").inc()
        self._log_once("gap", "kv events: a gap the replay could not fill; the node's index was cleared")

    def _restarted(self) -> None:
        self._metrics.restarts.labels(self.node).inc()
        self._log_once("restart", "kv events: the node numbers its events from the start again (restarted)")
        self._forget()
        self._applied_any = False
        self._seq_ts = None

    def _replay(self, stop: zmq.Socket) -> _Replay:
        """Asks the replay socket for every batch it holds from the last applied on (from 0 when
        none is) and applies what continues the index. A hole at the start of its answer (its
        buffer no longer reaches back) clears the index first; another batch in the place of the
        last applied is a restart."""
        if not self.source.replay:
            return _Replay.FAILED
        if self._dealer is None:
            self._dealer = self._context.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.setsockopt(zmq.IPV6, 1)  # either family, as the endpoint names it
            self._dealer.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES + 64)
            self._dealer.connect(self.source.replay)
        dealer = self._dealer
        try:
            dealer.send_multipart(replay_request(self.blocks.seq if self._applied_any else 0), zmq.NOBLOCK)
        except zmq.Again:
            return _Replay.FAILED
        deadline = time.monotonic() + REPLAY_SECONDS
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(stop, zmq.POLLIN)
        outcome = _Replay.WHOLE
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(left * 1000))
            if stop in ready:
                raise _Stopped
            if dealer not in ready:
                continue
            try:
                batch = decode_replayed(dealer.recv_multipart())
            except WireError as error:
                self._garbage(error)
                continue
            if batch is None:
                return outcome
            if self._seq_ts is not None and batch.seq == self.blocks.seq and batch.ts != self._seq_ts:
                self._restarted()
                self._drop_dealer()  # the rest of this answer is of the same new run, from the wrong place
                self._replay(stop)
                return _Replay.RESTARTED
            if self._applied_any and batch.seq > self.blocks.seq + 1:
                outcome = _Replay.HOLE
                self._forget()
            self._take(batch)
        self._drop_dealer()  # answers still on their way would be taken for the next request's
        return _Replay.FAILED

    def _drop_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    def _forget(self) -> None:
        """The index can no longer vouch for what it holds: it holds nothing."""
        self.blocks.clear()
        self._count_blocks()

    def _garbage(self, error: WireError, count: int = 1) -> None:
        self._metrics.garbage.labels(self.node).inc(count)
        self._log_once("garbage", "kv events: a message that is not vLLM's KV events", error=str(error))

    def _count_blocks(self) -> None:
        with self._gauges_lock:
            if not self._retired:
                self._metrics.blocks.labels(self.node).set(len(self.blocks))
                self._metrics.bytes.labels(self.node).set(self.blocks.memory_bytes())

    def _set_flowing(self, flowing: bool) -> None:
        self.blocks.flowing = flowing
        with self._gauges_lock:
            if not self._retired:
                self._metrics.flowing.labels(self.node).set(1 if flowing else 0)

    def _log_once(self, kind: str, msg: str, **fields: object) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            self._log.warn(msg, node=self.node, endpoint=self.source.endpoint, **fields)

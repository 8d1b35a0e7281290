"""The KV event subscribers a process runs: one per node whose config names `kv_events`,
following the config in force (a reload starts, stops and rebounds them), all stopped when the
process stops.

Each process that routes subscribes itself (the gateway, each worker, each fleet replica):
every one builds the same index from the same events, with nothing to share. Without
`kv_events` on any node nothing is started, and ZeroMQ is not even imported.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, NamedTuple

import trio
from prometheus_client import CollectorRegistry

from controlplane.infrastructure.logs import JsonLog
from events.config import Config
from kvcache.index import KvIndex, NodeBlocks

if TYPE_CHECKING:
    from kvcache.subscriber import KvMetrics, NodeSubscriber


class KvSource(NamedTuple):
    """Where a node publishes its KV events (`[[nodes]] kv_events`, `kv_events_replay`, `kv_events_topic`)."""

    endpoint: str
    replay: str
    topic: str


class KvSubscriptions:
    """The running subscribers and the index they write; `follow` a config, `close` at the end."""

    def __init__(self, registry: CollectorRegistry, log: JsonLog) -> None:
        self.index = KvIndex()
        self._registry = registry
        self._log = log
        self._running: dict[str, NodeSubscriber] = {}
        self._stopped: list[NodeSubscriber] = []
        """Asked to stop, not joined yet: `close` joins them."""
        self._metrics: KvMetrics | None = None
        self._context = None

    def follow(self, config: Config) -> None:
        """Start, stop or rebound the subscribers as `config` says. Called on the process's trio
        thread with each config it takes up; never blocks (a stopped subscriber is joined at `close`)."""
        sources = kv_sources(config)
        if not sources and not self._running:
            return
        import zmq  # only once a node publishes

        from kvcache.subscriber import KvMetrics, NodeSubscriber

        if self._context is None:
            self._context = zmq.Context()
            self._metrics = KvMetrics(self._registry)
        assert self._metrics is not None
        capacity = config.routing.kv_index_blocks
        for node, subscriber in list(self._running.items()):
            if sources.get(node) != subscriber.source:
                subscriber.stop()
                self._stopped.append(self._running.pop(node))
        for node, source in sources.items():
            if node in self._running:
                self._running[node].blocks.capacity = capacity  # the thread forgets the excess at its next store
                continue
            subscriber = NodeSubscriber(node, source, NodeBlocks(capacity), self._context, self._metrics, self._log)
            subscriber.start()
            self._running[node] = subscriber
        self.index.nodes = {node: subscriber.blocks for node, subscriber in self._running.items()}

    def close(self) -> None:
        """Stops every subscriber and waits for their threads (blocking: run it off the loop)."""
        for subscriber in self._running.values():
            subscriber.stop()
        self._stopped.extend(self._running.values())
        self._running.clear()
        self.index.nodes = {}
        left = [subscriber.node for subscriber in self._stopped if not subscriber.join()]
        self._stopped.clear()
        if left:  # a thread that never ended keeps its sockets: terminating the context would wait for ever
            self._log.error("kv events: subscribers did not stop", nodes=left)
        elif self._context is not None:
            self._context.term()
        self._context = None


def kv_sources(config: Config) -> dict[str, KvSource]:
    """The nodes that publish KV events, by node (its `ip`, the node's identity), and where."""
    return {
        node.ip: KvSource(node.kv_events, node.kv_events_replay, node.kv_events_topic)
        for node in config.nodes
        if node.kv_events
    }


@asynccontextmanager
async def following_kv_events(
    config_listeners: list[Callable[[Config], None]], config: Config | None, registry: CollectorRegistry, log: JsonLog
) -> AsyncIterator[KvIndex]:
    """The KV index of this process, its subscribers following `config` and every config taken
    up after it (through `config_listeners`, the process's `HeldState`'s) until the block ends."""
    subscriptions = KvSubscriptions(registry, log)

    def follow(taken_up: Config) -> None:
        try:
            subscriptions.follow(taken_up)
        except Exception as error:  # never into the control plane's apply
            log.error("kv events: following the config failed", error=f"{type(error).__name__}: {error}")

    if config is not None:
        follow(config)
    config_listeners.append(follow)
    try:
        yield subscriptions.index
    finally:
        config_listeners.remove(follow)
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(subscriptions.close)

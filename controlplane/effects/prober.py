"""The prober: every configured node's health checks, model listings and load scrapes, and the
LoRA adapter loads a step asks for, each ending in events sent to the control plane (the
gateway's, or a fleet's leader's). Probes only ever send events; what they probe and with what
timeout and keys they read from the held state's current snapshot."""

from __future__ import annotations

import math
import ssl
from collections.abc import Awaitable, Callable, Iterable

import trio

from controlplane.effects.held_state import HeldState
from controlplane.effects.probes import ProbeClient, check_node, list_models, load_adapter, scrape_load
from controlplane.rules.transitions import Effect, LoadAdapter, Recheck, StartProbing, StopProbing
from events.config import ModelEntry, NodeConfig
from events.types import AdapterLoadRequested, Event, ModelsListed, ModelsUnchanged
from transport.readiness import Readiness, Steps


class Prober:
    """Runs the probes of every configured node and sends their events to the control plane.

    One ticker task for all nodes (not a sleeping task per node): per tick, discovery for
    every node is started and not awaited (plinth's discoverAll), then a health check for every
    node, and the ticker waits until that round's checks have all ended (plinth's blocking
    round). A second ticker task starts the load scrapes (`_scrape_load_ticks`). The probes are
    step generators run together by one `Readiness` (one wait for every socket, one timer), whose
    results a third task turns into events. A step's `LoadAdapter` starts the load of a LoRA
    adapter (`controlplane.rules.adapters`), a task each: they are rare, and may take long.
    """

    def __init__(self, client: ProbeClient, view: HeldState, emit: Callable[[Event], Awaitable[None]]) -> None:
        """Probes read the nodes, timeouts and keys from `view`, and send their events with
        `emit` (which waits for room)."""
        self._client = client
        self._view = view
        self._emit = emit
        self._readiness: Readiness | None = None
        self._nursery: trio.Nursery | None = None
        self._health_in_flight: set[str] = set()
        self._models_in_flight: set[str] = set()
        self._round: set[str] = set()
        """The nodes whose health checks the current round waits for."""
        self._round_ended = trio.Event()
        self._load_in_flight: set[str] = set()
        self._adapter_loads_in_flight: set[tuple[str, str]] = set()
        """(node, adapter) of each LoRA adapter load under way."""
        self._config_changed = trio.Event()
        """Set when a reload is applied, for the load ticker to read the new interval."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._readiness = Readiness(nursery)
                self._nursery = nursery
                nursery.start_soon(self._report)
                nursery.start_soon(self._scrape_load_ticks)
                task_status.started()
                await self._tick()
        finally:
            self._nursery = None
            if self._readiness is not None:
                self._readiness.close()  # the probes still in flight: their connections close

    def run_effects(self, effects: Iterable[Effect]) -> None:
        """Start the probes a step asks for (called by the reducer task; never blocks)."""
        for effect in effects:
            if isinstance(effect, Recheck):
                self._start_probes(effect.node, discovery=False)
            elif isinstance(effect, StartProbing):
                self._start_probes(effect.node, discovery=True)
            elif isinstance(effect, LoadAdapter):
                self._start_adapter_load(effect.node, effect.adapter)
            elif isinstance(effect, StopProbing) and self._nursery is not None:
                # Rounds only probe the nodes of the current snapshot; its connections can go.
                self._nursery.start_soon(self._client.forget, effect.node)

    def _start_probes(self, ip: str, *, discovery: bool) -> None:
        if self._nursery is None:
            return  # not ticking yet: the first round probes every node
        config = self._view.snapshot.config
        node = config.node(ip) if config is not None else None
        if node is None:
            return
        if discovery:
            self._start_discovery(node)
        self._start_health_check(node)

    async def _tick(self) -> None:
        tick = trio.current_time()
        while True:
            config = self._view.snapshot.config
            for node in config.nodes:
                self._start_discovery(node)
            self._round_ended = trio.Event()
            for node in config.nodes:
                if self._start_health_check(node):
                    self._round.add(node.ip)
            if self._round:
                await self._round_ended.wait()
            tick = next_tick(tick, self._view.snapshot.config.gateway.health_interval, trio.current_time())
            await trio.sleep_until(tick)

    def _start_health_check(self, node: NodeConfig) -> bool:
        """Start a health check unless one is in flight (skipped, not queued); True if started."""
        if node.ip in self._health_in_flight:
            return False
        self._health_in_flight.add(node.ip)
        self._readiness.start(
            (_HEALTH, node.ip), check_node(
                self._client, node, timeout=self._timeout(), now=self._view.now, tls=self._tls(node.ip)
            )
        )
        return True

    def _start_discovery(self, node: NodeConfig) -> None:
        self._start_with_key(_MODELS, self._models_in_flight, node, list_models)

    def _start_with_key(self, kind: str, in_flight: set[str], node: NodeConfig, probe: Callable[..., Steps]) -> None:
        """Start `probe` (a listing, a load scrape: the requests that carry the node's key) on
        `node` unless one of its `kind` is in flight there (skipped, not queued)."""
        if node.ip in in_flight:
            return
        in_flight.add(node.ip)
        exchange = probe(
            self._client,
            node,
            timeout=self._timeout(),
            now=self._view.now,
            authorization=self._authorization(node.ip),
            tls=self._tls(node.ip),
        )
        self._readiness.start((kind, node.ip), exchange)

    def _start_adapter_load(self, ip: str, name: str) -> None:
        """Load a configured LoRA adapter onto a node (a step's `LoadAdapter`), unless a load of
        it is under way there."""
        config = self._view.snapshot.config
        node = config.node(ip) if config is not None else None
        adapter = config.loaded_adapters().get(name) if config is not None else None
        if self._nursery is None or node is None or adapter is None or (ip, name) in self._adapter_loads_in_flight:
            return
        self._adapter_loads_in_flight.add((ip, name))
        self._nursery.start_soon(self._load_adapter, node, adapter)

    async def _load_adapter(self, node: NodeConfig, adapter: ModelEntry) -> None:
        """One load: its request as an event, the node's answer as another, then the node's
        model list fetched again (so that routing sees the adapter at once)."""
        try:
            requested = AdapterLoadRequested(
                at=self._view.now(), node=node.ip, adapter=adapter.name, parent=adapter.parent,
                lora_path=adapter.lora_path,
            )  # fmt: skip
            await self._emit(requested)
            answered = await load_adapter(
                self._client, node, adapter, now=self._view.now,
                authorization=self._authorization(node.ip), tls=self._tls(node.ip),
            )  # fmt: skip
            await self._emit(answered)
            self._start_discovery(node)
        finally:
            self._adapter_loads_in_flight.discard((node.ip, adapter.name))

    def config_changed(self) -> None:
        """A config was applied (called by the reducer task; never blocks)."""
        self._config_changed.set()

    async def _scrape_load_ticks(self) -> None:
        """Scrape every node's load every `load_scrape_interval()` seconds (the ticks drop as
        the health ticker's do), and nothing while it is 0. A reload that changes the interval
        takes effect at once: the next scrape is due one new interval after the last one."""
        last_tick = None
        while True:
            changed = self._config_changed = trio.Event()
            interval = self._view.snapshot.config.load_scrape_interval()
            if interval <= 0:
                last_tick = None
                await changed.wait()
                continue
            due = trio.current_time() if last_tick is None else last_tick + interval
            with trio.move_on_at(due) as waiting:
                await changed.wait()
            if not waiting.cancelled_caught:
                continue  # a reload: read the interval again
            now = trio.current_time()
            last_tick = now if last_tick is None else next_tick(last_tick, interval, now)
            for node in self._view.snapshot.config.nodes:
                self._start_load_scrape(node)

    def _start_load_scrape(self, node: NodeConfig) -> None:
        self._start_with_key(_LOAD, self._load_in_flight, node, scrape_load)

    async def _report(self) -> None:
        """Send each ended probe's events, then let the node be probed again."""
        while True:
            for (kind, ip), events, error in await self._readiness.finished():
                if error is not None:
                    raise error  # the probes turn every failure into an event: this is a bug
                if kind == _HEALTH:
                    for event in events:
                        await self._emit(event)
                    self._health_in_flight.discard(ip)
                    if ip in self._round:
                        self._round.discard(ip)
                        if not self._round:
                            self._round_ended.set()
                elif kind == _LOAD:
                    await self._emit(events)
                    self._load_in_flight.discard(ip)
                else:
                    await self._emit(self._as_recorded(events))
                    self._models_in_flight.discard(ip)

    def _as_recorded(self, listed: ModelsListed) -> ModelsListed | ModelsUnchanged:
        """A listing as the log records it: by its digest when the node's state holds that list
        already (a node lists the same models at every probe, and a list may be megabytes)."""
        node = self._view.snapshot.nodes.get(listed.node)
        if listed.models and node is not None and node.models.names and listed.digest() == node.models.digest:
            return ModelsUnchanged(at=listed.at, node=listed.node, digest=node.models.digest)
        return listed

    def _timeout(self) -> float:
        return self._view.snapshot.config.gateway.probe_timeout

    def _authorization(self, ip: str) -> bytes:
        return self._view.upstream_authorizations.get(ip, b"")

    def _tls(self, ip: str) -> ssl.SSLContext | None:
        return self._view.upstream_tls.get(ip)


_HEALTH, _MODELS, _LOAD = "health", "models", "load"
"""The kinds of probe a node has in flight at most one of each."""


def next_tick(last_tick: float, interval: float, now: float) -> float:
    """When the next round starts, given the tick that started the last one.

    As with Go's time.Ticker: ticks fall every `interval`; of the ticks a slow round overran,
    the latest starts the next round at once and the others are dropped.
    """
    due = last_tick + interval
    if due > now:
        return due
    return last_tick + interval * math.floor((now - last_tick) / interval)

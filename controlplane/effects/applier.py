"""The one apply path of a control plane that acts on its events, the gateway's or a fleet
replica's: each numbered event reduced into the held state, then its step handed on, in this
order, to the event log, the JSON log (a config's log settings, the transitions), the metrics,
the listeners (the workers' fan-out) and the prober (a config's intervals, the step's effects).
Called by the one task that applies events (the reducer task, or a replica's follower)."""

from __future__ import annotations

from collections.abc import Callable

from controlplane.effects.held_state import HeldState
from controlplane.effects.metrics import ControlPlaneMetrics
from controlplane.effects.prober import Prober
from controlplane.infrastructure.logs import JsonLog
from controlplane.rules.transitions import Step
from events.log import encode_event
from events.state import ClusterState
from events.types import ConfigReloaded, Event, RunStarted
from journal.writer import LogAppender

Listener = Callable[[Event, ClusterState, Step], None]


class Applier:
    def __init__(self, view: HeldState, log: JsonLog, metrics: ControlPlaneMetrics) -> None:
        self.view = view
        self.log = log
        self.metrics = metrics
        self.event_log: LogAppender | None = None
        """The event log, when this control plane writes one (the gateway's, when configured)."""
        self.prober: Prober | None = None
        """The prober, while this control plane probes (the gateway's; a fleet's leader's)."""
        self._listeners: list[Listener] = []

    def add_listener(self, fn: Listener) -> None:
        """Call `fn(event, state, step)` in the applying task after each publish, with the
        numbered event; it must not block."""
        self._listeners.append(fn)

    def apply(self, event: Event) -> None:
        """Apply an event that has its number (this process's, or a fleet leader's), a config it
        puts in force having had its keys read (`HeldState.apply`), and hand the step on."""
        before = self.view.snapshot
        step = self.view.apply(event)
        state = self.view.snapshot
        if self.event_log is not None:
            self.event_log.submit(encode_event(event), base=before)
        if isinstance(event, (RunStarted, ConfigReloaded)):
            self.log.configure(state.config.gateway)
            if self.prober is not None:
                self.prober.config_changed()
        for transition in step.transitions:
            self.log.write(transition.at, transition.level, transition.msg, transition.log_fields())
        self.metrics.record(event, state, step)
        for listener in self._listeners:
            try:
                listener(event, state, step)
            except Exception as exc:
                self.log.error("control plane listener failed", error=f"{type(exc).__name__}: {exc}")
        if self.prober is not None:
            self.prober.run_effects(step.effects)

"""What one event does besides changing state: its transitions (log lines) and its effects.

A `Step` is the reducer's second result. Transitions are plinth's log messages and fields,
stamped with the event's seq and time; they are printed live, counted in metrics and
reproduced by `interlock audit`. Effects are data the runtime acts on (probe a node now, start
or stop probing one), never callables, so the reducer stays pure.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec

from controlplane.rules.log_lines import LINE_FORMATTERS
from events.types import Event


class TransitionKind(StrEnum):
    """What a transition is about, for `interlock audit --kind` (JSON: the value)."""

    RUN = "run"
    RELOAD = "reload"
    HEALTH = "health"
    MODELS = "models"
    OFFLINE = "offline"
    LOAD = "load"


RUN, RELOAD, HEALTH, MODELS, OFFLINE, LOAD = TransitionKind


class Transition(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One line of the transition log: plinth's message and fields, stamped with the event."""

    seq: int
    at: float
    kind: TransitionKind
    level: str
    msg: str
    node: str = ""
    fields: tuple[tuple[str, str], ...] = ()

    def log_fields(self) -> tuple[tuple[str, str], ...]:
        """The line's fields: `seq`, then plinth's."""
        return (("seq", str(self.seq)),) + self.fields

    def log_line(self, format: str = "json") -> str:
        """plinth's JSON log line (§6) at the event's time, plus `seq`; or the live `text` line."""
        return LINE_FORMATTERS[format](self.at, self.level, self.msg, self.log_fields())


class Recheck(msgspec.Struct, frozen=True, tag="recheck"):
    """Probe this node's health once, now (after the data plane found it unreachable)."""

    node: str


class StartProbing(msgspec.Struct, frozen=True, tag="start_probing"):
    node: str


class StopProbing(msgspec.Struct, frozen=True, tag="stop_probing"):
    node: str


class LoadAdapter(msgspec.Struct, frozen=True, tag="load_adapter"):
    """Load this configured LoRA adapter onto this node (`controlplane.rules.adapters`)."""

    node: str
    adapter: str


Effect = Recheck | StartProbing | StopProbing | LoadAdapter


class Step(msgspec.Struct, frozen=True):
    transitions: tuple[Transition, ...] = ()
    effects: tuple[Effect, ...] = ()


NOTHING = Step()


class StepBuilder:
    """Collects one event's transitions, stamped with its seq and time, and its effects."""

    def __init__(self, event: Event):
        self.event = event
        self.transitions: list[Transition] = []
        self.effects: list[Effect] = []

    def log(self, kind: TransitionKind, level: str, msg: str, node: str = "", **fields: object) -> None:
        pairs = tuple((key, str(value)) for key, value in fields.items())
        if node:
            pairs = (("node", node),) + pairs
        self.transitions.append(
            Transition(seq=self.event.seq, at=self.event.at, kind=kind, level=level, msg=msg, node=node, fields=pairs)
        )

    def step(self) -> Step:
        return Step(tuple(self.transitions), tuple(self.effects)) if self.transitions or self.effects else NOTHING

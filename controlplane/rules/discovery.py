"""Model discovery (GH-31): a node's next discovery record from one `GET /v1/models`, and the
lines that say so (plinth §8.2-§8.5).

The state machine (`next_discovery`) and its transition log (`models_listed`) live together
here; the reducer only dispatches the events. A listing is also when a configured LoRA adapter's
load onto the node may fall due (`controlplane.rules.adapters`).
"""

from __future__ import annotations

import msgspec

from controlplane.rules.adapters import adapters_due
from controlplane.rules.transitions import MODELS, LoadAdapter, StepBuilder
from events.config import Config
from events.state import Discovery, ModelCard, ModelDiscovery, NodeState
from events.types import ModelsListed, ModelsUnchanged, listing_digest

EMPTIES_BEFORE_KNOWN_EMPTY = 2
"""Consecutive empty listings before a node counts as serving nothing (one could be a node
still loading its model)."""


def next_discovery(
    before: ModelDiscovery,
    names: tuple[str, ...] | None,
    error: str,
    threshold: int,
    now: float,
    parents: tuple[tuple[str, str], ...] = (),
    cards: tuple[ModelCard, ...] = (),
) -> tuple[ModelDiscovery, bool]:
    """plinth's applyResult (§8.2): the next record and whether the model list changed.

    `names` is None exactly when the fetch failed with `error`; `threshold` is the number of
    consecutive failures after which the list expires; `parents` are the listed adapters' base
    models and `cards` vLLM's other fields of the entries, kept with the list.
    """
    if names is None:
        fails = before.fails + 1
        if threshold > 0 and fails >= threshold:
            state = Discovery.EXPIRED
        elif before.state in (Discovery.KNOWN, Discovery.DEGRADED):
            state = Discovery.DEGRADED
        else:
            state = before.state
        return msgspec.structs.replace(before, state=state, fails=fails, empties=0, last_error=error), False
    if names:
        changed = before.names != names or before.parents != parents or before.cards != cards
        digest = before.digest if not changed and before.digest else listing_digest(names, parents, cards)
        after = ModelDiscovery(
            state=Discovery.KNOWN, names=names, fetched_at=now, parents=parents, cards=cards, digest=digest
        )
        return after, changed
    empties = before.empties + 1
    if empties >= EMPTIES_BEFORE_KNOWN_EMPTY:
        changed = bool(before.names)
        return ModelDiscovery(state=Discovery.KNOWN_EMPTY, names=None, fetched_at=now, empties=empties), changed
    return msgspec.structs.replace(before, fetched_at=now, fails=0, empties=empties, last_error=""), False


def models_listed(node: NodeState, event: ModelsListed, config: Config, out: StepBuilder) -> NodeState:
    return _listing_applied(node, event.at, event.models, event.error, event.parents, event.cards, config, out)


def models_unchanged(node: NodeState, event: ModelsUnchanged, config: Config, out: StepBuilder) -> NodeState:
    """The listing the node's state holds, listed again (a ModelsListed of the same list); none
    applied when the state holds another by now."""
    before = node.models
    if not before.names or event.digest != before.digest:
        out.log(MODELS, "warn", "unchanged model listing of another list ignored", node=node.ip, digest=event.digest)
        return node
    return _listing_applied(node, event.at, before.names, "", before.parents, before.cards, config, out)


def _listing_applied(
    node: NodeState,
    at: float,
    names: tuple[str, ...] | None,
    error: str,
    parents: tuple[tuple[str, str], ...],
    cards: tuple[ModelCard, ...],
    config: Config,
    out: StepBuilder,
) -> NodeState:
    before = node.models
    after, list_changed = next_discovery(before, names, error, config.gateway.health_fail_threshold, at, parents, cards)
    if after.state != before.state:
        if after.state == Discovery.KNOWN_EMPTY:
            out.log(MODELS, "warn", "node reports no models", node=node.ip)
        elif after.state == Discovery.DEGRADED:
            out.log(MODELS, "warn", "model discovery failed", node=node.ip, error=after.last_error)
        elif after.state == Discovery.EXPIRED:
            out.log(MODELS, "error", "model discovery expired", node=node.ip, error=after.last_error)
        elif after.state == Discovery.KNOWN:
            msg = "models discovered" if before.state == Discovery.UNTRIED else "model discovery recovered"
            out.log(MODELS, "info", msg, node=node.ip, models=",".join(after.names or ()))
    if list_changed:
        out.log(MODELS, "info", "node model list changed", node=node.ip, models=",".join(after.names or ()))
        for model in configured_models_missing(node.ring, after.names or (), config):
            out.log(MODELS, "warn", "configured model not served by node", node=node.ip, model=model)
    node = msgspec.structs.replace(node, models=after)
    out.effects.extend(LoadAdapter(node.ip, adapter.name) for adapter in adapters_due(node, config, at))
    return node


def configured_models_missing(ring: str, names: tuple[str, ...], config: Config) -> list[str]:
    """plinth's warnConfigModelsMissing (§8.5): configured models a node of `ring` ("" for a
    standalone node) should serve but does not (`names`). Adapters are left out: a node serves
    one only once loaded."""
    missing = []
    available_names = set()
    listed = frozenset(names)
    for entry in config.models.available:
        available_names.add(entry.name)
        if entry.ring == ring and entry.name and not entry.target and not entry.parent and entry.name not in listed:
            missing.append(entry.name)
    default = config.models.default
    if default and default not in available_names and default not in listed:
        missing.append(default)
    return missing

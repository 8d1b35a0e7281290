"""LoRA adapters the gateway loads onto nodes (`ModelEntry.lora_path`): when a load is due, and
what each load's events (requested, loaded, failed) do to the node's state.

A configured adapter is due on a node of its ring that is healthy and online, lists the
adapter's parent and not the adapter, and has had no load of it for LOAD_RETRY_SECONDS: so a
failed load, one never answered, and one whose adapter the node stopped listing (a restart) are
asked again after that back-off, never in a loop; a node that answers loads as done and then
does not list the adapter is asked again after a back-off that doubles at each such load
(`AdapterLoad.unlisted`), and its requests meanwhile get a 503 naming the adapter and the node
(`loaded_unlisted`). The rule (`adapters_due`) is asked at each
model listing of the node, with the listing's time, and a due load is an effect of that event
(`LoadAdapter`): the reducer stays pure, and the prober (the leader's, in a fleet) loads through
vLLM's runtime API (`controlplane.effects.probes.load_adapter`), never the request path.
"""

from __future__ import annotations

import msgspec

from controlplane.rules.transitions import MODELS, StepBuilder
from events.config import Config, ModelEntry
from events.state import AdapterLoad, AdapterLoadState, Discovery, Health, NodeState
from events.types import AdapterLoaded, AdapterLoadFailed, AdapterLoadRequested

LOAD_RETRY_SECONDS = 60.0
"""Seconds after a load was asked or answered before the same adapter is asked of the same node
again (it failed, was never answered, or the node lost it)."""

MAX_UNLISTED_DOUBLINGS = 4
"""A node that answers loads as done and then does not list the adapter is asked again after a
back-off doubled at each such load, up to 2**4 times LOAD_RETRY_SECONDS."""


def adapters_due(node: NodeState, config: Config, now: float) -> list[ModelEntry]:
    """The configured adapters whose load onto `node` is due at `now` (the module's rule)."""
    adapters = config.loaded_adapters()
    if not adapters or node.status != Health.HEALTHY or node.is_offline(now) or node.models.state != Discovery.KNOWN:
        return []
    listed = node.models.listed
    due = []
    for entry in adapters.values():
        if entry.ring != node.ring or entry.parent not in listed or entry.name in listed:
            continue
        last = node.adapter_load(entry.name)
        if last is None or now - last.at >= retry_seconds(last.unlisted):
            due.append(entry)
    return due


def retry_seconds(unlisted: int) -> float:
    """The back-off after a load before the adapter is asked of the node again, `unlisted` loads
    in a row having been answered done and then not listed (`AdapterLoad.unlisted`)."""
    return LOAD_RETRY_SECONDS * 2 ** min(unlisted, MAX_UNLISTED_DOUBLINGS)


def loaded_unlisted(node: NodeState, adapter: str) -> bool:
    """Whether `node` answered the gateway's last load of `adapter` as done and has listed its
    models since without it."""
    load = node.adapter_load(adapter)
    fetched_at = node.models.fetched_at
    return (
        load is not None
        and load.state == AdapterLoadState.LOADED
        and fetched_at is not None
        and fetched_at >= load.at
        and adapter not in node.models.listed
    )


def is_loading(node: NodeState, adapter: str) -> bool:
    """Whether the gateway's load of `adapter` onto `node` is under way: asked and not answered,
    or answered loaded after the node's last listing (which will show it)."""
    load = node.adapter_load(adapter)
    if load is None or load.state == AdapterLoadState.FAILED:
        return False
    if load.state == AdapterLoadState.REQUESTED:
        return True
    fetched_at = node.models.fetched_at
    return fetched_at is None or fetched_at < load.at


def adapter_load_requested(node: NodeState, event: AdapterLoadRequested, config: Config, out: StepBuilder) -> NodeState:
    if event.adapter not in config.loaded_adapters():
        return node  # only configured adapters are kept: the node's loads stay bounded by the config
    last = node.adapter_load(event.adapter)
    unlisted = last.unlisted + 1 if last is not None and last.state == AdapterLoadState.LOADED else 0
    reason = "node serves the parent and lacks the adapter"
    if unlisted:
        reason = f"node answered the last {unlisted} load(s) as done and does not list the adapter"
    out.log(
        MODELS, "info", "adapter load requested", node=node.ip, adapter=event.adapter, parent=event.parent,
        lora_path=event.lora_path, reason=reason,
    )  # fmt: skip
    load = AdapterLoad(adapter=event.adapter, state=AdapterLoadState.REQUESTED, at=event.at, unlisted=unlisted)
    return _with_load(node, load)


def adapter_loaded(node: NodeState, event: AdapterLoaded, config: Config, out: StepBuilder) -> NodeState:
    if event.adapter not in config.loaded_adapters():
        return node
    out.log(MODELS, "info", "adapter loaded", node=node.ip, adapter=event.adapter)
    loaded = AdapterLoad(
        adapter=event.adapter, state=AdapterLoadState.LOADED, at=event.at, unlisted=_unlisted(node, event.adapter)
    )
    return _with_load(node, loaded)


def adapter_load_failed(node: NodeState, event: AdapterLoadFailed, config: Config, out: StepBuilder) -> NodeState:
    if event.adapter not in config.loaded_adapters():
        return node
    out.log(
        MODELS, "warn", "adapter load failed", node=node.ip, adapter=event.adapter, error=event.error,
        retry_after=f"{retry_seconds(_unlisted(node, event.adapter)):g}s",
    )  # fmt: skip
    load = AdapterLoad(
        adapter=event.adapter, state=AdapterLoadState.FAILED, at=event.at, error=event.error,
        unlisted=_unlisted(node, event.adapter),
    )  # fmt: skip
    return _with_load(node, load)


def _unlisted(node: NodeState, adapter: str) -> int:
    """The count of `AdapterLoad.unlisted` that the answer to the load under way carries on."""
    last = node.adapter_load(adapter)
    return last.unlisted if last is not None else 0


def _with_load(node: NodeState, load: AdapterLoad) -> NodeState:
    """`node` with `load` in the place of its last load of the same adapter (or after the others)."""
    loads = [load if previous.adapter == load.adapter else previous for previous in node.adapter_loads]
    if load not in loads:
        loads.append(load)
    return msgspec.structs.replace(node, adapter_loads=tuple(loads))

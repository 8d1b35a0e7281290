"""LoRA adapters the gateway loads onto nodes (`ModelEntry.lora_path`): when a load is due, and
what each load's events (requested, loaded, failed) do to the node's state.

A configured adapter is due on a node of its ring that is healthy and online, lists the
adapter's parent and not the adapter, and has had no load of it for LOAD_RETRY_SECONDS: so a
failed load, one never answered, and one whose adapter the node stopped listing (a restart) are
asked again after that back-off, never in a loop. The rule (`adapters_due`) is asked at each
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
        if last is None or now - last.at >= LOAD_RETRY_SECONDS:
            due.append(entry)
    return due


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
    out.log(
        MODELS, "info", "adapter load requested", node=node.ip, adapter=event.adapter, parent=event.parent,
        lora_path=event.lora_path, reason="node serves the parent and lacks the adapter",
    )  # fmt: skip
    return _with_load(node, AdapterLoad(adapter=event.adapter, state=AdapterLoadState.REQUESTED, at=event.at))


def adapter_loaded(node: NodeState, event: AdapterLoaded, config: Config, out: StepBuilder) -> NodeState:
    if event.adapter not in config.loaded_adapters():
        return node
    out.log(MODELS, "info", "adapter loaded", node=node.ip, adapter=event.adapter)
    return _with_load(node, AdapterLoad(adapter=event.adapter, state=AdapterLoadState.LOADED, at=event.at))


def adapter_load_failed(node: NodeState, event: AdapterLoadFailed, config: Config, out: StepBuilder) -> NodeState:
    if event.adapter not in config.loaded_adapters():
        return node
    out.log(
        MODELS, "warn", "adapter load failed", node=node.ip, adapter=event.adapter, error=event.error,
        retry_after=f"{LOAD_RETRY_SECONDS:g}s",
    )  # fmt: skip
    load = AdapterLoad(adapter=event.adapter, state=AdapterLoadState.FAILED, at=event.at, error=event.error)
    return _with_load(node, load)


def _with_load(node: NodeState, load: AdapterLoad) -> NodeState:
    """`node` with `load` in the place of its last load of the same adapter (or after the others)."""
    loads = [load if previous.adapter == load.adapter else previous for previous in node.adapter_loads]
    if load not in loads:
        loads.append(load)
    return msgspec.structs.replace(node, adapter_loads=tuple(loads))

"""Load: what each node's vLLM `/metrics` says it is doing, for the load-aware policies.

A scrape that fails makes the node's load unknown; the node keeps routing (a node can serve and
still fail to export metrics), and its load is known again at the next good scrape. The rule and
its transition lines live together here; the reducer only dispatches the events.
"""

from __future__ import annotations

import msgspec

from controlplane.transitions import LOAD, StepBuilder
from events.config import Config
from events.state import NodeLoad, NodeState
from events.types import LoadScraped


def load_scraped(node: NodeState, event: LoadScraped, config: Config, out: StepBuilder) -> NodeState:
    previous = node.load
    if event.error or event.running is None or event.waiting is None:
        error = event.error or "load metrics missing"
        if previous.known or previous.scraped_at is None and previous.fails == 0:
            out.log(LOAD, "warn", "node load unknown", node=node.ip, error=error)
        load = msgspec.structs.replace(previous, known=False, fails=previous.fails + 1, last_error=error)
    else:
        if not previous.known and previous.fails:
            out.log(LOAD, "info", "node load known again", node=node.ip)
        load = NodeLoad(
            known=True,
            running=event.running,
            waiting=event.waiting,
            kv_cache_usage=event.kv_cache_usage,
            scraped_at=event.at,
        )
    return msgspec.structs.replace(node, load=load)

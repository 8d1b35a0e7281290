"""Load: what each node's vLLM `/metrics` says it is doing, for the load-aware policies.

A scrape that fails makes the node's load unknown; the node keeps routing (a node can serve and
still fail to export metrics), and its load is known again at the next good scrape. The rule and
its transition lines live together here; the reducer only dispatches the events.
"""

from __future__ import annotations

import msgspec

from controlplane.rules.transitions import LOAD, StepBuilder
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
            seconds_per_token=_seconds_per_token(previous, event),
            token_seconds=event.token_seconds,
            tokens=event.tokens,
            scraped_at=event.at,
            lora=event.lora,
        )
    return msgspec.structs.replace(node, load=load)


def _seconds_per_token(previous: NodeLoad, event: LoadScraped) -> float | None:
    """The mean time between tokens since the previous counted scrape, when the node produced
    tokens meanwhile; else the previous mean (an idle node, or counters that went back because
    the node restarted). None once the node stops exporting the histogram."""
    if event.tokens is None or event.token_seconds is None:
        return None
    if previous.tokens is None or previous.token_seconds is None:
        return previous.seconds_per_token
    tokens = event.tokens - previous.tokens
    seconds = event.token_seconds - previous.token_seconds
    if tokens > 0 and seconds >= 0:
        return seconds / tokens
    return previous.seconds_per_token

"""The decision record's schema: why a proxied request went where it went, one JSON line each.

Written by the data plane (`dataplane.decisions`), read back by the offline tools (`interlock
explain --request-id`, `whatif`, the timeline), so it lives with the rest of the vocabulary.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from enum import StrEnum

import msgspec

from events.config import Policy
from journal.reader import read_records


class AttemptOutcome(StrEnum):
    """How one attempt ended (JSON: the value)."""

    COMPLETED = "completed"
    """The node's whole response reached the client."""
    TRUNCATED = "truncated"
    """Committed, then the node failed: the client got a response cut short."""
    RETRIED = "retried"
    """A failure before anything was sent to the client; the next node was tried."""
    FAILED = "failed"
    """A failure that ends the request with 502 (not retried: the node may have started work)."""
    CLIENT_GONE = "client_gone"
    """The client went away during the attempt."""


class Exclusion(msgspec.Struct, frozen=True):
    node: str
    reason: str
    """missing, empty or expired (the model filter), dead, or offline."""


class AttemptRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    node: str
    outcome: AttemptOutcome
    status: int | None = None
    """The node's HTTP status, when it answered."""
    error: str = ""


class CandidateScore(msgspec.Struct, frozen=True, omit_defaults=True):
    """One candidate of a routing policy's choice: its score inputs and its score (lower is better)."""

    node: str
    score: float
    in_flight: int = 0
    """Requests the routing process had in flight to the node when it chose."""
    running: float | None = None
    waiting: float | None = None
    """The node's own figures at its last scrape; None when its load is unknown."""
    kv_cache_usage: float | None = None
    seconds_per_token: float | None = None
    """The node's time between tokens, when known: what prefix affinity's load bound weighs with."""
    note: str = ""
    """Why the candidate was passed over other than by its score (`controlplane.policies`'
    NOT_DRAWN, OVER_LOAD_BOUND)."""


class Decision(msgspec.Struct, frozen=True):
    """One completion request that reached routing (past the body checks)."""

    request_id: str
    at: float
    """When the request arrived (UNIX seconds)."""
    path: str
    model: str
    """The model routed to (when the client named an alias: its target)."""
    stream: bool
    seq: int
    """The seq of the control-plane snapshot the request was routed on (so `interlock explain
    --until-seq` over the event log shows the same cluster)."""
    ring: str
    ring_pool: tuple[str, ...]
    excluded: tuple[Exclusion, ...]
    attempts: tuple[AttemptRecord, ...]
    status: int | None
    """The status the client got; None when the client went away first."""
    duration: float
    worker: int = 0
    """The worker process that routed it (`serve --workers`); 0 in a gateway without workers."""
    replica: str = ""
    """The gateway that routed it, by its host's name (a pod's name in Kubernetes), so that the
    records of several replicas can be told apart; "" in records from before it was recorded."""
    policy: Policy = "round_robin"
    """The policy that chose the first attempt's node (records from before policies: round robin)."""
    prefix: str = ""
    """A short hash of the prompt's prefix (`routing.prefix_*`), recorded under every policy so
    that `interlock whatif` can route the request by prefix; never the prompt itself."""
    rotation: int = 0
    """The round-robin counter the first pick was made with (ties and round robin follow it)."""
    candidates: tuple[CandidateScore, ...] = ()
    """The first pick's candidates, best first, as the policy scored them."""
    margin: float | None = None
    """The chosen node's score lead over the next candidate; None with a single candidate."""
    remembered: str = ""
    """prefix_affinity: the node this process last sent the prefix to, tried first ("" if none)."""
    prefill_attempts: tuple[AttemptRecord, ...] = ()
    """A prefill/decode-disaggregated request's prefill leg, in order (`attempts` are then its
    decode leg's, the answer the client got); empty for a request served whole."""
    alias: str = ""
    """The alias the client named (`models.available` `target`), routed as `model`; "" when the
    client named the model itself, and in records from before aliases."""


_decode_decision = msgspec.json.Decoder(Decision)


def read_decisions(path: str | os.PathLike[str], warn: Callable[[str], None] | None = None) -> Iterator[Decision]:
    """The records of a decision log (its name, or one segment), oldest first; the reading rules
    are `events.jsonl`'s (LogFileError names a bad line)."""
    for _, decision in read_records([path], _decode_decision, warn, "decision log"):
        yield decision


def find_decisions(
    path: str | os.PathLike[str], request_id: str, warn: Callable[[str], None] | None = None
) -> list[Decision]:
    """Every record of `request_id`, oldest first: clients choose their X-Request-Id, and may
    send one twice."""
    return [decision for decision in read_decisions(path, warn) if decision.request_id == request_id]

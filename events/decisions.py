"""The decision record's schema: why a proxied request went where it went, one JSON line each.

Written by the data plane (`dataplane.decisions`), read back by the offline tools (`interlock
explain --request-id`, `whatif`, the timeline), so it lives with the rest of the vocabulary.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from enum import StrEnum

import msgspec
from msgspec import UNSET, UnsetType

from events.config import Policy
from events.state import Moment
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


class KvBlocks(msgspec.Struct, frozen=True):
    """What a node's KV events said of a request's prompt when `kv_aware` scored it (the index's
    `match`: `kvcache.index`)."""

    matched: int
    """The prompt's full blocks the node held: the longest chain from the prompt's first block."""
    total: int
    """The prompt's full blocks."""
    seq: int
    """The index's position for the node: the last sequence number of its events applied."""
    flowing: bool
    """Its events were arriving without an unrepaired gap; else the policy fell back for it."""


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
    """Why the candidate was passed over other than by its score (`controlplane.rules.policies`'
    NOT_DRAWN, OVER_LOAD_BOUND, LORA_AVOIDED, AT_MAX_IN_FLIGHT)."""
    lora: str = ""
    """A request for a LoRA adapter: what the node's scrape said of it (`controlplane.rules.policies`'
    LORA_RUNNING, LORA_LOADED, LORA_FULL); "" for a base model."""
    full: bool = False
    """The one rule for a node's room (`controlplane.saturation.room`) found no place on the node
    for the request when it was picked: passed over while another had one (AT_MAX_IN_FLIGHT)."""
    kv: KvBlocks | None = None
    """`kv_aware`: the prompt's blocks the node held, by its KV events; None when there was no
    match for it (a node without `kv_events`, or a prompt without tokens)."""
    fallback: bool = False
    """`kv_aware` scored the node as `prefix_affinity` would (no match for it, or its events not
    flowing: `controlplane.rules.policies`)."""


class LegPick(msgspec.Struct, frozen=True, omit_defaults=True):
    """The first pick of a disaggregated request's prefill leg, with its policy inputs, as
    `Decision` records the first pick of the decode leg (or of a whole request)."""

    rotation: int = 0
    candidates: tuple[CandidateScore, ...] = ()
    margin: float | None = None
    remembered: str = ""


class Verdict(StrEnum):
    """What admission made of a request (JSON: the value)."""

    ADMITTED = "admitted"
    """Admitted at once."""
    QUEUED = "queued"
    """Admitted after waiting in the gateway's queue (`queued_ms`)."""
    REFUSED = "refused"
    """Refused (`refused_by` names the limit, with its state)."""


class FairShare(msgspec.Struct, frozen=True):
    """This process's in-flight counts, as a request arrived at the queue, by which its tenant
    held less than its fair share of its priority's requests or not (`saturation.under_fair_share`)."""

    tenant_in_flight: int
    """Its tenant's requests of its priority in flight."""
    priority_in_flight: int
    """All requests of its priority in flight."""
    tenants: int
    """The tenants those are of, its own included."""


class Admission(msgspec.Struct, frozen=True, omit_defaults=True):
    """Who a request was for and what admission made of it."""

    tenant: str
    """The tenant its key belongs to (`[[tenants]]`; `gateway` for `[gateway]`'s keys, `default`
    without keys)."""
    priority: int = 0
    """Its tenant's priority, or lower when an `x-gateway-inference-objective` asked for less."""
    fairness_id: str = ""
    """llm-d's `x-gateway-inference-fairness-id` (clipped), "" when absent."""
    verdict: Verdict = Verdict.ADMITTED
    refused_by: str = ""
    """What refused it: a limit (`requests`, `tokens`, `in_flight`: 429), or the queue
    (`queue_full`: 429, `queue_deadline`: it waited its `max_queue_seconds`, 503); "" when admitted."""
    limit: int | None = None
    remaining: int | None = None
    reset: float | None = None
    """The refusing limit's state: the limit, what was left, seconds until it is whole again."""
    queued_ms: float = 0.0
    """Milliseconds it waited in the gateway's queue (a client that went away meanwhile: until then)."""
    tokens_reserved: int = 0
    """Tokens taken from the tenant's `tokens_per_minute` at admission (its `max_tokens`, or the
    default, plus its prompt's estimate); 0 when the tenant has no token limit."""
    tokens_used: int | None = None
    """The tokens the node reported (`usage`: prompt plus completion), when it reported them."""
    saturated_seq: int = 0
    """The seq of the snapshot on which every node of its pool was saturated when it reached the
    queue (`controlplane.rules.saturation`; 0: it was not, or the queue is off); `explain` derives the
    nodes' saturation again from the state at that seq."""
    headroom: int = 0
    """The in-flight places per node its priority left free for the top priority (`[admission]
    priority_headroom`, below the highest configured tenant priority): a node with a
    `max_in_flight` was full for it that many places early; 0: the full `max_in_flight`."""
    fair_share: FairShare | None = None
    """Whether its tenant held less than its fair share of the requests of its priority in flight,
    and so went ahead of the others of its priority (`saturation.rank`): the counts then. None
    without the queue, or when no other tenant of its priority had a request in flight."""
    preemptible: int = 0
    """The requests of lower ranks (`saturation.rank`) this process had in flight on the pool's
    nodes with priority scheduling when it was admitted: they held it no place, as those nodes
    preempt them for it (`controlplane.rules.saturation`)."""


class Decision(msgspec.Struct, frozen=True):
    """One completion request that reached routing (past the body checks)."""

    request_id: str
    at: Moment
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
    admission: Admission | None = None
    """Its tenant and admission verdict; None in records from before admission."""
    prefill_pick: LegPick | None = None
    """A disaggregated request's prefill leg's first pick (`rotation`, `candidates`, `margin`
    and `remembered` are then the decode leg's); None for a request served whole, a prefill leg
    that found no node, and records from before it was recorded."""
    number: int = 0
    """Its place among the records of its routing process (replica and worker), from 1, so
    that `verify` sees a record missing, repeated or out of order; 0 in records from before
    records were numbered. A process started again counts from 1 again."""
    partition: str = ""
    """The partition of its replica whose own events it was routed on (`fleet.partition`: its
    seq is then that partition's, in the partition's event log); "" for the fleet's events, a
    gateway's own, and records from before partitions."""

    def prefill_leg(self) -> Decision:
        """The record as its prefill leg's: that leg's attempts and first pick in the place of
        the decode leg's, so that the leg is read (and made again) as a whole request is."""
        pick = self.prefill_pick or LegPick()
        return msgspec.structs.replace(
            self,
            attempts=self.prefill_attempts,
            prefill_attempts=(),
            prefill_pick=None,
            rotation=pick.rotation,
            candidates=pick.candidates,
            margin=pick.margin,
            remembered=pick.remembered,
        )


_decode_decision = msgspec.json.Decoder(Decision)


POLICY_INPUTS = ("policy", "rotation", "candidates", "prefix", "remembered")
"""The fields a first pick is made again from (besides the state at the record's seq), each
added to the record at another time: a record older than one of them lacks it."""


class _PolicyInputKeys(msgspec.Struct):
    """Which of POLICY_INPUTS a record's line holds (UNSET: the key is absent)."""

    policy: msgspec.Raw | UnsetType = UNSET
    rotation: msgspec.Raw | UnsetType = UNSET
    candidates: msgspec.Raw | UnsetType = UNSET
    prefix: msgspec.Raw | UnsetType = UNSET
    remembered: msgspec.Raw | UnsetType = UNSET


class _DecisionWithGaps:
    """A decoder (for `read_records`) of a record and the policy inputs its line lacks."""

    _decode_keys = msgspec.json.Decoder(_PolicyInputKeys).decode

    def decode(self, line: bytes) -> tuple[Decision, tuple[str, ...]]:
        decision = _decode_decision.decode(line)
        keys = self._decode_keys(line)
        missing = tuple(name for name in POLICY_INPUTS if getattr(keys, name) is UNSET)
        if decision.attempts and not decision.candidates and "candidates" not in missing:
            missing += ("candidates",)  # a pick made without its scores (a log without them)
        return decision, missing


def read_decisions_with_gaps(
    paths: Iterable[str | os.PathLike[str]],
    warn: Callable[[str], None] | None = None,
    skip_invalid: Callable[[str], None] | None = None,
) -> Iterator[tuple[Decision, tuple[str, ...]]]:
    """The records of decision logs (names or segments, several workers' or replicas' files
    alike), each with the POLICY_INPUTS its line lacks (`missing_inputs` says which matter).
    Given `skip_invalid` (a damaged log), a bad line is skipped and reported to it."""
    decoder = _DecisionWithGaps()
    for _, record in read_records(paths, decoder, warn, "decision log", skip_invalid):  # type: ignore[arg-type]
        yield record


def missing_inputs(decision: Decision, absent: tuple[str, ...]) -> tuple[str, ...]:
    """Of the inputs a record lacks, those its first picks need: none without a pick; the
    prompt prefix and the remembered node only under prefix affinity and kv_aware; and a disaggregated
    record's prefill leg's first pick (`prefill_pick`), from before it was recorded."""
    lacking = absent if absent and decision.attempts else ()
    if lacking and "policy" not in absent and decision.policy not in ("prefix_affinity", "kv_aware"):
        lacking = tuple(name for name in absent if name not in ("prefix", "remembered"))
    if decision.prefill_attempts and decision.prefill_pick is None:
        lacking += ("prefill_pick",)
    return lacking


def read_decisions(
    path: str | os.PathLike[str],
    warn: Callable[[str], None] | None = None,
    skip_invalid: Callable[[str], None] | None = None,
) -> Iterator[Decision]:
    """The records of a decision log (its name, or one segment), oldest first; the reading rules
    are `events.jsonl`'s (LogFileError names a bad line, unless `skip_invalid` takes it)."""
    for _, decision in read_records([path], _decode_decision, warn, "decision log", skip_invalid):
        yield decision


def find_decisions(
    path: str | os.PathLike[str],
    request_id: str,
    warn: Callable[[str], None] | None = None,
    skip_invalid: Callable[[str], None] | None = None,
) -> list[Decision]:
    """Every record of `request_id`, oldest first: clients choose their X-Request-Id, and may
    send one twice."""
    return [decision for decision in read_decisions(path, warn, skip_invalid) if decision.request_id == request_id]

"""Routing policies: which node of the pool gets a request, and the scores that say why.

The pool is what routing leaves (`controlplane.rules.routing`: ring, model list, offline, dead, and
healthy before degraded), minus the nodes a request already tried; a policy only chooses within
it. Each policy is a pure function of the pool, the load the snapshot holds, the in-flight counts
of the process that routes, the round-robin rotation, the request id, the prompt prefix, the
node that process last sent the prefix to and the prompt's blocks each node holds (`matches`,
an input like load, which the record keeps), so the data plane and `interlock whatif` choose the
same way from the same inputs.

Every candidate gets a score, lower is better, and the choice lists them best first:

- `round_robin` (plinth's, the default): `pool[rotation % len(pool)]`; a candidate's score is
  how many turns away it is.
- `least_load`: the lowest load, ties broken by the round-robin order. A node's load is the
  requests this process has in flight to it plus those the node said it was running and
  waiting at its last scrape; a node whose load is unknown (its scrape failed) is counted at
  the mean of the known ones, so that it neither attracts nor repels requests.
- `power_of_two`: two candidates drawn at random, the less loaded wins (ties: the first drawn).
  The draw is seeded from the request id, so a replay draws the same two.
- `prefix_affinity`: rendezvous hashing of the prompt prefix over the candidates, so that
  requests sharing a prefix go to the node whose cache holds it; a node whose work is above
  `load_bound` times the pool's mean (counting this request) is passed over for the next one in
  the prefix's order (consistent hashing with bounded loads). The score is the rank in that order.
  - The node the routing process last sent the prefix to (`remembered`, kept in a
    `PrefixMemory`) comes first in the order: a prefix passed over to another node stays there,
    whose cache now holds it, rather than coming back when its first node has room. So a node
    that hashing gave too many prefixes sheds some for good, not a few requests of each.
  - A node's work is its load times its cost: its time between tokens over the fastest
    candidate's (`NodeLoad.seconds_per_token`; unknown: the mean cost of the known ones, 1 when
    none is known). A node 3× slower is passed over once it holds a third of the requests: counted
    in requests, the bound would let its queue run long, each of its requests staying 3× as long.
    The bound is rounded up to whole requests of the node.
- `kv_aware`: by what each node's cache really holds, from its KV events (`kvcache`): the
  prompt's full blocks it holds (`matches`: the longest chain from the prompt's first block, of
  the prompt's full blocks, kept in the record per candidate, `CandidateScore.kv`). The score is
  the share of the prompt's blocks the node lacks (0 to 1; 1 when the prompt has no full block)
  plus its share of the pool's work were the request sent to it (its load, this request
  included, times its cost, as prefix affinity weighs them), ties in the prefix's order; a
  node over prefix affinity's load bound by more than KV_BOUND_SLACK requests is passed over
  (OVER_LOAD_BOUND), so a hot prefix cannot pile onto the nodes that hold it, and the room rule
  below holds as for every policy (its scrape's KV use among it). The slack is for a pool at
  low load, where the bound, in whole requests, leaves a node running a single request over
  it: passing over the node that holds a conversation's blocks for an idle one makes the
  request wait for the whole prompt's prefill, while a request more in a node's running batch
  barely slows it.
  - A node whose events are not flowing, or without a match (no `kv_events`, or a prompt the
    gateway could not tokenize), is scored by prefix affinity's guess, marked `fallback`: it
    lacks nothing when it is the first of the prefix's order (the node the prefix last went
    to, else the rendezvous hash's first), everything otherwise. When no candidate's events
    flow, the choice is prefix affinity's, every candidate marked `fallback`.

A request for a LoRA adapter (`routing.Route.adapter`) has affinity under every policy: the
candidates are ranked by what their scrape says of the adapter (`lora_standing`: running it,
having it, or running as many adapters as they may while others wait), and the policy chooses
among those of the best standing; the others follow in the record, passed over.

Under every policy, a candidate the one rule for a node's room (`saturation.room`: its
`max_in_flight` less the places the request's priority leaves free, lower ranks a priority node
preempts, the scrape's saturation while the gateway queues) finds without a place for the request
is passed over while another has one (AT_MAX_IN_FLIGHT): the admission queue lets a request through
by the same rule when some node of the pool has room, and it must go there, not into a full node's
own queue or a place kept for a higher priority. The record marks those candidates (`full`), so a
replay passes over the same ones.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple

import msgspec

from events.config import DEFAULT_LOAD_BOUND, POLICIES, Policy
from events.decisions import CandidateScore, KvBlocks
from events.state import NodeState

ROUND_ROBIN, LEAST_LOAD, POWER_OF_TWO, PREFIX_AFFINITY, KV_AWARE = POLICIES

NOT_DRAWN = "not drawn"
OVER_LOAD_BOUND = "load bound"
KV_BOUND_SLACK = 1
"""kv_aware: requests a node may take over prefix affinity's load bound (see the module's doc)."""
LORA_AVOIDED = "lora affinity"
AT_MAX_IN_FLIGHT = "max_in_flight"
"""Notes on candidates passed over other than by their score (AT_MAX_IN_FLIGHT: the node had no
room for the request, `saturation.room`; the name is the one records have always carried)."""

LORA_RUNNING, LORA_LOADED, LORA_FULL = "running", "loaded", "full"
"""What a candidate's scrape says of a request's LoRA adapter, best first: the node runs it (a
running request uses it), has it (it lists the adapter; or its scrape is unknown), or runs as
many adapters as it may (`max_lora`) while requests for others wait (this one would wait too)."""
LORA_STANDINGS = (LORA_RUNNING, LORA_LOADED, LORA_FULL)


class Choice(NamedTuple):
    node: NodeState
    candidates: tuple[CandidateScore, ...]
    """Every candidate, the chosen one first, then best first."""
    margin: float | None
    """The chosen node's score lead over the next candidate; None with a single candidate."""
    remembered: str = ""
    """prefix_affinity: the node the prefix last went to, tried first ("" when none in the pool)."""


PREFIX_MEMORY_ENTRIES = 10_000
"""Prefixes a routing process remembers the node of, the least recently routed forgotten first."""


class PrefixMemory:
    """The node each prompt prefix last went to, for prefix affinity: one per routing process
    (the data plane's balancer, and each worker's in `interlock whatif`)."""

    def __init__(self, entries: int = PREFIX_MEMORY_ENTRIES) -> None:
        self._entries = entries
        self._nodes: OrderedDict[str, str] = OrderedDict()

    def node_of(self, prefix: str) -> str:
        return self._nodes.get(prefix, "")

    def remember(self, prefix: str, ip: str) -> None:
        self._nodes[prefix] = ip
        self._nodes.move_to_end(prefix)
        if len(self._nodes) > self._entries:
            self._nodes.popitem(last=False)


def choose(
    policy: Policy,
    pool: Sequence[NodeState],
    *,
    rotation: int,
    in_flight: Mapping[str, int],
    request_id: str = "",
    prefix: str = "",
    load_bound: float = DEFAULT_LOAD_BOUND,
    remembered: str = "",
    adapter: str = "",
    full: Collection[str] = (),
    matches: Mapping[str, KvBlocks] = {},
) -> Choice:
    """The node `policy` picks from `pool` (non-empty, in routing's order), with every
    candidate's score; an unknown policy name is round robin (a config names only known ones).
    `remembered` is the node the prefix last went to (prefix affinity's and kv_aware's);
    `matches` the prompt's blocks each node holds (kv_aware's, by node IP). A request for a
    LoRA `adapter` is picked among the candidates of the best standing (`lora_standing`), the
    others listed after them, passed over (LORA_AVOIDED), each with its standing. Before that,
    the candidates in `full` (no room for the request, `saturation.room`) are passed over
    (AT_MAX_IN_FLIGHT) while another has room; every one of them is marked `full`."""
    if full:
        inputs = dict(
            rotation=rotation, in_flight=in_flight, request_id=request_id, prefix=prefix, load_bound=load_bound,
            remembered=remembered, adapter=adapter, matches=matches,
        )  # fmt: skip
        with_room = [node for node in pool if node.ip not in full]
        if len(with_room) < len(pool) and with_room:
            choice = _in_tiers(policy, [with_room, [node for node in pool if node.ip in full]], AT_MAX_IN_FLIGHT, inputs)
        else:
            choice = choose(policy, pool, **inputs)
        candidates = tuple(msgspec.structs.replace(c, full=True) if c.node in full else c for c in choice.candidates)
        return choice._replace(candidates=candidates)
    if adapter:
        return _with_lora_affinity(
            policy, pool, adapter, rotation=rotation, in_flight=in_flight, request_id=request_id, prefix=prefix,
            load_bound=load_bound, remembered=remembered, matches=matches,
        )  # fmt: skip
    if policy == LEAST_LOAD:
        return _least_load(pool, rotation, in_flight)
    if policy == POWER_OF_TWO:
        return _power_of_two(pool, rotation, in_flight, request_id)
    if policy == PREFIX_AFFINITY:
        return _prefix_affinity(pool, in_flight, prefix, load_bound, remembered)
    if policy == KV_AWARE:
        return _kv_aware(pool, in_flight, prefix, load_bound, remembered, matches)
    return _round_robin(pool, rotation, in_flight)


def lora_standing(node: NodeState, adapter: str) -> str:
    """LORA_RUNNING, LORA_LOADED or LORA_FULL: what the node's last scrape says of `adapter`."""
    load = node.load
    lora = load.lora
    if not load.known or lora is None:
        return LORA_LOADED
    if adapter in lora.running:
        return LORA_RUNNING
    if lora.max_lora and len(lora.running) >= lora.max_lora and any(name != adapter for name in lora.waiting):
        return LORA_FULL
    return LORA_LOADED


def _with_lora_affinity(policy: Policy, pool: Sequence[NodeState], adapter: str, **inputs) -> Choice:
    """The policy's choice among the candidates of the best standing; the candidates of each
    other standing follow, as the policy orders them, noted LORA_AVOIDED."""
    standings = {node.ip: lora_standing(node, adapter) for node in pool}
    tiers = [[node for node in pool if standings[node.ip] == standing] for standing in LORA_STANDINGS]
    choice = _in_tiers(policy, tiers, LORA_AVOIDED, inputs)
    candidates = tuple(msgspec.structs.replace(c, lora=standings[c.node]) for c in choice.candidates)
    return choice._replace(candidates=candidates)


def _in_tiers(policy: Policy, tiers: list[list[NodeState]], note: str, inputs: dict) -> Choice:
    """The policy's choice (with `inputs`) in the first tier that has candidates; those of the
    later tiers follow, as the policy orders each, passed over with `note`."""
    choices = [choose(policy, tier, **inputs) for tier in tiers if tier]
    best = choices[0]
    candidates = list(best.candidates)
    for passed_over in choices[1:]:
        candidates += [msgspec.structs.replace(c, note=c.note or note) for c in passed_over.candidates]
    return best._replace(candidates=tuple(candidates))


def node_loads(pool: Sequence[NodeState], in_flight: Mapping[str, int]) -> list[float]:
    """Each candidate's load: in flight here plus running and waiting there (unknown: the mean
    of the known ones' running and waiting, 0 when none is known)."""
    known = [node.load.queued for node in pool if node.load.known]
    unknown_as = sum(known) / len(known) if known else 0.0
    return [in_flight.get(node.ip, 0) + (node.load.queued if node.load.known else unknown_as) for node in pool]


def _turns(pool: Sequence[NodeState], rotation: int) -> list[int]:
    """How many round-robin turns away each candidate is (0: the one whose turn it is)."""
    size = len(pool)
    start = rotation % size
    return [(index - start) % size for index in range(size)]


def _scored(node: NodeState, score: float, in_flight: Mapping[str, int], note: str = "") -> CandidateScore:
    load = node.load
    return CandidateScore(
        node=node.ip,
        score=score,
        in_flight=in_flight.get(node.ip, 0),
        running=load.running if load.known else None,
        waiting=load.waiting if load.known else None,
        kv_cache_usage=load.kv_cache_usage if load.known else None,
        seconds_per_token=load.seconds_per_token,
        note=note,
    )


def _ranked(
    pool: Sequence[NodeState], order: list[int], scores: list[float], in_flight: Mapping[str, int], notes=None
) -> Choice:
    """The choice of `pool[order[0]]`, candidates listed in `order`."""
    notes = notes or {}
    candidates = tuple(_scored(pool[i], scores[i], in_flight, notes.get(i, "")) for i in order)
    margin = candidates[1].score - candidates[0].score if len(candidates) > 1 else None
    return Choice(pool[order[0]], candidates, margin)


def _round_robin(pool: Sequence[NodeState], rotation: int, in_flight: Mapping[str, int]) -> Choice:
    turns = _turns(pool, rotation)
    order = sorted(range(len(pool)), key=turns.__getitem__)
    return _ranked(pool, order, [float(turn) for turn in turns], in_flight)


def _least_load(pool: Sequence[NodeState], rotation: int, in_flight: Mapping[str, int]) -> Choice:
    loads = node_loads(pool, in_flight)
    turns = _turns(pool, rotation)
    order = sorted(range(len(pool)), key=lambda i: (loads[i], turns[i]))
    return _ranked(pool, order, loads, in_flight)


def _power_of_two(pool: Sequence[NodeState], rotation: int, in_flight: Mapping[str, int], request_id: str) -> Choice:
    loads = node_loads(pool, in_flight)
    if len(pool) < 2:
        return _ranked(pool, [0], loads, in_flight)
    seed = int.from_bytes(hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).digest()[:8], "big")
    first, second = random.Random(seed).sample(range(len(pool)), 2)
    drawn = [second, first] if loads[second] < loads[first] else [first, second]
    turns = _turns(pool, rotation)
    rest = sorted((i for i in range(len(pool)) if i not in drawn), key=lambda i: (loads[i], turns[i]))
    return _ranked(pool, drawn + rest, loads, in_flight, dict.fromkeys(rest, NOT_DRAWN))


def _prefix_affinity(
    pool: Sequence[NodeState], in_flight: Mapping[str, int], prefix: str, load_bound: float, remembered: str
) -> Choice:
    order, first = _prefix_order(pool, prefix, remembered)
    loads = node_loads(pool, in_flight)
    over = _over_load_bound(pool, loads, load_bound, order)
    ranks = [0.0] * len(pool)
    for rank, index in enumerate(order):
        ranks[index] = float(rank)
    chosen = [i for i in order if i not in over]
    passed_over = [i for i in order if i in over]
    choice = _ranked(pool, chosen + passed_over, ranks, in_flight, dict.fromkeys(passed_over, OVER_LOAD_BOUND))
    return choice._replace(remembered=remembered if first is not None else "")


def _prefix_order(pool: Sequence[NodeState], prefix: str, remembered: str) -> tuple[list[int], int | None]:
    """The candidates in the prefix's order (rendezvous hashing, the `remembered` node first),
    and the remembered node's index (None: not in the pool)."""
    order = sorted(range(len(pool)), key=lambda i: _rendezvous_weight(prefix, pool[i].ip), reverse=True)
    first = next((i for i in order if pool[i].ip == remembered), None)
    if first is not None:
        order.remove(first)
        order.insert(0, first)
    return order, first


def _over_load_bound(
    pool: Sequence[NodeState], loads: list[float], load_bound: float, order: list[int], slack: int = 0
) -> set[int]:
    """The candidates whose work, with this request, is above `load_bound` times the pool's mean
    by more than `slack` requests (see the module's doc); never all of them."""
    costs = _costs(pool)
    work = sum(load * cost for load, cost in zip(loads, costs))
    # The most requests each node may hold, this one included, for its work to stay within the bound.
    allowed = [math.ceil(load_bound * (work + cost) / len(pool) / cost) for cost in costs]
    over = {i for i in order if loads[i] + 1 > allowed[i] + slack}
    if len(over) == len(order):  # loads in fractions can leave none under
        over.discard(min(order, key=lambda i: (loads[i] + 1) * costs[i]))
    return over


def _kv_aware(
    pool: Sequence[NodeState],
    in_flight: Mapping[str, int],
    prefix: str,
    load_bound: float,
    remembered: str,
    matches: Mapping[str, KvBlocks],
) -> Choice:
    """See the module's doc: the share of the prompt's blocks a node lacks plus its share of the
    pool's work, within prefix affinity's load bound and its slack; prefix affinity's guess for a
    node whose events are not flowing, and prefix affinity's choice when no node's are."""
    held = [matches.get(node.ip) for node in pool]
    flowing = [match is not None and match.flowing for match in held]
    if not any(flowing):
        choice = _prefix_affinity(pool, in_flight, prefix, load_bound, remembered)
        return choice._replace(candidates=tuple(_kv_scored(c, matches.get(c.node), True) for c in choice.candidates))
    order, first = _prefix_order(pool, prefix, remembered)
    affine = order[0]
    lacked = [
        (1.0 - match.matched / match.total if match.total else 1.0) if flowing[i] else (0.0 if i == affine else 1.0)
        for i, match in enumerate(held)
    ]
    loads = node_loads(pool, in_flight)
    costs = _costs(pool)
    work = sum(load * cost for load, cost in zip(loads, costs))
    scores = [lacked[i] + (loads[i] + 1) * costs[i] / (work + costs[i]) for i in range(len(pool))]
    ranked = sorted(order, key=lambda i: scores[i])  # ties in the prefix's order
    over = _over_load_bound(pool, loads, load_bound, ranked, KV_BOUND_SLACK)
    chosen = [i for i in ranked if i not in over]
    passed_over = [i for i in ranked if i in over]
    choice = _ranked(pool, chosen + passed_over, scores, in_flight, dict.fromkeys(passed_over, OVER_LOAD_BOUND))
    fell_back = {pool[i].ip for i in range(len(pool)) if not flowing[i]}
    candidates = tuple(_kv_scored(c, matches.get(c.node), c.node in fell_back) for c in choice.candidates)
    return choice._replace(candidates=candidates, remembered=remembered if first is not None else "")


def _kv_scored(candidate: CandidateScore, match: KvBlocks | None, fallback: bool) -> CandidateScore:
    return msgspec.structs.replace(candidate, kv=match, fallback=fallback)


def _costs(pool: Sequence[NodeState]) -> list[float]:
    """Each candidate's time between tokens over the fastest candidate's (see the module's doc);
    a time of 0 counts as unknown (the simulated nodes' default: no time between tokens)."""
    known = [node.load.seconds_per_token for node in pool if node.load.seconds_per_token]
    if not known:
        return [1.0] * len(pool)
    fastest = min(known)
    unknown_as = sum(known) / len(known) / fastest
    return [node.load.seconds_per_token / fastest if node.load.seconds_per_token else unknown_as for node in pool]


def _rendezvous_weight(prefix: str, ip: str) -> int:
    digest = hashlib.blake2b(f"{prefix}\0{ip}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")

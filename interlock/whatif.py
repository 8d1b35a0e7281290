"""`interlock whatif`: a recorded run's requests routed again, under another policy, offline.

Each decision record names the snapshot it was routed on (its seq). The event log is folded
through the reducer once, in order, and each request (ordered by seq, then arrival) is routed
again on the state at its seq: the pool routing gives (`controlplane.rules.routing.pick_pool`, the
data plane's function: ring, model list, dead or offline at the request's arrival, healthy before
degraded) and the policy's choice (`controlplane.rules.balancer.Balancer`, the data plane's picker). Only the
first pick is routed again: whether a retry would have happened elsewhere is not in the log. A
prefill/decode-disaggregated request has a first pick in each leg (`legs_of`), each routed again
from its leg's candidates by a picker of its own, as the data plane has; only the decode leg's
is counted in flight (a prefill is one token).

`--policy recorded` routes each request under the policy it was routed by, with the inputs its
record holds (the round-robin counter, this process's in-flight counts, the request id, the
prompt prefix's hash, the node the prefix last went to): with the same code, every choice is the
recorded one, and a change is a change of the code.

Under another policy the inputs are the what-if world's own, per routing process (a replica's
worker: each counts its own): the requests it routed that were still in flight, and prefix
affinity's memory of where each prefix last went. A node's scraped load is corrected the same
way: at the scrape's moment, the gateway's recorded requests on the node are taken out and the
what-if world's put in; the rest (other clients') stays as scraped. A request moved to another node is counted in flight
there for its recorded duration scaled by the two nodes' times between tokens (as last scraped;
as recorded when either is unknown). Its time in the first node's queue is scaled too, and a
request left where it was keeps its recorded duration: what-if queues are not simulated, so a
what-if that relieves a crowded node still over-estimates the load it moves.

`--policy kv_aware` takes each candidate's KV match as its record kept it (the prompt's blocks
the node held when the request was routed): what the what-if world's own picks would have put in
the nodes' caches is not in the log. A record that kept no match (routed by another policy, or
without kv_events or a tokenizer) is routed as kv_aware routes a prompt it has no match for, as
prefix affinity would, and the report counts those (`kv_unmatched`).

For every request with a prompt prefix the report also says whether the node it went to had seen
that prefix among its last `cache_entries` prefixes: a stand-in for a prefix-cache hit.

Each request routed again walks its ring's nodes, so the work grows with requests times nodes:
a long run of a large cluster (or a forged checkpoint of many nodes) takes minutes. Rather than
refuse such a log, `what_if` says how far it has come (`progress`), every `progress_every`
seconds once it has run that long.
"""

from __future__ import annotations

import heapq
import os
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

import msgspec

from controlplane.rules.balancer import Balancer
from controlplane.rules.policies import KV_AWARE, Choice
from controlplane.rules.reducer import INITIAL_STATE
from controlplane.effects.replay import replay_steps
from controlplane.rules.routing import DECODE, PREFILL, Route, pick_pool
from controlplane.rules.saturation import priority_headroom, room, scraped_reason
from dataplane.disaggregation import GENERATION_PATHS
from events.config import DEFAULT_LOAD_BOUND, POLICIES
from events.decisions import AttemptOutcome, Decision, KvBlocks
from events.state import ClusterState, NodeState
from events.types import Event
from interlock.render import format_table

RECORDED = "recorded"
"""Route each request under the policy its record names, with the record's own inputs."""
CONFIGURED = "configured"
"""Route each request under the policy the config in force names for its model (a what-if
config's, `rewrite`), with the record's own inputs."""
WHAT_IF_POLICIES = (RECORDED, *POLICIES)
DEFAULT_CACHE_ENTRIES = 256
PROGRESS_SECONDS = 5.0
"""How often a long what-if says how far it has come (the first time after this long)."""
IN_FLIGHT_SLACK_SECONDS = 10.0
"""How long a routed request is remembered after it ended, for the load scraped before a later
request arrived (a scrape's moment lies at most a scrape interval back)."""


MOVED_SHOWN = 20
"""Requests whose pick changes named in the report; the rest are counted."""


class Moved(msgspec.Struct, frozen=True):
    """A request the what-if sends elsewhere."""

    request_id: str
    recorded: str
    routed_again: str
    margin: float | None
    """How much better the what-if policy scores its pick than the recorded node (its score's
    lead, lower is better); None when the recorded node is not among its candidates."""
    leg: str = ""
    """The leg of a disaggregated request whose pick changes (`routing.PREFILL`, `DECODE`); "" for a whole one."""


class WhatIfReport(msgspec.Struct, kw_only=True):
    policy: str
    decisions: int
    """Records in the span considered."""
    routed_again: int
    """First picks routed again (both the recording and the what-if have one): one per record,
    two for a disaggregated one (a pick per leg)."""
    changed: int
    """Of those, picks that went to another node."""
    agreement: float | None
    """The share of picks routed again to the recorded node, in per cent (None: none routed again)."""
    moved: list[Moved]
    """The first MOVED_SHOWN requests whose pick changed."""
    became_503: int
    """Requests that got a node, whose pool is empty when routed again (only a change of the
    routing code, of its reading of the log, or of the config (`rewrite`) can do this: a policy
    only chooses within the pool)."""
    stopped_503: int
    """Requests refused for want of a node, that have a node when routed again."""
    beyond_log: int
    """Records whose seq the event log does not reach (it ends too early, or is another run's)."""
    unpicked: dict[str, int]
    """Records with no node picked when recorded (refused, or no node in the pool), by status
    ("none": the client left), but for the `stopped_503` ones."""
    nodes: dict[str, str]
    """Each node's name (its IP when it has none), by IP."""
    before: dict[str, int]
    """First picks per node, as recorded."""
    after: dict[str, int]
    """First picks per node, routed again."""
    prefixed: int
    """Requests with a prompt prefix recorded (and a pick both times)."""
    prefix_seen_before: int
    prefix_seen_after: int
    """Of those, the requests whose node had seen their prefix among its last `cache_entries`."""
    cache_entries: int
    share_delta: dict[str, float]
    kv_unmatched: int = 0
    """`--policy kv_aware`: picks whose record kept no KV match (routed by another policy, or
    without kv_events or a tokenizer): kv_aware chose for them as prefix affinity would."""
    """Each node's share of the picks routed again minus its recorded share, in percentage points."""


def what_if(
    event_logs: Iterable[str | os.PathLike],
    decisions: Iterable[Decision],
    *,
    policy: str = RECORDED,
    since: float | None = None,
    until: float | None = None,
    cache_entries: int = DEFAULT_CACHE_ENTRIES,
    warn: Callable[[str], None] | None = None,
    skip_invalid: Callable[[str], None] | None = None,
    progress: Callable[[str], None] | None = None,
    progress_every: float = PROGRESS_SECONDS,
    rewrite: Callable[[Iterator[Event]], Iterator[Event]] | None = None,
    each: Callable[[Decision, str | None], None] | None = None,
) -> WhatIfReport:
    """Route the recorded requests arriving in [since, until] again under `policy` (a name of
    POLICIES, RECORDED or CONFIGURED) on the states of `event_logs` (their events rewritten by
    `rewrite`: `replay_steps`); never contacts a node. `each` is told every request that had a
    node, with the node it is routed to again (None: no node). How far it has come goes to
    `progress` every `progress_every` seconds (module docstring)."""
    chosen = in_span(decisions, since, until)
    states = States(
        replay_steps(event_logs, warn=warn, skip_invalid=skip_invalid, rewrite=rewrite),
        _Progress(progress, progress_every, len(chosen)) if progress is not None else None,
    )
    in_flight, recorded_in_flight = _InFlight(), _InFlight()
    load_changes: dict[tuple[str, float], int] = {}
    balancers: defaultdict[tuple[Process, bool], Balancer] = defaultdict(Balancer)
    """The data plane's picker per routing process (and a second one for its prefill legs, as
    the data plane has): its memory of where each prefix went is the what-if world's."""
    seen_before, seen_after = _RecentPrefixes(cache_entries), _RecentPrefixes(cache_entries)
    before: Counter[str] = Counter()
    after: Counter[str] = Counter()
    report = WhatIfReport(
        policy=policy, decisions=len(chosen), routed_again=0, changed=0, agreement=None, moved=[], became_503=0,
        stopped_503=0, beyond_log=0, unpicked={}, nodes={}, before={}, after={}, prefixed=0, prefix_seen_before=0,
        prefix_seen_after=0, cache_entries=cache_entries, share_delta={},
    )  # fmt: skip
    for decision in chosen:
        state = states.at(decision.seq)
        if state is None:
            report.beyond_log += 1
            continue
        for leg in legs_of(decision, Route(state, decision.model)):
            made = leg.decision
            recorded_node = first_pick(made)
            pool = pick_pool(leg.candidates, made.at)
            if not pool:
                report.became_503 += recorded_node is not None
                if recorded_node is None:
                    _count_unpicked(report, made)
                if each is not None and recorded_node is not None:
                    each(made, None)
                break
            if recorded_node is None:
                if made.status == 503 and not made.attempts:
                    report.stopped_503 += 1
                else:
                    _count_unpicked(report, made)
                break
            process = process_of(made)
            balancer = balancers[process, leg.name == PREFILL]
            if policy in (RECORDED, CONFIGURED):
                configured = state.config.model_policy(made.model) if policy == CONFIGURED and state.config else None
                choice = recorded_choice(balancer, made, pool, state, policy=configured, adapter=leg.adapter)
            else:
                what_if_pool = [_with_what_if_load(node, recorded_in_flight, in_flight, load_changes) for node in pool]
                what_if_in_flight = in_flight.of_process(process, made.at)
                choice = balancer.choose(
                    what_if_pool,
                    policy,
                    rotation=made.rotation,
                    in_flight=what_if_in_flight,
                    request_id=made.request_id,
                    prefix=made.prefix,
                    load_bound=_load_bound(state),
                    adapter=leg.adapter,
                    full=_full(state, made, what_if_pool, what_if_in_flight),
                    matches=recorded_matches(made),
                )  # remembered: the what-if world's memory
                if policy == KV_AWARE and not any(candidate.kv is not None for candidate in made.candidates):
                    report.kv_unmatched += 1
            node = choice.node.ip
            if each is not None:
                each(made, node)
            if leg.name != PREFILL:  # a prefill is one token: counted in flight, it would weigh as a whole request
                duration = _moved_duration(made.duration, state, recorded_node, node)
                in_flight.add(process, made.at, duration, node)
                recorded_in_flight.add(process, made.at, made.duration, recorded_node)
            report.routed_again += 1
            if node != recorded_node:
                report.changed += 1
                if len(report.moved) < MOVED_SHOWN:
                    lead = _lead(choice, recorded_node)
                    report.moved.append(Moved(made.request_id, recorded_node, node, lead, leg.name))
            before[recorded_node] += 1
            after[node] += 1
            for ip in (recorded_node, node):
                known = state.nodes.get(ip)
                report.nodes[ip] = (known.name if known else "") or ip
            if made.prefix:
                report.prefixed += 1
                report.prefix_seen_before += seen_before.saw(recorded_node, made.prefix)
                report.prefix_seen_after += seen_after.saw(node, made.prefix)
    report.before, report.after = dict(sorted(before.items())), dict(sorted(after.items()))
    routed = report.routed_again
    if routed:
        report.agreement = 100 * (routed - report.changed) / routed
        report.share_delta = {ip: 100 * (after[ip] - before[ip]) / routed for ip in sorted(report.nodes)}
    return report


def _count_unpicked(report: WhatIfReport, made: Decision) -> None:
    status = "none" if made.status is None else str(made.status)
    report.unpicked[status] = report.unpicked.get(status, 0) + 1


def _lead(choice: Choice, recorded: str) -> float | None:
    """The chosen candidate's score lead over `recorded` (None: not a candidate)."""
    score = next((candidate.score for candidate in choice.candidates if candidate.node == recorded), None)
    return None if score is None else score - choice.candidates[0].score


Process = tuple[str, int]
"""A routing process: (replica, worker). Its round-robin counter, in-flight counts and prefix
memory are its own."""


def process_of(decision: Decision) -> Process:
    return decision.replica, decision.worker


def in_span(decisions: Iterable[Decision], since: float | None, until: float | None) -> list[Decision]:
    """The records arriving in [since, until], in the order they are routed again: by seq, then arrival."""
    return sorted(
        (d for d in decisions if (since is None or d.at >= since) and (until is None or d.at <= until)),
        key=lambda decision: (decision.seq, decision.at),
    )


def recorded_choice(
    balancer: Balancer,
    decision: Decision,
    pool: list[NodeState],
    state: ClusterState,
    policy: str | None = None,
    adapter: str = "",
) -> Choice:
    """The first pick of `decision` made again from `pool` (not empty) by the data plane's
    picker, under `policy` (None: the one the record names) and with the inputs the record holds
    (round-robin counter, its process's in-flight counts, request id, prompt prefix, remembered
    node, the prompt's blocks each candidate held), with a LoRA `adapter`'s affinity
    (`Route.adapter`), passing over the nodes without room for it (`recorded_full`)."""
    return balancer.choose(
        pool,
        policy or decision.policy,
        rotation=decision.rotation,
        in_flight={candidate.node: candidate.in_flight for candidate in decision.candidates if candidate.in_flight},
        request_id=decision.request_id,
        prefix=decision.prefix,
        load_bound=_load_bound(state),
        remembered=decision.remembered,
        adapter=adapter,
        full=recorded_full(decision, pool, state),
        matches=recorded_matches(decision),
    )


def recorded_matches(decision: Decision) -> dict[str, KvBlocks]:
    """The prompt's blocks each candidate held, as the record kept them (`kv_aware`'s input)."""
    return {candidate.node: candidate.kv for candidate in decision.candidates if candidate.kv is not None}


def recorded_full(decision: Decision, pool: list[NodeState], state: ClusterState) -> set[str]:
    """The nodes of `pool` the first pick of `decision` found without room (`saturation.room`),
    made again where the log holds the rule's inputs: the node's `max_in_flight` less the
    headroom of the record's priority, against its recorded in-flight count, and its scrape at
    the record's seq. What the log does not hold, the lower ranks a priority-scheduled node would
    preempt and the in-flight count when a saturating scrape was first seen, is the record's
    answer (`CandidateScore.full`) when the rest leaves it open."""
    config = state.config
    recorded = {candidate.node: candidate for candidate in decision.candidates}
    if config is None:
        return {ip for ip, candidate in recorded.items() if candidate.full}
    limits = {node.ip: node.max_in_flight for node in config.nodes if node.max_in_flight is not None}
    scheduled = {node.ip for node in config.nodes if node.scheduling == "priority"}
    admission = config.admission
    headroom = priority_headroom(config, decision.admission.priority) if decision.admission else 0
    full = set()
    for node in pool:
        candidate = recorded.get(node.ip)
        limit = limits.get(node.ip)
        bound = room(node, None, limit, candidate.in_flight if candidate else 0, None, headroom)
        saturated = admission.queue and bool(scraped_reason(node, admission))
        if node.ip in scheduled and limit is not None or saturated and bound >= 1:
            if candidate is not None and candidate.full:
                full.add(node.ip)
        elif bound < 1 and (node.ip not in scheduled or limit is None):
            full.add(node.ip)
    return full


def _load_bound(state: ClusterState) -> float:
    return state.config.routing.load_bound if state.config else DEFAULT_LOAD_BOUND


def _full(state: ClusterState, decision: Decision, pool: list[NodeState], in_flight: dict[str, int]) -> set[str]:
    """The nodes of `pool` the one rule for a node's room (`saturation.room`) finds without a
    place for `decision`'s request in the what-if world: its in-flight counts and loads, the
    places the request's priority leaves free (the requests a priority node would have preempted
    are not in the log)."""
    config = state.config
    if config is None:
        return set()
    limits = {node.ip: node.max_in_flight for node in config.nodes if node.max_in_flight is not None}
    scrape = config.admission if config.admission.queue else None
    if not limits and scrape is None:
        return set()
    headroom = priority_headroom(config, decision.admission.priority) if decision.admission else 0
    return {
        node.ip for node in pool if room(node, scrape, limits.get(node.ip), in_flight.get(node.ip, 0), None, headroom) < 1
    }


class Leg(NamedTuple):
    """One pick of a record to make again: the leg's name ("" for a whole request), the record
    as that leg's (`Decision.prefill_leg`), and the candidates the leg picks from."""

    name: str
    decision: Decision
    candidates: list[NodeState]
    adapter: str
    """The LoRA adapter whose affinity the pick follows (`Route.adapter`)."""


def legs_of(decision: Decision, route: Route) -> list[Leg]:
    """The picks `decision` holds, split as the data plane splits the request on the same state
    (`Route.legs`, GENERATION_PATHS): a whole request's one; a disaggregated one's prefill leg,
    then, when the prefill answered (its last attempt completed with 200), the decode leg."""
    if route.legs is None or decision.path not in GENERATION_PATHS:
        return [Leg("", decision, route.candidates, route.adapter)]
    prefill, decode = route.legs
    legs = [Leg(PREFILL, decision.prefill_leg(), prefill if decode else [], route.adapter)]  # no decode node: no pick
    last = decision.prefill_attempts[-1] if decision.prefill_attempts else None
    if last is not None and last.outcome == AttemptOutcome.COMPLETED and last.status == 200:
        legs.append(Leg(DECODE, decision, decode, route.adapter))
    return legs


def first_pick(decision: Decision) -> str | None:
    """The node the request's policy chose first, as recorded; None when none was chosen."""
    if decision.candidates:
        return decision.candidates[0].node
    return decision.attempts[0].node if decision.attempts else None


def _moved_duration(duration: float, state: ClusterState, recorded: str, node: str) -> float:
    """How long the request would have taken on `node` rather than `recorded`: its recorded
    duration scaled by the two nodes' times between tokens when both are known, else as recorded."""
    if node == recorded:
        return duration
    recorded_speed = state.nodes[recorded].load.seconds_per_token if recorded in state.nodes else None
    speed = state.nodes[node].load.seconds_per_token if node in state.nodes else None
    return duration * speed / recorded_speed if speed and recorded_speed else duration


def _with_what_if_load(
    node: NodeState, recorded: _InFlight, what_if: _InFlight, changes: dict[tuple[str, float], int]
) -> NodeState:
    """`node` with its scraped load as the what-if world's requests would have made it. The
    change is computed once per scrape (`changes`): every request that had arrived by the
    scrape's moment has been routed by the first request that reads it."""
    load = node.load
    if not load.known or load.scraped_at is None:
        return node
    key = (node.ip, load.scraped_at)
    change = changes.get(key)
    if change is None:
        change = changes[key] = what_if.on_node(node.ip, key[1]) - recorded.on_node(node.ip, key[1])
    if not change:
        return node
    queued = max(0.0, load.queued + change)
    waiting = min(load.waiting, queued)
    return msgspec.structs.replace(node, load=msgspec.structs.replace(load, running=queued - waiting, waiting=waiting))


class States:
    """The states of an event log, folded once, in order: `at(seq)` is the state after the last
    event numbered `seq` or below (None when the log ends before `seq`)."""

    def __init__(self, steps: Iterator, progress: _Progress | None = None) -> None:
        self._steps = steps
        self._progress = progress
        self.state: ClusterState = INITIAL_STATE
        """The state after the last event folded so far."""
        self._next: ClusterState | None = None
        self._ended = False
        self.asked = 0
        """How many times `at` was asked (once per request)."""

    def at(self, seq: int) -> ClusterState | None:
        self.asked += 1
        while True:
            if self._progress is not None:
                self._progress.tick(self)
            upcoming = self._peek()
            if upcoming is None or upcoming.seq > seq:
                break
            self.state, self._next = upcoming, None
        return self.state if self.state.seq >= seq else None

    def following_at(self) -> float | None:
        """The time of the event after the state `at` returned last (None: the log ends there)."""
        upcoming = self._peek()
        return upcoming.at if upcoming is not None else None

    def _peek(self) -> ClusterState | None:
        if self._next is None and not self._ended:
            step = next(self._steps, None)
            if step is None:
                self._ended = True
            else:
                self._next = step[1]
        return self._next


class _Progress:
    """Says how far a what-if has come, at most once every `every` seconds (0: at every tick)."""

    def __init__(self, say: Callable[[str], None], every: float, requests: int) -> None:
        self._say, self._every, self._requests = say, every, requests
        self._next = time.monotonic() + every

    def tick(self, states: States) -> None:
        """Called at every event folded and every request."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self._every
        state = states.state
        self._say(
            f"request {states.asked} of {self._requests}, event log read to seq {state.seq} "
            f"(a state of {len(state.nodes)} nodes)"
        )


class _InFlight:
    """Requests routed, as (arrival, end, node): those in flight at a moment, per routing process
    (each counts its own) and in all."""

    def __init__(self) -> None:
        self._ends: dict[Process, list[tuple[float, str]]] = {}
        self._counts: dict[Process, Counter[str]] = {}
        self._recent: list[tuple[float, float, str]] = []
        self._prune_at = 64

    def add(self, process: Process, at: float, duration: float, node: str) -> None:
        heapq.heappush(self._ends.setdefault(process, []), (at + duration, node))
        self._counts.setdefault(process, Counter())[node] += 1
        self._recent.append((at, at + duration, node))
        if len(self._recent) >= self._prune_at:  # amortized: the list at most doubles between prunings
            self._recent = [entry for entry in self._recent if entry[1] > at - IN_FLIGHT_SLACK_SECONDS]
            self._prune_at = 2 * len(self._recent) + 64

    def of_process(self, process: Process, moment: float) -> dict[str, int]:
        """The process's requests in flight per node at `moment` (moments must not step back)."""
        ends, counts = self._ends.get(process, []), self._counts.get(process, Counter())
        while ends and ends[0][0] <= moment:
            _, node = heapq.heappop(ends)
            counts[node] -= 1
        return {node: count for node, count in counts.items() if count}

    def on_node(self, node: str, moment: float) -> int:
        """Every worker's requests in flight on `node` at `moment`, which may lie up to
        IN_FLIGHT_SLACK_SECONDS before the latest arrival (a scrape's moment)."""
        return sum(1 for start, end, routed in self._recent if routed == node and start <= moment < end)


class _RecentPrefixes:
    """Each node's last `size` prompt prefixes (an LRU, as a prefix cache keeps them)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._by_node: dict[str, OrderedDict[str, None]] = {}

    def saw(self, node: str, prefix: str) -> bool:
        """Whether `node` had seen `prefix` recently; it has now."""
        recent = self._by_node.setdefault(node, OrderedDict())
        seen = prefix in recent
        recent[prefix] = None
        recent.move_to_end(prefix)
        if len(recent) > self._size:
            recent.popitem(last=False)
        return seen


# --- text ------------------------------------------------------------------------------------


def render_report(report: WhatIfReport) -> str:
    routed = report.routed_again
    agreement = "-" if report.agreement is None else f"{report.agreement:.1f}%"
    lines = [
        f"{report.decisions} recorded requests, {routed} routed again under "
        + _POLICY_TEXTS.get(report.policy, report.policy)
        + " (open-loop: later load is as recorded, not as the new picks would have made it)",
        f"agreement {agreement}: {report.changed} would have gone to another node ({_share(report.changed, routed)})",
        f"{report.became_503} would have become 503, {report.stopped_503} would have stopped being 503",
    ]
    if report.beyond_log:
        lines.append(f"{report.beyond_log} not routed again: the event log does not hold their snapshot")
    if report.kv_unmatched:
        lines.append(
            f"{report.kv_unmatched} of {routed} picks routed again without a KV match: their records kept none "
            "(routed by another policy, or without kv_events or a tokenizer), so kv_aware chose as prefix_affinity "
            "would for them"
        )
    if report.unpicked:
        statuses = ", ".join(f"{count} answered {status}" for status, count in sorted(report.unpicked.items()))
        lines.append(
            f"{sum(report.unpicked.values())} not routed again: no node was picked for them when recorded"
            f" ({statuses.replace('answered none', 'whose client left')})"
        )
    lines.append("")
    rows = [
        [report.nodes.get(ip, ip), ip, f"{report.before.get(ip, 0)} ({_share(report.before.get(ip, 0), routed)})",
         f"{report.after.get(ip, 0)} ({_share(report.after.get(ip, 0), routed)})",
         f"{report.share_delta.get(ip, 0.0):+.1f}"]
        for ip in sorted(report.nodes)
    ]  # fmt: skip
    headers = ["NODE", "IP", "RECORDED", "ROUTED AGAIN", "SHARE Δ (POINTS)"]
    lines += format_table(headers, rows) if rows else ["no request routed again"]
    if report.moved:
        lines += ["", f"requests whose pick changes (the first {len(report.moved)} of {report.changed}):", ""]
        lines += format_table(
            ["REQUEST ID", "RECORDED", "ROUTED AGAIN", "MARGIN"],
            [
                [_leg_named(moved), moved.recorded, moved.routed_again, _margin(moved.margin)]
                for moved in report.moved
            ],
        )
    if report.prefixed:
        lines += [
            "",
            f"prompt prefix seen by the node among its last {report.cache_entries}: recorded"
            f" {_share(report.prefix_seen_before, report.prefixed)}, routed again"
            f" {_share(report.prefix_seen_after, report.prefixed)} (of {report.prefixed} requests with a prefix)",
        ]
    return "\n".join(lines)


_POLICY_TEXTS = {
    RECORDED: "the policy each was routed by",
    CONFIGURED: "the policy the config in force names for its model",
}


def _leg_named(moved: Moved) -> str:
    """The request's id, and the leg whose pick changes when it is a disaggregated request's."""
    return f"{moved.request_id} ({moved.leg})" if moved.leg else moved.request_id


def _margin(margin: float | None) -> str:
    return "-" if margin is None else f"{margin:g}"


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"

"""One request's bookkeeping, in one place: what each ended attempt leaves behind, and what the
request's end does.

A `Ledger` is one request's state on the snapshot it is routed on, opened by the planning stage
(`dataplane.planning`): the request as it came (`Exchange`), its admission (`Ticket`), its route,
policy, prompt prefix and, under `kv_aware`, the prompt's blocks each candidate holds, its picks
and attempts. `attempt_ended` is the one place that records how an attempt ended (its log line, its metrics, what the control plane learns about the node,
the in-flight counts, the decision record's entry); `request_ended` (or `client_left`), called by
the finish stage or by a committed body's relay, the request's one end: its duration and status
in the metrics, its admission settled, its decision record. Where all of it goes (metrics, log,
in-flight counts, control plane, decision log) is the process's `Books`, shared by every request.
"""

from __future__ import annotations

import time

from controlplane.infrastructure.logs import JsonLog
from controlplane.rules.policies import Choice
from controlplane.rules.routing import DECODE, PREFILL, Route
from dataplane.admission.occupancy import Occupancy
from dataplane.admission.queue import AdmissionQueue
from dataplane.admission.ticket import Ticket
from dataplane.control import ControlPlaneView
from dataplane.decisions import DecisionRecorder
from dataplane.disaggregation import GENERATION_PATHS
from dataplane.exchange import Exchange, Outcome, UpstreamTimeout
from dataplane.metrics import RequestMetrics
from dataplane.views import SnapshotView
from events.config import Policy
from events.decisions import AttemptOutcome, AttemptRecord, Decision, Exclusion, KvBlocks, LegPick
from events.types import UpstreamFailed, UpstreamRecovered
from transport.http11 import WriteFailed

COMPLETED, TRUNCATED, RETRIED, FAILED, CLIENT_GONE = (
    AttemptOutcome.COMPLETED,
    AttemptOutcome.TRUNCATED,
    AttemptOutcome.RETRIED,
    AttemptOutcome.FAILED,
    AttemptOutcome.CLIENT_GONE,
)


class Books:
    """Where every request's bookkeeping goes, one per process."""

    __slots__ = ("control_plane", "metrics", "log", "occupancy", "decisions", "queue")

    def __init__(
        self,
        control_plane: ControlPlaneView,
        metrics: RequestMetrics,
        log: JsonLog,
        occupancy: Occupancy,
        decisions: DecisionRecorder | None,
        queue: AdmissionQueue,
    ) -> None:
        self.control_plane = control_plane
        self.metrics = metrics
        self.log = log
        self.occupancy = occupancy
        """The attempts in flight, counted as they begin and end."""
        self.decisions = decisions
        self.queue = queue
        """The admission queue, told when an attempt begins and ends (a node may have room again)."""


class Ledger:
    """One request's bookkeeping: its routing (what its decision record says), its attempts as
    they end, and its end."""

    __slots__ = (
        "_books", "exchange", "view", "route", "policy", "prefix", "matches", "metric_model", "attempts", "passed",
        "first_choice", "rotation", "attempt_started", "leg", "prefill_attempts", "prefill_pick", "ticket", "ended",
    )  # fmt: skip

    def __init__(
        self,
        books: Books,
        exchange: Exchange,
        view: SnapshotView,
        route: Route,
        policy: Policy,
        prefix: str,
        ticket: Ticket,
    ) -> None:
        self._books = books
        self.ticket = ticket
        """Its admission (`dataplane.admission.ticket`): settled when the request ends."""
        self.exchange = exchange
        self.view = view
        """The snapshot it is routed on: its arrival's, or after a wait in the admission queue
        the one current when it left (a new ledger then)."""
        self.route = route
        self.policy = policy
        self.prefix = prefix
        """The prompt prefix's hash (`controlplane.rules.prefix`), when the policy or the decision log needs it."""
        self.matches: dict[str, KvBlocks] = {}
        """`kv_aware`: the prompt's blocks each candidate holds, by its KV events (`Planning.match`)."""
        self.metric_model = view.metric_model(exchange.model)
        self.attempts: list[AttemptRecord] = []
        self.passed: list[Exclusion] = []
        """The candidates the picks passed over (dead or offline when picked), once each."""
        self.first_choice: Choice | None = None
        """The first pick, with its candidates' scores when they were computed."""
        self.rotation = 0
        """The round-robin counter of the first pick."""
        self.attempt_started = exchange.started
        """When the attempt in progress began (attempts are made one after another)."""
        self.leg = PREFILL if route.legs is not None and exchange.path in GENERATION_PATHS else ""
        """The leg of a disaggregated request in progress (`routing.PREFILL`, then `DECODE`); "" for a whole one."""
        self.prefill_attempts: tuple[AttemptRecord, ...] = ()
        """A disaggregated request's prefill attempts, once its decode leg has begun."""
        self.prefill_pick: LegPick | None = None
        """Its prefill leg's first pick, once its decode leg has begun."""
        self.ended = False
        """The request has ended (`request_ended` or `client_left`): it ends once."""

    # --- picks

    def passed_over(self, ip: str, reason: str) -> None:
        for exclusion in self.passed:
            if exclusion.node == ip:
                return
        self.passed.append(Exclusion(ip, reason))

    def decode_began(self) -> None:
        """The prefill leg is done: its attempts are set aside, and the decode leg's first pick
        is the one the record scores (the client's answer comes from that leg)."""
        self.prefill_attempts = tuple(self.attempts)
        self.prefill_pick = _leg_pick(self.first_choice, self.rotation)
        self.attempts = []
        self.first_choice = None
        self.rotation = 0
        self.leg = DECODE

    def picked(self, choice: Choice, rotation: int) -> None:
        if self.first_choice is None:
            self.first_choice = choice
            self.rotation = rotation
        self._books.metrics.picked(self.policy)

    # --- attempts

    def attempt_began(self, ip: str) -> None:
        self.attempt_started = time.perf_counter()
        self._books.metrics.node_attempt_started(ip)
        ticket = self.ticket
        self._books.occupancy.attempt_started(ip, ticket.rank, ticket.priority, ticket.tenant.name)

    def committed(self, ip: str) -> None:
        """The node's answer is flowing to the client: the node answers (the attempt ends later)."""
        self._mark_online(ip)

    def attempt_ended(self, ip: str, outcome: Outcome) -> None:
        """What an ended attempt leaves behind: its log line, its metrics, what the control plane
        learns about the node, and its entry in the decision record."""
        books = self._books
        log, metrics = books.log, books.metrics
        kind = outcome.kind
        error = _describe(outcome.error)
        if kind == RETRIED:
            if self.exchange.stream:
                log.info("retrying after streaming failure before first chunk", node=ip, error=error)
            else:
                log.info("retrying after connection failure", node=ip, error=error)
            metrics.retried(ip)
            if not isinstance(outcome.error, UpstreamTimeout):  # a slow node is loaded, not down
                self._mark_offline(ip, error)
        elif kind == FAILED:
            log.error("node response truncated or connection lost", node=ip, error=error)
            if isinstance(outcome.error, WriteFailed):
                self._mark_offline(ip, error)  # a stale keep-alive reset while sending
        elif kind == COMPLETED and not outcome.committed:
            self._mark_online(ip)
        elif kind == TRUNCATED:
            metrics.truncated(ip)
            if self.exchange.stream:
                log.error("stream terminated by upstream failure", node=ip, error=error)
            else:
                log.error("response truncated after commit", node=ip, error=error)
        elif kind == CLIENT_GONE and outcome.committed:
            log.error("client write failed after commit", node=ip, error=error)
            metrics.client_write_failure(self.metric_model)
        metrics.node_attempt_ended(ip)
        queue = books.queue
        if queue.waiting:
            books.occupancy.note_scrape(ip)  # with the count the node's scrape may still show
        ticket = self.ticket
        books.occupancy.attempt_ended(ip, ticket.rank, ticket.priority, ticket.tenant.name)
        if queue.waiting:
            queue.freed()
        if self.leg:
            metrics.leg_attempt(self.leg, kind)
        if kind != CLIENT_GONE or outcome.committed:  # a client gone before commit is not counted (plinth)
            status = outcome.status or 502
            metrics.attempt(self.metric_model, status)
            metrics.node_attempt(ip, status, time.perf_counter() - self.attempt_started)
        self.attempts.append(AttemptRecord(ip, kind, outcome.status, error))

    # --- the request's end

    def request_ended(self, status: int) -> None:
        """The request's one duration and status in the metrics, its admission settled, and its
        decision record."""
        exchange = self.exchange
        self.ended = True
        self.ticket.end(status)
        self._books.metrics.request_done(
            self.metric_model, exchange.path, status, time.perf_counter() - exchange.started
        )
        self._record(status)

    def client_left(self) -> None:
        """The client went away before anything was sent: no answer, no metrics (plinth); the record says so."""
        self.ended = True
        self.ticket.end(None)
        self._record(None)

    def _record(self, status: int | None) -> None:
        decisions = self._books.decisions
        exchange = self.exchange
        if decisions is None or not self.view.config.decision_log:
            return
        route = self.route
        choice = self.first_choice
        prefill_pick = self.prefill_pick
        if self.leg == PREFILL:  # the request ended in its prefill leg: its first pick is that leg's
            choice, prefill_pick = None, _leg_pick(choice, self.rotation)
        decisions.record(
            Decision(
                request_id=exchange.request_id,
                at=exchange.at,
                path=exchange.path,
                model=exchange.model,
                alias=exchange.alias,
                stream=exchange.stream,
                seq=self.view.snapshot.seq,
                ring=route.ring,
                ring_pool=route.ring_pool,
                excluded=route.excluded + tuple(self.passed),
                attempts=() if self.leg == PREFILL else tuple(self.attempts),
                prefill_attempts=tuple(self.attempts) if self.leg == PREFILL else self.prefill_attempts,
                status=status,
                duration=time.perf_counter() - exchange.started,
                policy=self.policy,
                prefix=self.prefix,
                rotation=self.rotation if choice else 0,
                candidates=choice.candidates if choice else (),
                margin=choice.margin if choice else None,
                remembered=choice.remembered if choice else "",
                admission=self.ticket.record(),
                prefill_pick=prefill_pick,
            )
        )

    # --- what the control plane learns

    def _mark_offline(self, ip: str, error: str) -> None:
        """Tell the control plane, unless the current snapshot already has the node offline."""
        control_plane = self._books.control_plane
        now = control_plane.now()
        node = control_plane.snapshot.nodes.get(ip)
        if node is not None and not node.is_offline(now):
            control_plane.observe(UpstreamFailed(node=ip, error=error, at=now))

    def _mark_online(self, ip: str) -> None:
        """Tell the control plane the node answered, only if it is offline (not one event per request)."""
        control_plane = self._books.control_plane
        now = control_plane.now()
        node = control_plane.snapshot.nodes.get(ip)
        if node is not None and node.is_offline(now):
            control_plane.observe(UpstreamRecovered(node=ip, at=now))


def _leg_pick(choice: Choice | None, rotation: int) -> LegPick | None:
    if choice is None:
        return None
    return LegPick(rotation=rotation, candidates=choice.candidates, margin=choice.margin, remembered=choice.remembered)


def _describe(error: BaseException | str | None) -> str:
    if error is None or isinstance(error, str):
        return error or ""
    text = str(error)
    return text if text else type(error).__name__

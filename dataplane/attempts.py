"""The attempts stage of the request path (plinth §4.3 steps 4-7): one loop for every leg of a
plan (`planning.Plan`): pick a node among the leg's candidates not yet tried and neither dead nor
offline (`routing.pick_pool`, then the leg's balancer under the request's policy, passing over
the nodes without room for it, `Occupancy.full`), send the `Attempt` (`send`, the one function
for both legs), and either go on (a prefill's `kv_transfer_params` to the decode leg), answer the
client, or try the next node. Each attempt's end is written to the books in one place (the loop;
a committed body's `Relay` writes its own).

What may be retried is decided by whether anything reached the client yet (the commit gate):
a non-streaming response is buffered until it is complete (or larger than the buffer limit),
a stream is committed at its first body byte. Before commit, connection-level failures move on
to the next node; a node slower than the model's `first_byte_timeout` or `response_timeout` does
only under `retry_unanswered` (else a 504), and is not marked offline for it (slowness is load).
After commit the `Relay` ends the response. HTTP error statuses from a node
are responses: passed through, never retried (completions are not idempotent). A prefill leg's
every failure is retried on the next prefill node: nothing has reached the client, and a
prefill leaves nothing behind but KV blocks that the node frees when no decode fetches them.
Whatever an attempt raises (a node answer that breaks its parser, say) is a failure of that
attempt, under the same rules.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable

import msgspec
import trio

from controlplane.infrastructure.logs import JsonLog
from controlplane.rules.routing import PREFILL, pick_pool
from dataplane.admission.occupancy import Occupancy
from dataplane.control import ControlPlaneView
from dataplane.disaggregation import (
    MAX_PREFILL_ANSWER_BYTES,
    PrefillWithoutKvTransferParams,
    decode_body,
    kv_transfer_params,
    prefill_body,
)
from dataplane.endpoints import ROUTED_PATHS
from dataplane.errors import (
    NO_REACHABLE_NODE,
    PREFILL_WITHOUT_KV_TRANSFER_PARAMS,
    UPSTREAM_ERROR,
    UPSTREAM_TIMEOUT,
    Refusal,
    Reply,
    refusal,
)
from dataplane.exchange import Outcome, UpstreamTimeout
from dataplane.headers import client_headers
from dataplane.ledger import CLIENT_GONE, COMPLETED, FAILED, RETRIED, Ledger
from dataplane.metrics import RequestMetrics
from dataplane.planning import Leg, Plan
from dataplane.relay import Relay, ResponseBodyTimeout
from events.state import NodeState
from transport.http11 import ConnectFailed, HttpClient, LostBeforeResponse, WriteFailed
from transport.http11 import Response as UpstreamResponse

_TARGETS = {path: path.encode() for path in ROUTED_PATHS}

IDLE_CONNECTION_SECONDS = 90.0
MAX_IDLE_CONNECTIONS_PER_NODE = 64
"""plinth keeps 4: with more requests in flight to a node than that, connections would be closed
and dialled again all the time."""


def new_upstream_pool() -> HttpClient:
    """The connections to every node (`transport.http11`), kept alive 90 s when idle."""
    return HttpClient(max_idle_per_host=MAX_IDLE_CONNECTIONS_PER_NODE, idle_seconds=IDLE_CONNECTION_SECONDS)


class Attempt:
    """One attempt: the node, its leg's name, the body sent, and the node's response once its
    head has come."""

    __slots__ = ("node", "leg", "body", "upstream")

    def __init__(self, node: NodeState, leg: str, body: bytes) -> None:
        self.node = node
        self.leg = leg
        self.body = body
        self.upstream: UpstreamResponse | None = None

    def close(self) -> None:
        if self.upstream is not None:
            self.upstream.close()


Ended = tuple[Outcome, Reply | msgspec.Raw | None]
"""How an attempt that did not commit ended, with the client's reply when it has one (or, for a
prefill, the `kv_transfer_params` for the decode leg)."""


class Attempts:
    """The stage, with the process's connections to the nodes (`pool`)."""

    def __init__(
        self,
        control_plane: ControlPlaneView,
        pool: HttpClient,
        metrics: RequestMetrics,
        log: JsonLog,
        occupancy: Occupancy,
    ) -> None:
        self._control_plane = control_plane
        self._pool = pool
        self._metrics = metrics
        self._log = log
        self._occupancy = occupancy
        self.flowing: set[Relay] = set()
        """The committed bodies still flowing, for `end_streams`."""

    def end_streams(self) -> None:
        """End every body still flowing, now (the shutdown grace is over): an event stream
        gets an error event, then its proper end; any other body is cut short."""
        for relay in list(self.flowing):
            relay.end()

    async def run(self, ledger: Ledger, plan: Plan) -> Reply | Refusal:
        """The client's reply (complete, or committed and flowing) or the gateway's refusal."""
        body = plan.body
        legs = plan.legs
        for leg in legs[:-1]:  # a disaggregated generation's prefill leg
            prefilled = await self._leg(ledger, leg, body)
            if not isinstance(prefilled, msgspec.Raw):
                return prefilled
            body = decode_body(body, prefilled)
            ledger.decode_began()
        return await self._leg(ledger, legs[-1], body)

    async def _leg(self, ledger: Ledger, leg: Leg, body: bytes) -> Reply | Refusal | msgspec.Raw:
        """One leg's pick-and-try loop over its candidates."""
        if leg.name == PREFILL:
            body = prefill_body(body)
        tried: set[str] = set()
        failure = NO_REACHABLE_NODE
        request_id = ledger.exchange.request_id
        for _ in range(len(leg.candidates)):
            node = self._pick(ledger, leg, tried)
            if node is None:
                break
            tried.add(node.ip)
            attempt = Attempt(node, leg.name, body)
            outcome: Outcome | None = Outcome(CLIENT_GONE)
            ledger.attempt_began(node.ip)
            try:
                sent = await self.send(ledger, attempt)
                if isinstance(sent, Reply):  # committed: its relay ends the attempt and the request
                    outcome = None
                    ledger.committed(node.ip)
                    return sent
                outcome, answer = sent
            except Exception as error:  # a fault of ours or a node answer that broke its parser
                attempt.close()
                outcome, answer = self._failed(ledger, attempt, error)
            except BaseException:  # trio.Cancelled: the client left
                attempt.close()
                outcome.status = attempt.upstream.status if attempt.upstream is not None else None
                raise
            finally:
                if outcome is not None:
                    ledger.attempt_ended(node.ip, outcome)
            if answer is not None:
                return answer
            if outcome.kind == FAILED:
                timed_out = isinstance(outcome.error, UpstreamTimeout)
                return refusal(UPSTREAM_TIMEOUT if timed_out else UPSTREAM_ERROR, request_id)
            if isinstance(outcome.error, PrefillWithoutKvTransferParams):
                failure = PREFILL_WITHOUT_KV_TRANSFER_PARAMS
        return refusal(failure, request_id)

    def _pick(self, ledger: Ledger, leg: Leg, tried: set[str]) -> NodeState | None:
        """The leg's balancer's pick from the pool routing leaves (`routing.pick_pool`: the
        candidates passed over are the request's exclusions); None when it is empty. The first
        pick is kept for the decision record, scored when there is one."""
        pool = pick_pool(leg.candidates, self._control_plane.now(), tried, ledger.passed_over)
        if not pool:
            return None
        view = ledger.view
        config = view.config
        balancer = leg.balancer
        rotation = balancer.rotation
        bounded = config.max_in_flight or config.admission.queue  # else no node is ever full
        choice = balancer.select(
            pool,
            ledger.policy,
            scored=config.decision_log,
            request_id=ledger.exchange.request_id,
            prefix=ledger.prefix,
            load_bound=config.load_bound,
            adapter=ledger.route.adapter,
            full=self._occupancy.full(view, pool, ledger.ticket.rank) if bounded else (),
            matches=ledger.matches,
        )
        ledger.picked(choice, rotation)
        return choice.node

    async def send(self, ledger: Ledger, attempt: Attempt) -> Reply | Ended:
        """Send `attempt` to its node under the model's timeouts (`UpstreamTimeouts`): a
        committed reply (its relay ends the attempt), or how the attempt ended."""
        config = ledger.view.config
        exchange = ledger.exchange
        timeouts = config.upstream_timeouts.get(exchange.model, config.timeouts)
        node = attempt.node
        prefill = attempt.leg == PREFILL
        stream = exchange.stream and not prefill
        # A stream's deadline is its first byte's, counted from the request as vLLM sends a
        # stream's head at once; a whole answer's head comes once it is generated.
        with trio.move_on_after(timeouts.first_byte if stream else timeouts.response) as waiting:
            try:
                body = attempt.body
                if node.ip in config.priority_scheduled:
                    body = ledger.ticket.prioritized(body)
                attempt.upstream = await self._request(ledger, node, body, timeouts.connect)
            except Exception as error:
                return self._failed(ledger, attempt, error)
            if stream:
                return await self._stream(ledger, attempt)
            # The same scope bounds the body: a second one would cost every request.
            waiting.deadline = trio.current_time() + config.response_body_timeout
            if prefill:
                return await self._prefilled(ledger, attempt)
            return await self._buffer(ledger, attempt, waiting.deadline)
        attempt.close()
        if prefill:
            return self._failed(ledger, attempt, UpstreamTimeout("timeout awaiting the prefill answer"))
        if stream:
            return self._failed(ledger, attempt, UpstreamTimeout("timed out waiting for first stream chunk"))
        if attempt.upstream is None:
            return self._failed(ledger, attempt, UpstreamTimeout("timeout awaiting response headers"))
        return self._failed(ledger, attempt, ResponseBodyTimeout("timeout awaiting response body"))

    def _request(
        self, ledger: Ledger, node: NodeState, body: bytes, connect_timeout: float
    ) -> Awaitable[UpstreamResponse]:
        """Send the request, with `body`, to `node`: its response once its head has come."""
        config = ledger.view.config
        exchange = ledger.exchange
        headers = exchange.headers
        authorization = config.upstream_authorizations.get(node.ip)
        if authorization is not None or config.api_key_digests:
            # The client's key is the gateway's (when it checks keys) and not the node's: it
            # goes no further, and the node's own key, if it has one, takes its place.
            headers = [header for header in headers if header[0] != b"authorization"]
            if authorization is not None:
                headers.append((b"authorization", authorization))
        return self._pool.request(
            b"POST",
            node.ip,
            config.ports[node.ip],
            _TARGETS[exchange.path],
            headers,
            body,
            connect_timeout=connect_timeout,
            tls=config.upstream_tls.get(node.ip),
        )

    def _failed(self, ledger: Ledger, attempt: Attempt, error: Exception) -> tuple[Outcome, None]:
        """A failure before commit: the next node is tried after any failure of a prefill; else
        after a dial error (plinth's), and with `retry_unanswered` after a node that did not
        answer in time; after any other failure for a stream, and with `retry_unanswered` after a
        connection that broke before any byte of the response otherwise. Else the request ends (a
        504 after a timeout, else a 502)."""
        if attempt.leg == PREFILL:
            status = attempt.upstream.status if attempt.upstream is not None else None
            return Outcome(RETRIED, status=status, error=error), None
        retry_unanswered = ledger.view.config.retry_unanswered
        if isinstance(error, UpstreamTimeout):
            retried = retry_unanswered
        else:
            retried = (
                ledger.exchange.stream
                or isinstance(error, ConnectFailed)
                or (retry_unanswered and isinstance(error, (WriteFailed, LostBeforeResponse)))
            )
        return Outcome(RETRIED if retried else FAILED, error=error), None

    async def _prefilled(self, ledger: Ledger, attempt: Attempt) -> Ended:
        """A prefill's answer: its `kv_transfer_params`, or the node's answer for the client when
        it is an error status, or a failure (then retried)."""
        upstream = attempt.upstream
        try:
            answer = await upstream.read_body(MAX_PREFILL_ANSWER_BYTES)
        except Exception as error:
            return self._failed(ledger, attempt, error)
        if upstream.status != 200:
            return self._complete(ledger, attempt, answer)
        try:
            return Outcome(COMPLETED, status=200), kv_transfer_params(answer)
        except PrefillWithoutKvTransferParams as error:
            return Outcome(RETRIED, status=200, error=error), None

    async def _stream(self, ledger: Ledger, attempt: Attempt) -> Reply | Ended:
        """Streaming commit gate: hold the status and headers until the first body byte (by the
        attempt's first-byte deadline, which `send` bounds it with)."""
        upstream = attempt.upstream
        try:
            first = await upstream.next_chunk()
        except Exception as error:
            return self._failed(ledger, attempt, error)
        if not first:
            # An empty body (a bodiless 201, say) is complete: commit it as it is.
            return self._complete(ledger, attempt, b"")
        return self._commit(ledger, attempt, [first])

    async def _buffer(self, ledger: Ledger, attempt: Attempt, deadline: float) -> Reply | Ended:
        """Buffering commit gate: the whole response, unless it outgrows the buffer limit (then
        the rest is relayed by the same `deadline`)."""
        upstream = attempt.upstream
        limit = ledger.view.config.buffer_limit
        declared = upstream.content_length
        if limit and declared is not None and declared > limit:
            return self._pass_through(ledger, attempt, [], "content_length", limit, deadline)
        buffered: list[bytes] = []
        size = 0
        try:
            while chunk := await upstream.next_chunk():
                buffered.append(chunk)
                size += len(chunk)
                if limit and size > limit:
                    return self._pass_through(ledger, attempt, buffered, "size_limit", limit, deadline)
        except Exception as error:
            return self._failed(ledger, attempt, error)
        body = buffered[0] if len(buffered) == 1 else b"".join(buffered)
        return self._complete(ledger, attempt, body)

    def _complete(self, ledger: Ledger, attempt: Attempt, body: bytes) -> Ended:
        upstream = attempt.upstream
        served_by = ledger.view.config.node_headers[attempt.node.ip]
        headers = client_headers(upstream, ledger.exchange.request_id, served_by, with_length=False)
        return Outcome(COMPLETED, status=upstream.status), Reply(upstream.status, headers, body)

    def _pass_through(
        self, ledger: Ledger, attempt: Attempt, buffered: list[bytes], reason: str, limit: int, deadline: float
    ) -> Reply:
        self._log.info("response exceeded buffer limit; passing through", node=attempt.node.ip, reason=reason, limit=limit)
        self._metrics.passthrough(ledger.metric_model, reason)
        return self._commit(ledger, attempt, buffered, deadline)

    def _commit(self, ledger: Ledger, attempt: Attempt, first: list[bytes], deadline: float = math.inf) -> Reply:
        """The status and headers to send now; the body flows chunk by chunk as the node sends it
        (until `deadline`, for a non-streaming answer)."""
        upstream = attempt.upstream
        served_by = ledger.view.config.node_headers[attempt.node.ip]
        headers = client_headers(upstream, ledger.exchange.request_id, served_by, with_length=True)
        return Reply(upstream.status, headers, Relay(ledger, attempt.node.ip, upstream, first, deadline, self.flowing))

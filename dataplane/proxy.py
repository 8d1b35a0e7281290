"""Forwarding a completion request to a node (plinth §4.3 steps 4-7).

`Proxy.forward` takes a request (`Exchange`) once: it admits it (its tenant's limits,
`dataplane.admission`, then the gateway's queue while the model's pool is saturated,
`dataplane.admission_queue`), routes it (the model's `Route`, cached per
snapshot), reads the prompt prefix when the policy or the decision log needs it, opens the
request's `Ledger`, and runs the attempt loop: pick a node among the candidates not yet tried
and neither dead nor offline (`routing.pick_pool`, then the balancer under the model's policy),
forward the request, and either answer the client or retry on the next node. Every attempt's end
goes to the ledger, and so does the request's: a streamed body's end too, which its `Relay`
reports through the ledger's `attempt_ended` and `request_ended` when it stops.

What may be retried is decided by whether anything reached the client yet (the commit gate):
a non-streaming response is buffered until it is complete (or larger than the buffer limit),
a stream is committed at its first body byte. Before commit, connection-level failures move on
to the next node; a node slower than the model's `first_byte_timeout` or `response_timeout` does
only under `retry_unanswered` (else a 504), and is not marked offline for it (slowness is load).
After commit, a failure ends the response early (never a 502, never a fabricated `[DONE]`), and
visibly: an event stream gets an error event the SDKs raise, and the response ends without its
terminating chunk (as nginx does), so HTTP clients see it cut short.
HTTP error statuses from a node are responses: passed through, never retried (completions are
not idempotent).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable

import msgspec
import trio

from controlplane.rules.balancer import Balancer
from controlplane.infrastructure.logs import JsonLog, Throttle, clipped
from controlplane.rules.policies import PREFIX_AFFINITY
from controlplane.rules.prefix import prompt_prefix
from controlplane.rules.routing import PREFILL, pick_pool, rings_listing
from controlplane.rules.saturation import priority_headroom
from dataplane.admission import Admission, Ticket, UsageTap
from dataplane.admission_queue import QUEUE_FULL, QUEUED, AdmissionQueue, QueueOutcome
from dataplane.control import ControlPlaneView
from dataplane.decisions import DecisionRecorder
from dataplane.errors import (
    NO_HEALTHY_NODE,
    NO_REACHABLE_NODE,
    PREFILL_WITHOUT_KV_TRANSFER_PARAMS,
    QUEUE_DEADLINE_PASSED,
    QUEUE_IS_FULL,
    RETRY_AFTER,
    RETRY_AFTER_MS,
    SHUTTING_DOWN,
    STREAM_TERMINATED,
    UPSTREAM_ERROR,
    UPSTREAM_TIMEOUT,
    ApiError,
    Reply,
    adapter_loading,
    error_reply,
    model_not_found,
)
from dataplane.disaggregation import (
    MAX_PREFILL_ANSWER_BYTES,
    PrefillWithoutKvTransferParams,
    decode_body,
    kv_transfer_params,
    prefill_body,
)
from dataplane.endpoints import ROUTED_PATHS
from dataplane.exchange import Exchange, Outcome, UpstreamTimeout
from dataplane.headers import client_headers, request_id_header
from dataplane.ledger import CLIENT_GONE, COMPLETED, FAILED, RETRIED, TRUNCATED, Books, Ledger
from dataplane.metrics import RequestMetrics
from dataplane.occupancy import Occupancy
from dataplane.quota import LocalQuota, Quota
from dataplane.views import SnapshotViews
from events.state import NodeState
from transport.http11 import ConnectFailed, HttpClient, LostBeforeResponse, WriteFailed
from transport.http11 import Response as UpstreamResponse

_TARGETS = {path: path.encode() for path in ROUTED_PATHS}

IDLE_CONNECTION_SECONDS = 90.0
UNSERVED_WARNING_INTERVAL = 1.0
"""Seconds between two `no node serves requested model` warnings; those in between are counted."""
MAX_IDLE_CONNECTIONS_PER_NODE = 64
"""plinth keeps 4: with more requests in flight to a node than that, connections would be closed
and dialled again all the time."""

_STREAM_ERROR_EVENT = b"data: " + STREAM_TERMINATED.body + b"\n\n"
"""The last event of a stream the node cut short, in the shape vLLM and OpenAI use: the OpenAI
SDKs raise it as an APIError."""
_SHUTDOWN_EVENT = b"data: " + SHUTTING_DOWN.body + b"\n\n"
"""The last event of a stream still open when the shutdown grace ends (`Proxy.end_streams`)."""


def new_upstream_pool() -> HttpClient:
    """The connections to every node (`transport.http11`), kept alive 90 s when idle."""
    return HttpClient(max_idle_per_host=MAX_IDLE_CONNECTIONS_PER_NODE, idle_seconds=IDLE_CONNECTION_SECONDS)


class ResponseBodyTimeout(Exception):
    """A non-streaming answer's body did not end by its deadline (`gateway.response_body_timeout`):
    not retried, as a body cut short is not (the node has answered)."""


class Proxy:
    """The attempt loop and the two commit gates."""

    def __init__(
        self,
        control_plane: ControlPlaneView,
        pool: HttpClient,
        metrics: RequestMetrics,
        log: JsonLog,
        decisions: DecisionRecorder | None = None,
        *,
        quota: Quota | None = None,
        views: SnapshotViews | None = None,
    ) -> None:
        self._control_plane = control_plane
        self._pool = pool
        self._metrics = metrics
        self._log = log
        self._views = views if views is not None else SnapshotViews(control_plane)
        """The current snapshot's view, for a request that waited in the admission queue."""
        self._occupancy = Occupancy(self._views)
        self._balancer = Balancer(self._occupancy.in_flight)
        self._prefill_balancer = Balancer(self._occupancy.in_flight)
        self._queue = AdmissionQueue(control_plane, self._views, self._occupancy, metrics)
        self._books = Books(control_plane, metrics, log, self._occupancy, decisions, self._queue)
        self._unserved_warnings = Throttle(UNSERVED_WARNING_INTERVAL)
        self._flowing: set[Relay] = set()
        """The committed bodies still flowing, for `end_streams`."""
        self._admission = Admission(quota or LocalQuota(), metrics)

    def end_streams(self) -> None:
        """End every body still flowing, now (the shutdown grace is over): an event stream
        gets an error event, then its proper end; any other body is cut short."""
        for relay in list(self._flowing):
            relay.end()

    async def forward(self, exchange: Exchange) -> Reply:
        """The response for the client: the node's (complete, or committed and still flowing) or
        an error. A limited tenant's every answer carries its `x-ratelimit-*` headers."""
        ticket = self._admission.ticket(exchange)
        ledger = self._open_ledger(exchange, ticket)
        try:
            refused = None
            if ticket.tenant.limited:
                refused = await self._admission.admit(ticket, exchange)
                if refused is not None:
                    ledger.request_ended(refused.status)
            if refused is None and exchange.view.config.admission.queue and ledger.route.candidates:
                admitted = await self._admit(exchange, ledger)
                if isinstance(admitted, Reply):
                    refused = admitted
                else:
                    ledger = admitted
            if refused is not None:
                reply = refused
            else:
                self._admission.counted(ticket)
                reply = await self._route(exchange, ledger)
        except trio.Cancelled:
            ledger.client_left()
            raise
        if ticket.headers:
            reply.headers += ticket.headers
        return reply

    def _open_ledger(self, exchange: Exchange, ticket: Ticket) -> Ledger:
        """The request's ledger on its snapshot: its route, policy and prompt prefix."""
        view = exchange.view
        config = view.config
        route = view.route(exchange.model)
        policy = config.model_policies.get(exchange.model, config.cluster_policy)
        prefix = (
            prompt_prefix(exchange.path, exchange.body, messages=config.prefix_messages, limit=config.prefix_bytes)
            if policy == PREFIX_AFFINITY or config.decision_log
            else ""
        )
        return Ledger(self._books, exchange, route, policy, prefix, ticket)

    async def _admit(self, exchange: Exchange, ledger: Ledger) -> Ledger | Reply:
        """The gateway's queue, once the tenant's limits let the request through: at once while
        the model's pool has room, else after waiting (`dataplane.admission_queue`), until the
        tenant's `max_queue_seconds` (else `[admission]`'s); or its refusal. A request that
        waited is routed on the snapshot of now (a new ledger), as if it had just arrived."""
        ticket = ledger.ticket
        tenant = ticket.tenant
        view = exchange.view
        deadline = tenant.max_queue_seconds
        if deadline is None:
            deadline = view.config.admission.max_queue_seconds
        arrived = trio.current_time()
        try:
            outcome = await self._queue.admit(
                view, exchange.model, tenant.name, ticket.priority, ticket.fairness_id, deadline
            )
        except trio.Cancelled:  # the client left the queue: the record says how long it waited
            waited_ms = 1000 * (trio.current_time() - arrived)
            headroom = priority_headroom(view.config.config, ticket.priority)
            ticket.queue_outcome(QueueOutcome(QUEUED, waited_ms, view.snapshot.seq, headroom))
            raise
        ticket.queue_outcome(outcome)
        if outcome.refused:
            refusal = QUEUE_IS_FULL if outcome.verdict == QUEUE_FULL else QUEUE_DEADLINE_PASSED
            return self._error(ledger, refusal, RETRY_AFTER, RETRY_AFTER_MS)
        if outcome.verdict == QUEUED and (current := self._views.current()) is not view:
            exchange.view = current
            return self._open_ledger(exchange, ticket)
        return ledger

    async def _route(self, exchange: Exchange, ledger: Ledger) -> Reply:
        """The attempt loop over the route's candidates (a disaggregated request's two legs)."""
        route = ledger.route
        for reason, count in route.exclusion_counts:
            self._metrics.excluded(ledger.metric_model, reason, count)
        candidates = route.candidates
        if not candidates:
            if exchange.view.adapter_loading(exchange.model):
                return self._error(ledger, adapter_loading(exchange.model), RETRY_AFTER, RETRY_AFTER_MS)
            if route.ring_pool:
                self._warn_unserved(exchange)
            if route.unknown:
                rings = rings_listing(exchange.view.snapshot, exchange.model)
                return self._error(ledger, model_not_found(exchange.model, rings))
            return self._error(ledger, NO_HEALTHY_NODE)
        tried: set[str] = set()
        if ledger.leg:  # a disaggregated generation: first its prefill leg
            prefilled = await self._prefill(exchange, ledger, *route.legs)
            if isinstance(prefilled, Reply):
                return prefilled
            exchange.body = decode_body(exchange.body, prefilled)
            ledger.decode_began()
            candidates = route.legs[1]
        for _ in range(len(candidates)):
            node = self._pick(ledger, candidates, tried)
            if node is None:
                break
            tried.add(node.ip)
            ended = await self._attempt(exchange, ledger, node)
            if isinstance(ended, Reply):  # committed: its relay ends the attempt and the request
                ledger.committed(node.ip)
                return ended
            outcome, reply = ended
            ledger.attempt_ended(node.ip, outcome)
            if outcome.kind == FAILED:
                timed_out = isinstance(outcome.error, UpstreamTimeout)
                return self._error(ledger, UPSTREAM_TIMEOUT if timed_out else UPSTREAM_ERROR)
            if reply is not None:
                if ledger.ticket.tenant.counts_tokens and isinstance(reply.body, bytes):
                    ledger.ticket.read_usage(reply.body)
                ledger.request_ended(reply.status)
                return reply
        return self._error(ledger, NO_REACHABLE_NODE)

    async def _prefill(
        self, exchange: Exchange, ledger: Ledger, prefill_nodes: list[NodeState], decode_nodes: list[NodeState]
    ) -> msgspec.Raw | Reply:
        """The prefill leg of a disaggregated request: the `kv_transfer_params` a prefill node
        answered with, or the client's reply (a node's error status, or the gateway's error).

        Any failure of the leg is retried on the next prefill node: nothing has reached the
        client, and a prefill leaves nothing behind but KV blocks that the node frees when no
        decode fetches them."""
        if not prefill_nodes or not decode_nodes:
            return self._error(ledger, NO_HEALTHY_NODE)
        body = prefill_body(exchange.body)
        tried: set[str] = set()
        failure = NO_REACHABLE_NODE
        for _ in range(len(prefill_nodes)):
            node = self._pick(ledger, prefill_nodes, tried)
            if node is None:
                break
            tried.add(node.ip)
            outcome, answer = await self._prefill_attempt(exchange, ledger, node, body)
            ledger.attempt_ended(node.ip, outcome)
            if isinstance(answer, Reply):
                ledger.request_ended(answer.status)
                return answer
            if answer is not None:
                return answer
            if isinstance(outcome.error, PrefillWithoutKvTransferParams):
                failure = PREFILL_WITHOUT_KV_TRANSFER_PARAMS
        return self._error(ledger, failure)

    async def _prefill_attempt(
        self, exchange: Exchange, ledger: Ledger, node: NodeState, body: bytes
    ) -> tuple[Outcome, msgspec.Raw | Reply | None]:
        """One prefill attempt: its `kv_transfer_params`, or the node's answer for the client
        when it is an error status, or None when the attempt failed (then retried)."""
        config = exchange.view.config
        timeouts = config.upstream_timeouts.get(exchange.model, config.timeouts)
        upstream: UpstreamResponse | None = None
        ledger.attempt_began(node.ip)
        try:
            with trio.move_on_after(timeouts.response) as waiting:
                try:
                    if node.ip in config.priority_scheduled:
                        body = ledger.ticket.prioritized(body)
                    upstream = await self._request(exchange, node, body, timeouts.connect)
                    waiting.deadline = trio.current_time() + config.response_body_timeout
                    answer = await upstream.read_body(MAX_PREFILL_ANSWER_BYTES)
                except Exception as error:
                    return Outcome(RETRIED, status=upstream and upstream.status, error=error), None
            if waiting.cancelled_caught:
                if upstream is not None:
                    upstream.close()
                return Outcome(RETRIED, error=UpstreamTimeout("timeout awaiting the prefill answer")), None
            if upstream.status != 200:
                served_by = config.node_headers[node.ip]
                headers = client_headers(upstream, exchange.request_id, served_by, with_length=False)
                return Outcome(COMPLETED, status=upstream.status), Reply(upstream.status, headers, answer)
            try:
                return Outcome(COMPLETED, status=200), kv_transfer_params(answer)
            except PrefillWithoutKvTransferParams as error:
                return Outcome(RETRIED, status=200, error=error), None
        except BaseException as error:
            _abandoned(ledger, node, upstream, error)
            raise

    def _error(self, ledger: Ledger, error: ApiError, *extra: tuple[bytes, bytes]) -> Reply:
        ledger.request_ended(error.status)
        return error_reply(error, request_id_header(ledger.exchange.request_id), *extra)

    def _warn_unserved(self, exchange: Exchange) -> None:
        """plinth's warning, at most once per UNSERVED_WARNING_INTERVAL (a client can ask for
        any number of models), with the client's text clipped."""
        held_back = self._unserved_warnings.allow(trio.current_time())
        if held_back is None:
            return
        fields = {"model": clipped(exchange.model), "request_id": clipped(exchange.request_id)}
        if held_back:
            fields["suppressed"] = held_back
        self._log.warn("no node serves requested model", **fields)

    def _pick(self, ledger: Ledger, candidates: list[NodeState], tried: set[str]) -> NodeState | None:
        """The balancer's pick among `candidates` (the route's, or a disaggregated leg's) from
        the pool routing leaves (`routing.pick_pool`: the candidates passed over are the
        request's exclusions); None when it is empty. The first pick is kept for the decision
        record, scored when there is one."""
        pool = pick_pool(candidates, self._control_plane.now(), tried, ledger.passed_over)
        if not pool:
            return None
        view = ledger.exchange.view
        config = view.config
        balancer = self._prefill_balancer if ledger.leg == PREFILL else self._balancer
        rotation = balancer.rotation
        choice = balancer.select(
            pool,
            ledger.policy,
            scored=config.decision_log,
            request_id=ledger.exchange.request_id,
            prefix=ledger.prefix,
            load_bound=config.load_bound,
            adapter=ledger.route.adapter,
            full=self._occupancy.full(view, pool, ledger.ticket.rank),
        )
        ledger.picked(choice, rotation)
        return choice.node

    # --- one attempt

    async def _attempt(
        self, exchange: Exchange, ledger: Ledger, node: NodeState
    ) -> Reply | tuple[Outcome, Reply | None]:
        """A committed reply (its relay ends the attempt), or how the attempt ended with the
        client's complete reply when it has one."""
        config = exchange.view.config
        timeouts = config.upstream_timeouts.get(exchange.model, config.timeouts)
        upstream: UpstreamResponse | None = None
        ledger.attempt_began(node.ip)
        try:
            # A stream's deadline is its first byte's, counted from the request as vLLM sends
            # a stream's head at once; a whole answer's head comes once it is generated.
            with trio.move_on_after(timeouts.first_byte if exchange.stream else timeouts.response) as waiting:
                try:
                    body = exchange.body
                    if node.ip in config.priority_scheduled:
                        body = ledger.ticket.prioritized(body)
                    upstream = await self._request(exchange, node, body, timeouts.connect)
                except Exception as error:
                    return self._failed(exchange, error)
                if exchange.stream:
                    return await self._stream(exchange, ledger, node, upstream)
                # The same scope bounds the body: a second one would cost every request.
                waiting.deadline = trio.current_time() + config.response_body_timeout
                return await self._buffer(exchange, ledger, node, upstream, waiting.deadline)
            if upstream is not None:
                upstream.close()
            if exchange.stream:
                return self._failed(exchange, UpstreamTimeout("timed out waiting for first stream chunk"))
            if upstream is None:
                return self._failed(exchange, UpstreamTimeout("timeout awaiting response headers"))
            return self._failed(exchange, ResponseBodyTimeout("timeout awaiting response body"))
        except BaseException as error:
            _abandoned(ledger, node, upstream, error)
            raise

    def _request(
        self, exchange: Exchange, node: NodeState, body: bytes, connect_timeout: float
    ) -> Awaitable[UpstreamResponse]:
        """Send the request, with `body`, to `node`: its response once its head has come."""
        config = exchange.view.config
        headers = exchange.headers
        authorization = config.upstream_authorizations.get(node.ip)
        if authorization is not None or config.api_key_digests:
            # The client's key is the gateway's (when it checks keys) and not the node's: it
            # goes no further, and the node's own key, if it has one, takes its place.
            headers = [header for header in headers if header[0] != b"authorization"]
            if authorization is not None:
                headers.append((b"authorization", authorization))
        target = _TARGETS[exchange.path]
        return self._pool.request(
            b"POST",
            node.ip,
            config.ports[node.ip],
            target,
            headers,
            body,
            connect_timeout=connect_timeout,
            tls=config.upstream_tls.get(node.ip),
        )

    def _failed(self, exchange: Exchange, error: Exception) -> tuple[Outcome, None]:
        """A failure before commit: the next node is tried after a dial error (plinth's), and
        with `retry_unanswered` after a node that did not answer in time; after any other failure
        for a stream, and with `retry_unanswered` after a connection that broke before any byte
        of the response otherwise. Else the request ends (a 504 after a timeout, else a 502)."""
        if isinstance(error, UpstreamTimeout):
            retried = exchange.view.config.retry_unanswered
        else:
            retried = (
                exchange.stream
                or isinstance(error, ConnectFailed)
                or (exchange.view.config.retry_unanswered and isinstance(error, (WriteFailed, LostBeforeResponse)))
            )
        return Outcome(RETRIED if retried else FAILED, error=error), None

    async def _stream(
        self, exchange: Exchange, ledger: Ledger, node: NodeState, upstream: UpstreamResponse
    ) -> Reply | tuple[Outcome, Reply | None]:
        """Streaming commit gate: hold the status and headers until the first body byte (by the
        attempt's first-byte deadline, which `_attempt` bounds it with)."""
        try:
            first = await upstream.next_chunk()
        except Exception as error:
            return self._failed(exchange, error)
        if not first:
            # An empty body (a bodiless 201, say) is complete: commit it as it is.
            return self._complete(exchange, node, upstream, b"")
        return self._commit(exchange, ledger, node, upstream, [first])

    async def _buffer(
        self, exchange: Exchange, ledger: Ledger, node: NodeState, upstream: UpstreamResponse, deadline: float
    ) -> Reply | tuple[Outcome, Reply | None]:
        """Buffering commit gate: the whole response, unless it outgrows the buffer limit (then
        the rest is relayed by the same `deadline`)."""
        limit = exchange.view.config.buffer_limit
        declared = upstream.content_length
        if limit and declared is not None and declared > limit:
            return self._pass_through(exchange, ledger, node, upstream, [], "content_length", limit, deadline)
        buffered: list[bytes] = []
        size = 0
        try:
            while chunk := await upstream.next_chunk():
                buffered.append(chunk)
                size += len(chunk)
                if limit and size > limit:
                    return self._pass_through(exchange, ledger, node, upstream, buffered, "size_limit", limit, deadline)
        except Exception as error:
            return self._failed(exchange, error)
        body = buffered[0] if len(buffered) == 1 else b"".join(buffered)
        return self._complete(exchange, node, upstream, body)

    def _complete(
        self, exchange: Exchange, node: NodeState, upstream: UpstreamResponse, body: bytes
    ) -> tuple[Outcome, Reply]:
        headers = client_headers(
            upstream, exchange.request_id, exchange.view.config.node_headers[node.ip], with_length=False
        )
        return Outcome(COMPLETED, status=upstream.status), Reply(upstream.status, headers, body)

    def _pass_through(
        self,
        exchange: Exchange,
        ledger: Ledger,
        node: NodeState,
        upstream: UpstreamResponse,
        buffered: list[bytes],
        reason: str,
        limit: int,
        deadline: float,
    ) -> Reply:
        self._log.info("response exceeded buffer limit; passing through", node=node.ip, reason=reason, limit=limit)
        self._metrics.passthrough(ledger.metric_model, reason)
        return self._commit(exchange, ledger, node, upstream, buffered, deadline)

    def _commit(
        self,
        exchange: Exchange,
        ledger: Ledger,
        node: NodeState,
        upstream: UpstreamResponse,
        first: list[bytes],
        deadline: float = math.inf,
    ) -> Reply:
        """The status and headers to send now; the body flows chunk by chunk as the node sends it
        (until `deadline`, for a non-streaming answer)."""
        served_by = exchange.view.config.node_headers[node.ip]
        headers = client_headers(upstream, exchange.request_id, served_by, with_length=True)
        relay = Relay(ledger, node.ip, upstream, first, deadline, self._flowing)
        return Reply(upstream.status, headers, relay)


class Relay:
    """A committed body: the pieces already read, then the rest as the node sends it. Its end
    (whole, cut short by the node or by `end`, or the client gone) ends the attempt and the
    request in the request's ledger. While it flows it is in `flowing`."""

    __slots__ = ("_ledger", "_node", "_upstream", "_first", "_deadline", "_flowing", "_ended")

    def __init__(
        self,
        ledger: Ledger,
        node: str,
        upstream: UpstreamResponse,
        first: list[bytes],
        deadline: float,
        flowing: set[Relay],
    ) -> None:
        self._ledger = ledger
        self._node = node
        self._upstream = upstream
        self._first = first
        self._deadline = deadline
        self._flowing = flowing
        self._ended = False

    def end(self) -> None:
        """Stop relaying (the gateway is shutting down): the upstream connection is closed, which
        wakes the relay waiting on it, and the relay ends the body as `relay` says."""
        self._ended = True
        self._upstream.close()

    async def relay(
        self, send_head: Callable[[], Awaitable[None]], send_piece: Callable[[bytes], Awaitable[None]]
    ) -> bool:
        """Send the head, then the body. The client going away ends it early (the upstream
        connection is then closed at once, which cancels the generation on the node). So does a
        node failure, visibly: an event stream gets an error event last, and the answer is
        False, for the response to end without its terminating chunk. A body not ended by the
        deadline is such a failure. So is one ended by `end`, but an event stream then ends
        properly after its error event (the answer is True): the gateway, not the node, ended it."""
        upstream = self._upstream
        outcome = Outcome(COMPLETED, status=upstream.status, committed=True)
        chunk = b""
        next_chunk = upstream.next_chunk
        if self._deadline != math.inf:
            next_chunk = functools.partial(_next_chunk_by, upstream, self._deadline)
        tap = self._ledger.ticket.tap
        if tap is not None:
            send_piece = functools.partial(_send_tapped, tap, send_piece)
        self._flowing.add(self)
        try:
            await send_head()
            for chunk in self._first:
                await send_piece(chunk)
            try:
                while chunk := await next_chunk():
                    await send_piece(chunk)
                if tap is not None and (rest := tap.finish()):
                    await send_piece(rest)
            except Exception as error:
                if self._ended:
                    error = SHUTTING_DOWN.message
                outcome = Outcome(TRUNCATED, status=upstream.status, error=error, committed=True)
        except BaseException:  # trio.Cancelled: the client left
            outcome = Outcome(CLIENT_GONE, status=upstream.status, error="client disconnected", committed=True)
            raise
        finally:
            self._flowing.discard(self)
            upstream.close()
            self._ledger.attempt_ended(self._node, outcome)
            self._ledger.request_ended(upstream.status)
        if outcome.kind != TRUNCATED:
            return True
        if not (upstream.header(b"content-type") or b"").startswith(b"text/event-stream"):
            return False
        # `chunk` is the last piece relayed: an event it leaves unfinished is ended first.
        event = _SHUTDOWN_EVENT if self._ended else _STREAM_ERROR_EVENT
        await send_piece((b"" if chunk.endswith(b"\n\n") else b"\n\n") + event)
        return self._ended


def _abandoned(ledger: Ledger, node: NodeState, upstream: UpstreamResponse | None, error: BaseException) -> None:
    """An attempt that ends by an exception, the client gone (a cancellation) or a fault of
    ours: its connection dropped, and the attempt ended (its in-flight counts released)."""
    if upstream is not None:
        upstream.close()
    status = upstream.status if upstream else None
    if isinstance(error, trio.Cancelled):
        ledger.attempt_ended(node.ip, Outcome(CLIENT_GONE, status=status))
    else:
        ledger.attempt_ended(node.ip, Outcome(FAILED, status=status, error=error))


async def _send_tapped(tap: UsageTap, send_piece: Callable[[bytes], Awaitable[None]], piece: bytes) -> None:
    """Send what the usage tap lets through of `piece` (`dataplane.admission.UsageTap`)."""
    if piece := tap.feed(piece):
        await send_piece(piece)


async def _next_chunk_by(upstream: UpstreamResponse, deadline: float) -> bytes:
    """The answer's next piece; ResponseBodyTimeout once `deadline` has passed."""
    with trio.move_on_at(deadline):
        return await upstream.next_chunk()
    raise ResponseBodyTimeout("timeout awaiting response body")

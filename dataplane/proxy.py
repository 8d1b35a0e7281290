"""Forwarding a completion request to a node (plinth §4.3 steps 4-7).

Routing starts from the model's ring pool, drops the nodes whose model list rules the model out
(both through `controlplane.routing`), then runs the attempt loop: pick a node with the shared
balancer (under the model's routing policy) among the candidates not yet tried and neither dead
nor offline, forward
the request, and either answer the client or retry on the next node. Each attempt returns its
`Outcome`, and `Proxy._settle` is the one place that records how an attempt ended (log line,
metrics, what the control plane learns about the node, the decision record's entry).

What may be retried is decided by whether anything reached the client yet (the commit gate):
a non-streaming response is buffered until it is complete (or larger than the buffer limit),
a stream is committed at its first body byte. Before commit, connection-level failures move on
to the next node; after commit, a failure ends the response early (never a 502, never a
fabricated `[DONE]`), and visibly: an event stream gets an error event the SDKs raise, and the
response ends without its terminating chunk (as nginx does), so HTTP clients see it cut short.
HTTP error statuses from a node are responses: passed through, never retried (completions are
not idempotent).

Everything a request needs from a control-plane snapshot that does not depend on the request
(node ports, each model's ring pool and model filter) is computed once per snapshot.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import AsyncIterator

import msgspec
import trio

from controlplane.keyfiles import upstream_authorizations
from controlplane.logs import JsonLog, Throttle, clipped
from controlplane.metrics import OTHER_MODELS, labelled_list, metric_models
from controlplane.routing import (
    filter_by_model,
    is_unknown_model,
    model_ring,
    ring_members,
    routable_nodes,
    unavailable_reason,
)
from controlplane.policies import PREFIX_AFFINITY, Choice
from dataplane.balancer import Balancer
from dataplane.control import ControlPlaneView
from dataplane.decisions import (
    CLIENT_GONE,
    COMPLETED,
    FAILED,
    RETRIED,
    TRUNCATED,
    AttemptRecord,
    Decision,
    DecisionRecorder,
    Exclusion,
)
from dataplane.errors import (
    NO_HEALTHY_NODE,
    NO_REACHABLE_NODE,
    STREAM_TERMINATED,
    UPSTREAM_ERROR,
    ApiError,
    Headers,
    Reply,
    error_reply,
    model_not_found,
)
from dataplane.metrics import RequestMetrics
from dataplane.prefix import prompt_prefix
from events.config import Config, NodeConfig
from events.state import ClusterState, NodeState
from events.types import Checkpoint, UpstreamFailed, UpstreamRecovered
from transport.http11 import ConnectFailed, HttpClient, LostBeforeResponse, WriteFailed
from transport.http11 import Response as UpstreamResponse

COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
_TARGETS = {path: path.encode() for path in COMPLETION_PATHS}

CONNECT_TIMEOUT = 5.0
RESPONSE_HEADER_TIMEOUT = 60.0
FIRST_CHUNK_TIMEOUT = 10.0
IDLE_CONNECTION_SECONDS = 90.0
UNSERVED_WARNING_INTERVAL = 1.0
"""Seconds between two `no node serves requested model` warnings; those in between are counted."""
MAX_IDLE_CONNECTIONS_PER_NODE = 64
"""plinth keeps 4: with more requests in flight to a node than that, connections would be closed
and dialled again all the time."""

_HOP_BY_HOP = frozenset(
    (
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    )
)
_NOT_FORWARDED = _HOP_BY_HOP | {b"host", b"content-length", b"x-forwarded-for", b"x-request-id"}
"""Request headers that describe the client's connection, or that the gateway (or its HTTP
client: Host and Content-Length) sets itself."""
_NOT_RETURNED = _HOP_BY_HOP | {b"date", b"x-request-id", b"x-interlock-node"}
"""Response headers that describe the node's connection, or that the gateway sets itself
(hypercorn writes the Date)."""
_NOT_RETURNED_WITH_BODY = _NOT_RETURNED | {b"content-length"}

_STREAM_ERROR_EVENT = b"data: " + STREAM_TERMINATED.body + b"\n\n"
"""The last event of a stream the node cut short, in the shape vLLM and OpenAI use: the OpenAI
SDKs raise it as an APIError."""


def new_upstream_pool() -> HttpClient:
    """The connections to every node (`transport.http11`), kept alive 90 s when idle."""
    return HttpClient(max_idle_per_host=MAX_IDLE_CONNECTIONS_PER_NODE, idle_seconds=IDLE_CONNECTION_SECONDS)


# --- what a snapshot gives every request -------------------------------------------------------


class ConfigView:
    """What requests need from one config: node ports, limits, the default model."""

    def __init__(self, config: Config) -> None:
        self.config = config
        gateway = config.gateway
        self.default_model = config.models.default
        self.body_limit = gateway.request_body_limit
        self.body_timeout = gateway.request_body_timeout
        self.body_idle_timeout = gateway.request_body_idle_timeout
        self.response_body_timeout = gateway.response_body_timeout
        self.buffer_limit = gateway.response_buffer_limit
        self.decision_log = bool(gateway.decision_log)
        routing = config.routing
        self.cluster_policy = routing.policy
        self.model_policies = {model.name: config.model_policy(model.name) for model in config.models.available}
        self.prefix_messages = routing.prefix_messages
        self.prefix_bytes = routing.prefix_bytes
        self.load_bound = routing.load_bound
        self.retry_unanswered = gateway.retry_unanswered
        self.ports = {node.ip: node.vllm_port for node in config.nodes}
        self.api_key_digests = tuple(digest.encode() for digest in gateway.api_key_hashes)
        self.health_open = not gateway.health_requires_api_key
        self.health_hides_errors = gateway.health_hides_errors
        self.health_shows_load = config.load_scrape_interval() > 0
        """/health shows each node's load only when it is scraped (plinth's body stays as it is)."""
        self.upstream_authorizations = upstream_authorizations(config)
        """The `Authorization` each node with a key gets instead of the client's."""
        self.node_headers = {node.ip: _node_header(node) for node in config.nodes}
        """The header naming the node that served a request (a node's own header may say anything)."""
        listed = [
            {"id": model.name, "object": "model", "created": MODEL_CREATED, "owned_by": "cluster"}
            for model in config.models.available
        ]
        self.models_body = msgspec.json.encode({"object": "list", "data": listed or None})
        """`GET /v1/models`: the configured models; `data` is null when there are none (plinth)."""
        self.model_bodies = {model["id"]: msgspec.json.encode(model) for model in listed}
        """`GET /v1/models/{id}`: each configured model's object, as the list has it."""


MODEL_CREATED = 0
"""A configured model's `created` (OpenAI's schema requires one): 0, as a name in the config has no
creation time, and a fixed value keeps every replica's and every reload's listing byte for byte alike."""


def _node_header(node: NodeConfig) -> tuple[bytes, bytes]:
    """`X-Interlock-Node`: the node's configured name, or its IP when the name is empty or not
    printable ASCII (which a header cannot carry as it is)."""
    named = node.name and node.name.isascii() and node.name.isprintable()
    return (b"x-interlock-node", (node.name if named else node.ip).encode("ascii", "replace"))


class Route:
    """One model's routing on one snapshot: the ring pool, and the candidates the model filter
    keeps; when there is none, whether the model is unknown (`routing.is_unknown_model`)."""

    __slots__ = ("ring", "ring_pool", "candidates", "excluded", "exclusion_counts", "unknown")

    def __init__(self, snapshot: ClusterState, model: str) -> None:
        self.ring = model_ring(snapshot, model)
        pool = ring_members(snapshot, self.ring)
        candidates, dropped = filter_by_model(pool, model)
        self.ring_pool = tuple(node.ip for node in pool)
        self.candidates = candidates
        self.unknown = not candidates and is_unknown_model(snapshot, pool, model)
        self.excluded = tuple(Exclusion(node.ip, reason) for node, reason in dropped)
        counts: dict[str, int] = {}
        for _, reason in dropped:
            counts[reason] = counts.get(reason, 0) + 1
        self.exclusion_counts = tuple(counts.items())


class SnapshotView:
    """One snapshot and what is derived from it, computed once and shared by its requests."""

    MAX_ROUTES = 1024
    """Routes cached per snapshot; requests for ever new model names are routed uncached."""

    def __init__(self, snapshot: ClusterState, config: ConfigView) -> None:
        self.snapshot = snapshot
        self.config = config
        self._routes: dict[str, Route] = {}
        self._routable: tuple[tuple[str, ...], float] | None = None
        """`routable_models`' last answer, and the moment until which it holds."""

    def route(self, model: str) -> Route:
        route = self._routes.get(model)
        if route is None:
            route = Route(self.snapshot, model)
            if len(self._routes) < self.MAX_ROUTES:
                self._routes[model] = route
        return route

    def routable_models(self, now: float) -> tuple[str, ...]:
        """The models `/ready` counts (the configured ones; with none configured, those the
        nodes list) that have a node a request's first pick would be made from at `now`.

        On one snapshot the answer changes only when an offline mark ends, so it is kept until
        the first such moment among the models' candidates."""
        cached = self._routable
        if cached is not None and now < cached[1]:
            return cached[0]
        routable = []
        holds_until = math.inf
        for model in self._readiness_models:
            candidates = self.route(model).candidates
            if routable_nodes(candidates, now):
                routable.append(model)
            for node in candidates:
                if node.is_offline(now):
                    holds_until = min(holds_until, node.offline_until)
        self._routable = tuple(routable), holds_until
        return self._routable[0]

    @functools.cached_property
    def _readiness_models(self) -> tuple[str, ...]:
        configured = dict.fromkeys(model.name for model in self.snapshot.config.models.available)
        if configured:
            return tuple(configured)
        return tuple(sorted({name for node in self.snapshot.node_list() for name in node.models.names or ()}))

    def metric_model(self, model: str) -> str:
        """`model` as the metrics' `model` label: itself when it has a label of its own
        (`controlplane.metrics.metric_models`), else OTHER_MODELS."""
        return model if model in self.metric_models else OTHER_MODELS

    @functools.cached_property
    def metric_models(self) -> frozenset[str]:
        return metric_models(self.snapshot)

    @functools.cached_property
    def state_digest(self) -> str:
        """The snapshot's `Checkpoint.digest`: processes that followed the same events agree on it."""
        return Checkpoint.of(self.snapshot).digest()


class SnapshotViews:
    """The view of the control plane's current snapshot, rebuilt only when the snapshot changes
    (and its config part only when the config does)."""

    def __init__(self, control_plane: ControlPlaneView) -> None:
        self._control_plane = control_plane
        self._view: SnapshotView | None = None

    def current(self) -> SnapshotView:
        snapshot = self._control_plane.snapshot
        view = self._view
        if view is None or view.snapshot is not snapshot:
            same_config = view is not None and view.config.config is snapshot.config
            previous, view = view, SnapshotView(snapshot, view.config if same_config else ConfigView(snapshot.config))
            if same_config and "metric_models" in vars(previous) and _same_lists(previous.snapshot, snapshot):
                view.metric_models = previous.metric_models
            self._view = view
        return view


def _same_lists(before: ClusterState, after: ClusterState) -> bool:
    """Whether every node lists what it listed before (most events change no list, and the
    labelled models cost a pass over every list)."""
    if len(before.nodes) != len(after.nodes):
        return False
    for old, new in zip(before.nodes.values(), after.nodes.values()):
        if old.ip != new.ip:
            return False
        if old.models is not new.models and labelled_list(old.models) != labelled_list(new.models):
            return False
    return True


# --- one proxied request -------------------------------------------------------------------------


class Exchange:
    """A completion request on its way through the attempt loop."""

    __slots__ = (
        "request_id", "path", "model", "metric_model", "stream", "body", "headers", "view", "route", "at",
        "started", "attempts", "skipped", "attempt_started", "policy", "prefix", "rotation", "first_choice",
    )  # fmt: skip

    def __init__(
        self,
        *,
        request_id: str,
        path: str,
        model: str,
        stream: bool,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        view: SnapshotView,
        at: float,
        started: float,
    ) -> None:
        self.request_id = request_id
        self.path = path
        self.model = model
        self.metric_model = view.metric_model(model)
        self.stream = stream
        self.body = body
        self.headers = headers
        self.view = view
        self.route = view.route(model)
        self.at = at
        self.started = started
        self.attempts: list[AttemptRecord] = []
        self.attempt_started = started
        """When the attempt in progress began (attempts are made one after another)."""
        self.skipped: list[Exclusion] = []
        """The candidates the attempt loop passed over (dead or offline when it picked), once each."""
        config = view.config
        self.policy = config.model_policies.get(model, config.cluster_policy)
        self.prefix = (
            prompt_prefix(path, body, messages=config.prefix_messages, limit=config.prefix_bytes)
            if self.policy == PREFIX_AFFINITY or config.decision_log
            else ""
        )
        """The prompt prefix's hash (`dataplane.prefix`), when the policy or the decision log needs it."""
        self.rotation = 0
        self.first_choice: Choice | None = None
        """The first pick, with its candidates' scores when they were computed, and its rotation."""

    def skip(self, ip: str, reason: str) -> None:
        for exclusion in self.skipped:
            if exclusion.node == ip:
                return
        self.skipped.append(Exclusion(ip, reason))


def request_id_header(request_id: str) -> tuple[bytes, bytes]:
    """The X-Request-Id header, as forwarded to the node and returned to the client."""
    return (b"x-request-id", request_id.encode("latin-1"))


def forward_headers(raw: list[tuple[bytes, bytes]], client_ip: str, request_id: str) -> list[tuple[bytes, bytes]]:
    """The client's headers as a reverse proxy forwards them: hop-by-hop ones (and those the
    Connection header names) removed, X-Forwarded-For extended, X-Request-Id set."""
    named = {token.strip().lower() for name, value in raw if name == b"connection" for token in value.split(b",")}
    headers = [(name, value) for name, value in raw if name not in _NOT_FORWARDED and name not in named]
    prior = [value for name, value in raw if name == b"x-forwarded-for"]
    forwarded_for = client_ip.encode()
    if prior:
        forwarded_for = b", ".join(prior) + b", " + forwarded_for
    headers.append((b"x-forwarded-for", forwarded_for))
    headers.append(request_id_header(request_id))
    return headers


class UpstreamTimeout(Exception):
    """A deadline of the attempt passed: retried on the next node, like a dial error."""


class ResponseBodyTimeout(Exception):
    """A non-streaming answer's body did not end by its deadline (`gateway.response_body_timeout`):
    not retried, as a body cut short is not (the node has answered)."""


COMMITTED = "committed"
"""An attempt whose answer is flowing to the client: the relay settles it when the body ends."""


class Outcome:
    """How one attempt ended.

    `kind` is the decision record's outcome (COMPLETED, RETRIED, FAILED, TRUNCATED, CLIENT_GONE)
    or COMMITTED. `status` is the node's, when it answered; `error` what went wrong; `reply` the
    client's answer when the attempt has one. `committed`: the client had the node's status and
    headers before the attempt ended.
    """

    __slots__ = ("kind", "status", "error", "reply", "committed")

    def __init__(
        self,
        kind: str,
        *,
        status: int | None = None,
        error: BaseException | str | None = None,
        reply: Reply | None = None,
        committed: bool = False,
    ) -> None:
        self.kind = kind
        self.status = status
        self.error = error
        self.reply = reply
        self.committed = committed


def _describe(error: BaseException | str | None) -> str:
    if error is None or isinstance(error, str):
        return error or ""
    text = str(error)
    return text if text else type(error).__name__


def _is_retryable(error: Exception) -> bool:
    """plinth's classification: dial errors and timeouts are retried; other failures are not."""
    return isinstance(error, (ConnectFailed, UpstreamTimeout))


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
        response_header_timeout: float = RESPONSE_HEADER_TIMEOUT,
        first_chunk_timeout: float = FIRST_CHUNK_TIMEOUT,
    ) -> None:
        self._control_plane = control_plane
        self._pool = pool
        self._metrics = metrics
        self._log = log
        self._decisions = decisions
        self._balancer = Balancer()
        self._unserved_warnings = Throttle(UNSERVED_WARNING_INTERVAL)
        self._response_header_timeout = response_header_timeout
        self._first_chunk_timeout = first_chunk_timeout

    async def forward(self, exchange: Exchange) -> Reply:
        """The response for the client: the node's (complete, or committed and still flowing) or an error."""
        route = exchange.route
        for reason, count in route.exclusion_counts:
            self._metrics.excluded(exchange.metric_model, reason, count)
        candidates = route.candidates
        if not candidates:
            if route.ring_pool:
                self._warn_unserved(exchange)
            return self._error(exchange, model_not_found(exchange.model) if route.unknown else NO_HEALTHY_NODE)
        tried: set[str] = set()
        try:
            for _ in range(len(candidates)):
                node = self._pick(exchange, tried)
                if node is None:
                    break
                tried.add(node.ip)
                outcome = await self._attempt(exchange, node)
                if outcome.kind == COMMITTED:
                    self._mark_online(node.ip)
                    return outcome.reply
                self._settle(exchange, node, outcome)
                if outcome.kind == FAILED:
                    return self._error(exchange, UPSTREAM_ERROR)
                if outcome.kind == COMPLETED:
                    self._finish(exchange, outcome.reply.status)
                    return outcome.reply
        except trio.Cancelled:
            # The client went away before anything was sent: no answer, no metrics (plinth).
            self._record(exchange, None)
            raise
        return self._error(exchange, NO_REACHABLE_NODE)

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

    def _pick(self, exchange: Exchange, tried: set[str]) -> NodeState | None:
        """The balancer's pick among the candidates not yet tried that are neither dead nor offline
        now (those are noted as the request's exclusions); None when there is none. The first
        pick is kept for the decision record, scored when there is one."""
        now = self._control_plane.now()
        available = []
        for node in exchange.route.candidates:
            if node.ip in tried:
                continue
            reason = unavailable_reason(node, now)
            if reason:
                exchange.skip(node.ip, reason)
            else:
                available.append(node)
        if not available:
            return None
        config = exchange.view.config
        rotation = self._balancer.rotation
        choice = self._balancer.select(
            available,
            exchange.policy,
            scored=config.decision_log,
            request_id=exchange.request_id,
            prefix=exchange.prefix,
            load_bound=config.load_bound,
        )
        if choice is None:
            return None
        if exchange.first_choice is None:
            exchange.first_choice = choice
            exchange.rotation = rotation
        self._metrics.picked(exchange.policy)
        return choice.node

    # --- one attempt

    async def _attempt(self, exchange: Exchange, node: NodeState) -> Outcome:
        port = exchange.view.config.ports[node.ip]
        target = _TARGETS[exchange.path]
        headers = exchange.headers
        authorization = exchange.view.config.upstream_authorizations.get(node.ip)
        if authorization is not None or exchange.view.config.api_key_digests:
            # The client's key is the gateway's (when it checks keys) and not the node's: it
            # goes no further, and the node's own key, if it has one, takes its place.
            headers = [header for header in headers if header[0] != b"authorization"]
            if authorization is not None:
                headers.append((b"authorization", authorization))
        upstream: UpstreamResponse | None = None
        exchange.attempt_started = time.perf_counter()
        self._metrics.node_attempt_started(node.ip)
        self._balancer.attempt_started(node.ip)
        try:
            with trio.move_on_after(self._response_header_timeout) as waiting:
                try:
                    upstream = await self._pool.request(
                        b"POST", node.ip, port, target, headers, exchange.body, connect_timeout=CONNECT_TIMEOUT
                    )
                except Exception as error:
                    return self._failed(exchange, error)
                if exchange.stream:
                    waiting.deadline = math.inf  # a stream's next deadline is its first chunk's
                    return await self._stream(exchange, node, upstream)
                # The same scope bounds the body: a second one would cost every request.
                waiting.deadline = trio.current_time() + exchange.view.config.response_body_timeout
                return await self._buffer(exchange, node, upstream, waiting.deadline)
            if upstream is None:
                return self._failed(exchange, UpstreamTimeout("timeout awaiting response headers"))
            upstream.close()
            return self._failed(exchange, ResponseBodyTimeout("timeout awaiting response body"))
        except BaseException as error:
            if upstream is not None:
                upstream.close()
            status = upstream.status if upstream else None
            if isinstance(error, trio.Cancelled):
                self._settle(exchange, node, Outcome(CLIENT_GONE, status=status))
            else:  # a fault of ours: the attempt still ends (its in-flight counts are released)
                self._settle(exchange, node, Outcome(FAILED, status=status, error=error))
            raise

    def _failed(self, exchange: Exchange, error: Exception) -> Outcome:
        """A failure before commit: the next node is tried (after any failure, for a stream;
        after plinth's retryable ones otherwise, and with `retry_unanswered` after a connection
        that broke before any byte of the response), or the request ends with a 502."""
        retried = (
            exchange.stream
            or _is_retryable(error)
            or (exchange.view.config.retry_unanswered and isinstance(error, (WriteFailed, LostBeforeResponse)))
        )
        return Outcome(RETRIED if retried else FAILED, error=error)

    async def _stream(self, exchange: Exchange, node: NodeState, upstream: UpstreamResponse) -> Outcome:
        """Streaming commit gate: hold the status and headers until the first body byte."""
        first = b""
        try:
            with trio.move_on_after(self._first_chunk_timeout) as deadline:
                first = await upstream.next_chunk()
        except Exception as error:
            return self._failed(exchange, error)
        if deadline.cancelled_caught:
            upstream.close()
            return self._failed(exchange, UpstreamTimeout("timed out waiting for first stream chunk"))
        if not first:
            # An empty body (a bodiless 201, say) is complete: commit it as it is.
            return self._complete(exchange, node, upstream, b"")
        return self._commit(exchange, node, upstream, [first])

    async def _buffer(
        self, exchange: Exchange, node: NodeState, upstream: UpstreamResponse, deadline: float
    ) -> Outcome:
        """Buffering commit gate: the whole response, unless it outgrows the buffer limit (then
        the rest is relayed by the same `deadline`)."""
        limit = exchange.view.config.buffer_limit
        declared = upstream.content_length
        if limit and declared is not None and declared > limit:
            return self._pass_through(exchange, node, upstream, [], "content_length", limit, deadline)
        buffered: list[bytes] = []
        size = 0
        try:
            while chunk := await upstream.next_chunk():
                buffered.append(chunk)
                size += len(chunk)
                if limit and size > limit:
                    return self._pass_through(exchange, node, upstream, buffered, "size_limit", limit, deadline)
        except Exception as error:
            return self._failed(exchange, error)
        body = buffered[0] if len(buffered) == 1 else b"".join(buffered)
        return self._complete(exchange, node, upstream, body)

    def _complete(self, exchange: Exchange, node: NodeState, upstream: UpstreamResponse, body: bytes) -> Outcome:
        headers = _client_headers(upstream, exchange, node, with_length=False)
        return Outcome(COMPLETED, status=upstream.status, reply=Reply(upstream.status, headers, body))

    def _pass_through(
        self,
        exchange: Exchange,
        node: NodeState,
        upstream: UpstreamResponse,
        buffered: list[bytes],
        reason: str,
        limit: int,
        deadline: float,
    ) -> Outcome:
        self._log.info("response exceeded buffer limit; passing through", node=node.ip, reason=reason, limit=limit)
        self._metrics.passthrough(exchange.metric_model, reason)
        return self._commit(exchange, node, upstream, buffered, deadline)

    def _commit(
        self,
        exchange: Exchange,
        node: NodeState,
        upstream: UpstreamResponse,
        first: list[bytes],
        deadline: float = math.inf,
    ) -> Outcome:
        """Send the status and headers now; the body flows chunk by chunk as the node sends it
        (until `deadline`, for a non-streaming answer)."""
        reply = Reply(upstream.status, _client_headers(upstream, exchange, node, with_length=True), b"")
        reply.body = self._relay(exchange, node, upstream, first, reply, deadline)
        return Outcome(COMMITTED, status=upstream.status, reply=reply)

    async def _relay(
        self,
        exchange: Exchange,
        node: NodeState,
        upstream: UpstreamResponse,
        first: list[bytes],
        reply: Reply,
        deadline: float,
    ) -> AsyncIterator[bytes]:
        """The committed body: `first`, then the rest as the node sends it. The client going
        away ends it early (the upstream connection is then closed at once, which cancels the
        generation on the node). So does a node failure, visibly: an event stream gets an error
        event last, and the reply is marked truncated, to be ended without its terminating chunk.
        A body not ended by `deadline` is such a failure."""
        outcome = Outcome(COMPLETED, status=upstream.status, committed=True)
        chunk = b""
        next_chunk = upstream.next_chunk
        if deadline != math.inf:
            next_chunk = functools.partial(_next_chunk_by, upstream, deadline)
        try:
            for chunk in first:
                yield chunk
            try:
                while chunk := await next_chunk():
                    yield chunk
            except Exception as error:
                outcome = Outcome(TRUNCATED, status=upstream.status, error=error, committed=True)
        except BaseException:  # trio.Cancelled or GeneratorExit: the client left
            outcome = Outcome(CLIENT_GONE, status=upstream.status, error="client disconnected", committed=True)
            raise
        finally:
            upstream.close()
            self._settle(exchange, node, outcome)
            self._finish(exchange, upstream.status)
        if outcome.kind == TRUNCATED:
            reply.truncated = True
            if (upstream.header(b"content-type") or b"").startswith(b"text/event-stream"):
                # `chunk` is the last piece relayed: an event it leaves unfinished is ended first.
                yield (b"" if chunk.endswith(b"\n\n") else b"\n\n") + _STREAM_ERROR_EVENT

    # --- bookkeeping

    def _settle(self, exchange: Exchange, node: NodeState, outcome: Outcome) -> None:
        """What an ended attempt leaves behind: its log line, its metrics, what the control plane
        learns about the node, and its entry in the decision record."""
        kind = outcome.kind
        error = _describe(outcome.error)
        if kind == RETRIED:
            if exchange.stream:
                self._log.info("retrying after streaming failure before first chunk", node=node.ip, error=error)
            else:
                self._log.info("retrying after connection failure", node=node.ip, error=error)
            self._metrics.retried(node.ip)
            self._mark_offline(node.ip, error)
        elif kind == FAILED:
            self._log.error("node response truncated or connection lost", node=node.ip, error=error)
            if isinstance(outcome.error, WriteFailed):
                self._mark_offline(node.ip, error)  # a stale keep-alive reset while sending
        elif kind == COMPLETED and not outcome.committed:
            self._mark_online(node.ip)
        elif kind == TRUNCATED:
            self._metrics.truncated(node.ip)
            if exchange.stream:
                self._log.error("stream terminated by upstream failure", node=node.ip, error=error)
            else:
                self._log.error("response truncated after commit", node=node.ip, error=error)
        elif kind == CLIENT_GONE and outcome.committed:
            self._log.error("client write failed after commit", node=node.ip, error=error)
            self._metrics.client_write_failure(exchange.metric_model)
        self._metrics.node_attempt_ended(node.ip)
        self._balancer.attempt_ended(node.ip)
        if kind != CLIENT_GONE or outcome.committed:  # a client gone before commit is not counted (plinth)
            status = outcome.status or 502
            self._metrics.attempt(exchange.metric_model, status)
            self._metrics.node_attempt(node.ip, status, time.perf_counter() - exchange.attempt_started)
        exchange.attempts.append(AttemptRecord(node.ip, kind, outcome.status, error))

    def _error(self, exchange: Exchange, error: ApiError) -> Reply:
        self._finish(exchange, error.status)
        return error_reply(error, request_id_header(exchange.request_id))

    def _finish(self, exchange: Exchange, status: int) -> None:
        """The request's one duration and status in the metrics, and its decision record."""
        self._metrics.request_done(exchange.metric_model, status, time.perf_counter() - exchange.started)
        self._record(exchange, status)

    def _record(self, exchange: Exchange, status: int | None) -> None:
        if self._decisions is None or not exchange.view.config.decision_log:
            return
        route = exchange.route
        choice = exchange.first_choice
        self._decisions.record(
            Decision(
                request_id=exchange.request_id,
                at=exchange.at,
                path=exchange.path,
                model=exchange.model,
                stream=exchange.stream,
                seq=exchange.view.snapshot.seq,
                ring=route.ring,
                ring_pool=route.ring_pool,
                excluded=route.excluded + tuple(exchange.skipped),
                attempts=tuple(exchange.attempts),
                status=status,
                duration=time.perf_counter() - exchange.started,
                policy=exchange.policy,
                prefix=exchange.prefix,
                rotation=exchange.rotation,
                candidates=choice.candidates if choice else (),
                margin=choice.margin if choice else None,
                remembered=choice.remembered if choice else "",
            )
        )

    def _mark_offline(self, ip: str, error: str) -> None:
        """Tell the control plane, unless the current snapshot already has the node offline."""
        now = self._control_plane.now()
        node = self._control_plane.snapshot.nodes.get(ip)
        if node is not None and not node.is_offline(now):
            self._control_plane.observe(UpstreamFailed(node=ip, error=error, at=now))

    def _mark_online(self, ip: str) -> None:
        """Tell the control plane the node answered, only if it is offline (not one event per request)."""
        now = self._control_plane.now()
        node = self._control_plane.snapshot.nodes.get(ip)
        if node is not None and node.is_offline(now):
            self._control_plane.observe(UpstreamRecovered(node=ip, at=now))


async def _next_chunk_by(upstream: UpstreamResponse, deadline: float) -> bytes:
    """The answer's next piece; ResponseBodyTimeout once `deadline` has passed."""
    with trio.move_on_at(deadline):
        return await upstream.next_chunk()
    raise ResponseBodyTimeout("timeout awaiting response body")


def _client_headers(upstream: UpstreamResponse, exchange: Exchange, node: NodeState, *, with_length: bool) -> Headers:
    """The node's headers (names lower-case) for the client, less those its Connection header
    names, with the request id and the node's name; a complete body is sent with its own
    Content-Length."""
    dropped = _NOT_RETURNED if with_length else _NOT_RETURNED_WITH_BODY
    if upstream.connection_options:
        dropped = dropped.union(upstream.connection_options)
    headers = [(name, value) for name, value in upstream.headers if name not in dropped]
    headers.append(request_id_header(exchange.request_id))
    headers.append(exchange.view.config.node_headers[node.ip])
    return headers

"""The data plane's Prometheus metrics (plinth §5) and the listener that serves `/metrics`.

Names, labels and help texts are plinth's (dashboards depend on them); the histogram uses Go's
DefBuckets. Interlock's own `interlock_node_*` series count each attempt by the node it went to
(a node's IP: configured nodes only, so the label stays bounded). Everything is registered on
the registry the control plane shares with us, never on prometheus_client's global default
registry. Labelled children are cached by their label values as the caller has them, so counting
on the request path is a dict lookup and an increment.
"""

from __future__ import annotations

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from quart import Response
from quart_trio import QuartTrio

from dataplane.prometheus_private import Observer, Value, value_of
from dataplane.quart_apps import new_quart_app

GO_DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
QUEUE_BUCKETS = (*GO_DEFAULT_BUCKETS, 30.0, 60.0)
"""Time in the admission queue: Go's buckets, and two for the longer `max_queue_seconds`."""


class RequestMetrics:
    """The per-request metrics of plinth's handler."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, help_text: str, *labels: str) -> _Children:
            return _Children(Counter(name, help_text, labels, registry=registry))

        self._duration = Observer(
            Histogram(
                "gateway_request_duration_seconds",
                "Request duration in seconds",
                buckets=GO_DEFAULT_BUCKETS,
                registry=registry,
            )
        )
        self._requests = counter("gateway_requests_total", "Total requests by model and status", "model", "status")
        self._path_requests = counter(
            "interlock_requests_total",
            "Requests by routed endpoint (one of vLLM's model-addressed paths) and status",
            "path",
            "status",
        )
        self._attempts = counter(
            "gateway_proxy_attempts_total", "Proxy attempts by model and observed status", "model", "status"
        )
        self._passthrough = counter(
            "gateway_response_passthrough_total",
            "Responses committed early and passed through to the client",
            "model",
            "reason",
        )
        self._client_write_failures = counter(
            "gateway_response_client_write_failures_total",
            "Committed responses whose write to the client failed",
            "model",
        )
        self._truncated = counter(
            "gateway_response_truncated_total",
            "Committed responses cut short by a node failure (ended without their last chunk)",
            "node",
        )
        self._exclusions = counter(
            "gateway_model_filter_exclusions_total",
            "Nodes dropped from the candidate pool by the model filter",
            "model",
            "reason",
        )
        self._node_requests = counter(
            "interlock_node_requests_total",
            "Proxy attempts by node and observed status (502: no answer)",
            "node",
            "status",
        )
        self._node_duration = _Children(
            Histogram(
                "interlock_node_request_duration_seconds",
                "Proxy attempt duration by node, from sending the request to the end of the response",
                ["node"],
                buckets=GO_DEFAULT_BUCKETS,
                registry=registry,
            )
        )
        self._node_retries = counter(
            "interlock_node_retries_total",
            "Attempts on a node that failed before anything was sent to the client, then tried on the next node",
            "node",
        )
        self._leg_attempts = counter(
            "interlock_disaggregated_attempts_total",
            "Attempts of prefill/decode-disaggregated requests, by leg (prefill, decode) and outcome",
            "leg",
            "outcome",
        )
        self._picks = counter(
            "interlock_routing_picks_total", "Nodes chosen for an attempt, by the routing policy that chose", "policy"
        )
        self._admitted = counter(
            "interlock_admission_requests_total",
            "Requests admitted, by tenant (the configured ones, gateway, default) and priority",
            "tenant",
            "priority",
        )
        self._admitted_tokens = counter(
            "interlock_admission_tokens_total",
            "Tokens (prompt plus completion, as the nodes reported them) of tenants with a token limit",
            "tenant",
            "priority",
        )
        self._refused = counter(
            "interlock_admission_refusals_total",
            "Requests refused, by tenant, priority and the limit that refused them (requests, tokens, in_flight; "
            "queue_full: 429, queue_deadline: 503)",
            "tenant",
            "priority",
            "limit",
        )
        # With `serve --workers N` each worker counts its own: the leader's /metrics sums the
        # workers alive (a dead worker's requests are no longer in flight).
        self._node_in_flight = _Children(
            Gauge(
                "interlock_node_requests_in_flight",
                "Proxy attempts in progress by node (streams included until their last chunk)",
                ["node"],
                multiprocess_mode="livesum",
                registry=registry,
            )
        )

        # The admission queue (`dataplane.admission.queue`), by tenant and priority: configured
        # names and priorities only, so bounded.
        self._queue_length = _Children(
            Gauge(
                "interlock_admission_queue_length",
                "Requests waiting in the gateway's admission queue, by tenant and priority",
                ["tenant", "priority"],
                multiprocess_mode="livesum",
                registry=registry,
            )
        )
        self._queue_seconds = _Children(
            Histogram(
                "interlock_admission_queue_seconds",
                "Time requests waited in the admission queue (released, refused or gone), by tenant and priority",
                ["tenant", "priority"],
                buckets=QUEUE_BUCKETS,
                registry=registry,
            )
        )

    def request_done(self, model: str, path: str, status: int, seconds: float) -> None:
        """A request's final outcome: its duration and its status, each recorded once; `path` is
        one of `dataplane.endpoints.ROUTED_PATHS` (the label stays bounded)."""
        self._duration.observe(seconds)
        self._requests(model, status).inc(1)
        self._path_requests(path, status).inc(1)

    def attempt(self, model: str, status: int) -> None:
        """One proxy attempt: the node's status, or 502 for an attempt that failed."""
        self._attempts(model, status).inc(1)

    def picked(self, policy: str) -> None:
        """A node chosen under `policy` (one of the config's POLICIES: the label stays bounded)."""
        self._picks(policy).inc(1)

    def node_attempt_started(self, node: str) -> None:
        self._node_in_flight(node).inc(1)

    def node_attempt_ended(self, node: str) -> None:
        """An attempt on `node` is over (whether or not it is counted: see `node_attempt`)."""
        self._node_in_flight(node).inc(-1)

    def node_attempt(self, node: str, status: int, seconds: float) -> None:
        """One attempt on `node` counted, as `attempt` counts it by model."""
        self._node_requests(node, status).inc(1)
        self._node_duration(node).observe(seconds)

    def leg_attempt(self, leg: str, outcome: str) -> None:
        """One attempt of a disaggregated request's `leg` ended with `outcome` (an AttemptOutcome)."""
        self._leg_attempts(leg, outcome).inc(1)

    def retried(self, node: str) -> None:
        self._node_retries(node).inc(1)

    def passthrough(self, model: str, reason: str) -> None:
        self._passthrough(model, reason).inc(1)

    def client_write_failure(self, model: str) -> None:
        self._client_write_failures(model).inc(1)

    def truncated(self, node: str) -> None:
        """A committed response cut short by node `node` (its IP: the label stays bounded by the config)."""
        self._truncated(node).inc(1)

    def admission_admitted(self, tenant: str, priority: int) -> None:
        """Labels from the config: a configured tenant's name and a configured priority."""
        self._admitted(tenant, priority).inc(1)

    def admission_tokens(self, tenant: str, priority: int, tokens: int) -> None:
        self._admitted_tokens(tenant, priority).inc(tokens)

    def admission_refused(self, tenant: str, priority: int, limit: str) -> None:
        self._refused(tenant, priority, limit).inc(1)

    def admission_queued(self, tenant: str, priority: int, change: int) -> None:
        """A request joined the admission queue (1) or left it (-1)."""
        self._queue_length(tenant, priority).inc(change)

    def admission_waited(self, tenant: str, priority: int, seconds: float) -> None:
        self._queue_seconds(tenant, priority).observe(seconds)

    def excluded(self, model: str, reason: str, count: int) -> None:
        """`count` nodes dropped by the model filter for `reason` (missing, empty or expired)."""
        self._exclusions(model, reason).inc(count)


class _Children:
    """A labelled metric's children by their label values as the caller has them (a status as
    an int): prometheus_client's own `.labels()` lookup validates and converts on every call.
    A counter's or gauge's child is kept as its value, a histogram's as its `Observer`
    (`dataplane.prometheus_private`: no checks repeated on each update)."""

    __slots__ = ("_metric", "_children")

    def __init__(self, metric: MetricWrapperBase) -> None:
        self._metric = metric
        self._children: dict[tuple, Value | Observer] = {}

    def __call__(self, *labels: str | int) -> Value | Observer:
        child = self._children.get(labels)
        if child is None:
            labelled = self._metric.labels(*(str(label) for label in labels))
            child = Observer(labelled) if isinstance(labelled, Histogram) else value_of(labelled)
            self._children[labels] = child
        return child


def metrics_app(registry: CollectorRegistry) -> QuartTrio:
    """The second listener's app: `/metrics` only (plinth serves nothing else there).

    The page is rendered in a worker thread (the client library is thread-safe): a big page
    must not hold up the API on the event loop."""
    app = new_quart_app(__name__)

    @app.get("/metrics")
    async def metrics() -> Response:
        page = await trio.to_thread.run_sync(generate_latest, registry)
        return Response(page, content_type=CONTENT_TYPE_LATEST)

    return app

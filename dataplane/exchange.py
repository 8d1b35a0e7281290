"""A completion request as the proxy takes it, and how one of its attempts ended: plain data."""

from __future__ import annotations

from dataplane.headers import Headers
from dataplane.views import SnapshotView
from events.config import DEFAULT_TENANT
from events.decisions import AttemptOutcome


class Exchange:
    """A completion request past its body checks (`dataplane.asgi`), on its way to a node."""

    __slots__ = ("request_id", "path", "model", "alias", "stream", "body", "headers", "view", "at", "started", "tenant")

    def __init__(
        self,
        *,
        request_id: str,
        path: str,
        model: str,
        stream: bool,
        body: bytes,
        headers: Headers,
        view: SnapshotView,
        at: float,
        started: float,
        alias: str = "",
        tenant: str = DEFAULT_TENANT,
    ) -> None:
        self.request_id = request_id
        self.path = path
        self.model = model
        """The model it is routed and forwarded as (an alias's target)."""
        self.alias = alias
        """The alias the client named, when it named one (`ModelEntry.target`); else ""."""
        self.stream = stream
        self.body = body
        """As the client sent it (with the default model, or an alias's target, set in it); never
        changed: what admission writes into it is `Admitted.body`, the legs' bodies are made
        from that (`dataplane.disaggregation`)."""
        self.headers = headers
        """As forwarded (`headers.forward_headers`)."""
        self.view = view
        """The snapshot it arrived on: admission's; it is routed on it too, unless it waited in
        the queue (then on the one current when it left, `Admitted.view`, its ledger's)."""
        self.at = at
        """When it arrived, on the control plane's clock."""
        self.started = started
        """When it arrived, on `time.perf_counter` (its duration's start)."""
        self.tenant = tenant
        """The tenant its key belongs to (`dataplane.access.key_tenant`)."""


class Outcome:
    """How one attempt ended: `kind` is the decision record's outcome; `status` is the node's,
    when it answered; `error` what went wrong; `committed`: the client had the node's status and
    headers before the attempt ended."""

    __slots__ = ("kind", "status", "error", "committed")

    def __init__(
        self,
        kind: AttemptOutcome,
        *,
        status: int | None = None,
        error: BaseException | str | None = None,
        committed: bool = False,
    ) -> None:
        self.kind = kind
        self.status = status
        self.error = error
        self.committed = committed


class UpstreamTimeout(Exception):
    """An attempt's node did not answer by a deadline (`UpstreamTimeouts`): a slow node, not one
    that is down, so it is not marked offline; retried as an unanswered request is."""

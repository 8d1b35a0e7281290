"""The finish stage of the request path: the client's reply and the request's end, whatever the
stages before returned or raised.

A node's complete answer settles the tenant's tokens to its usage; it, a stage's refusal, or the
gateway's 502 for anything a stage raised ends the request in its ledger (`request_ended`: the
metrics, the tenant's limits' places given back, the decision record), once. A committed body is
ended by its relay when it stops (`dataplane.relay`); a client that leaves before anything was
sent by `client_left`. A limited tenant's every answer carries its `x-ratelimit-*` headers.
"""

from __future__ import annotations

from controlplane.infrastructure.logs import JsonLog, clipped
from dataplane.errors import UPSTREAM_ERROR, Refusal, Reply, error_reply
from dataplane.headers import request_id_header
from dataplane.ledger import Ledger


class Finish:
    """The stage."""

    def __init__(self, log: JsonLog) -> None:
        self._log = log

    def reply(self, ledger: Ledger, result: Reply | Refusal) -> Reply:
        """The reply to send for `result`; the request ends here unless its body flows (its
        relay ends it)."""
        if isinstance(result, Refusal):
            reply = result.reply
            ledger.request_ended(reply.status)
        else:
            reply = result
            if isinstance(reply.body, bytes):
                if ledger.ticket.tenant.counts_tokens:
                    ledger.ticket.read_usage(reply.body)
                ledger.request_ended(reply.status)
        return _with_limits_headers(ledger, reply)

    def failed(self, ledger: Ledger, error: Exception) -> Reply:
        """A stage raised `error` before anything was sent: the gateway's 502, and the request's
        end (unless it ended before the fault)."""
        request_id = ledger.exchange.request_id
        self._log.error(
            "request failed in the gateway", request_id=clipped(request_id), error=clipped(f"{type(error).__name__}: {error}", 512)
        )
        reply = error_reply(UPSTREAM_ERROR, request_id_header(request_id))
        if not ledger.ended:
            ledger.request_ended(reply.status)
        return _with_limits_headers(ledger, reply)

    def client_left(self, ledger: Ledger) -> None:
        """The client went away before anything was sent."""
        if not ledger.ended:
            ledger.client_left()


def _with_limits_headers(ledger: Ledger, reply: Reply) -> Reply:
    """`reply` with the tenant's `x-ratelimit-*` headers, when its limits give any."""
    headers = ledger.ticket.headers
    if headers:
        reply.headers += headers
    return reply

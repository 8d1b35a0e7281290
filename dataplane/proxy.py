"""Forwarding a completion request to a node: the request path as four stages.

`Proxy.forward` takes a request (`Exchange`) once and passes it through the stages in order,
each in its own module and each returning a value to it:

1. admission (`dataplane.admission.admit`): its tenant's limits, then the gateway's queue while
   its model's pool has no room: `Admitted` (the snapshot to route on, the body to forward) or
   a `Refusal`;
2. planning (`dataplane.planning`): its books on that snapshot (`Ledger`: route, policy, prompt
   prefix), then the legs to attempt: a `Plan` or a `Refusal`; under `kv_aware`, then the
   prompt's blocks each candidate holds (`Planning.match`: the one stage that waits, for the
   prompt's tokens);
3. attempts (`dataplane.attempts`): one loop for every leg (pick, send, relay): the client's
   reply, complete or committed and flowing (`dataplane.relay`), or a `Refusal`;
4. finish (`dataplane.finish`): the reply, and the request's end in its books.

Whatever a stage raises ends the request as the finish stage says (a 502 in the gateway's
shape, the record written, the tenant's places given back); a cancellation (the client gone)
ends it as one that left. The parts are built by the composition root (`interlock.serve`).
"""

from __future__ import annotations

import trio

from controlplane.rules.policies import KV_AWARE
from dataplane.admission.admit import Admission
from dataplane.attempts import Attempts
from dataplane.errors import Refusal, Reply
from dataplane.exchange import Exchange
from dataplane.finish import Finish
from dataplane.planning import Planning


class Proxy:
    """The stages of the request path, in order."""

    def __init__(self, admission: Admission, planning: Planning, attempts: Attempts, finish: Finish) -> None:
        self._admission = admission
        self._planning = planning
        self._attempts = attempts
        self._finish = finish

    def end_streams(self) -> None:
        """End every body still flowing, now (the shutdown grace is over)."""
        self._attempts.end_streams()

    async def forward(self, exchange: Exchange) -> Reply:
        """The response for the client: the node's (complete, or committed and still flowing) or
        the gateway's."""
        ticket = self._admission.ticket(exchange)
        ledger = self._planning.open(exchange, exchange.view, ticket)
        finish = self._finish
        try:
            admitted = await self._admission.admit(exchange, ticket, bool(ledger.route.candidates))
            if isinstance(admitted, Refusal):
                return finish.reply(ledger, admitted)
            if admitted.view is not ledger.view:  # it waited in the queue: routed on the snapshot of now
                ledger = self._planning.open(exchange, admitted.view, ticket)
            plan = self._planning.plan(ledger, admitted.body)
            if isinstance(plan, Refusal):
                return finish.reply(ledger, plan)
            if ledger.policy == KV_AWARE:
                await self._planning.match(ledger, plan)
            return finish.reply(ledger, await self._attempts.run(ledger, plan))
        except trio.Cancelled:
            finish.client_left(ledger)
            raise
        except Exception as error:
            return finish.failed(ledger, error)

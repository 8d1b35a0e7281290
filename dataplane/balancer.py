"""Choosing the node for each attempt: plinth's round-robin counter (§3), one for every model and
every retry, and the policies of `controlplane.policies`, fed with this process's in-flight counts
and, for prefix affinity, the node each prefix last went to."""

from __future__ import annotations

from collections.abc import Sequence

from controlplane.policies import PREFIX_AFFINITY, ROUND_ROBIN, Choice, PrefixMemory, choose
from controlplane.routing import balancer_pool
from events.state import NodeState


class Balancer:
    """Picks from the healthy candidates (else the degraded ones) under a request's policy.

    The counter starts at 0 and advances on every pick from a non-empty pool, whatever the
    policy (round robin, and the ties of the others, follow it). `in_flight` counts the attempts
    this process has in progress to each node; the proxy keeps it. `prefixes` remembers where
    prefix affinity sent each prefix last (retries included). The data plane runs in one trio
    thread, so none of them needs a lock.
    """

    def __init__(self) -> None:
        self.rotation = 0
        """The counter the next pick is made with."""
        self.in_flight: dict[str, int] = {}
        self.prefixes = PrefixMemory()

    def select(
        self,
        candidates: Sequence[NodeState],
        policy: str,
        *,
        scored: bool,
        request_id: str = "",
        prefix: str = "",
        load_bound: float = 1.25,
    ) -> Choice | None:
        """The chosen node with every candidate's score (`scored`, or any policy but round robin;
        round robin unscored is plinth's pick and nothing more), or None when no candidate is
        healthy or degraded (plinth's ErrNoHealthyNode)."""
        pool = balancer_pool(candidates)
        if not pool:
            return None
        rotation = self.rotation
        self.rotation += 1
        if policy == ROUND_ROBIN and not scored:
            return Choice(pool[rotation % len(pool)], (), None)
        affine = policy == PREFIX_AFFINITY and bool(prefix)
        choice = choose(
            policy,
            pool,
            rotation=rotation,
            in_flight=self.in_flight,
            request_id=request_id,
            prefix=prefix,
            load_bound=load_bound,
            remembered=self.prefixes.node_of(prefix) if affine else "",
        )
        if affine:
            self.prefixes.remember(prefix, choice.node.ip)
        return choice

    def attempt_started(self, ip: str) -> None:
        self.in_flight[ip] = self.in_flight.get(ip, 0) + 1

    def attempt_ended(self, ip: str) -> None:
        left = self.in_flight[ip] - 1
        if left:
            self.in_flight[ip] = left
        else:
            del self.in_flight[ip]

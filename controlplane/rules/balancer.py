"""Choosing the node for each pick: plinth's round-robin counter (§3), one for every model and
every retry, and the policies of `controlplane.rules.policies`, fed with the routing process's in-flight
counts and, for prefix affinity, the node each prefix last went to. The data plane picks with
`Balancer.select`; `interlock whatif` with `Balancer.choose`, the same code fed with a record's
inputs or the what-if world's."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from controlplane.rules.policies import KV_AWARE, PREFIX_AFFINITY, ROUND_ROBIN, Choice, PrefixMemory, choose
from events.config import Policy
from events.decisions import KvBlocks
from events.state import NodeState


class Balancer:
    """Picks from a pool (`routing.pick_pool`) under a request's policy.

    The counter starts at 0 and advances on every pick, whatever the policy (round robin, and
    the ties of the others, follow it). `in_flight` counts the attempts this process has in
    progress to each node (the data plane's `Occupancy` keeps it). `prefixes` remembers where prefix
    affinity (and kv_aware) sent each prefix last (retries included). The data plane runs in one trio thread,
    so none of them needs a lock.
    """

    def __init__(self, in_flight: dict[str, int] | None = None) -> None:
        self.rotation = 0
        """The counter the next pick is made with."""
        self.in_flight: dict[str, int] = {} if in_flight is None else in_flight
        """The routing process's counts when given (the prefill leg of disaggregated requests
        has a balancer of its own, with its own counter and prefix memory: a prefix's KV cache is
        on the prefill node, weighing the same attempts)."""
        self.prefixes = PrefixMemory()

    def select(
        self,
        pool: Sequence[NodeState],
        policy: Policy,
        *,
        scored: bool,
        request_id: str,
        prefix: str,
        load_bound: float,
        adapter: str = "",
        full: Collection[str] = (),
        matches: Mapping[str, KvBlocks] = {},
    ) -> Choice:
        """The data plane's pick from `pool` (not empty), with every candidate's score (`scored`,
        any policy but round robin, a LoRA `adapter`'s affinity, or nodes `full` for the request;
        round robin unscored is plinth's pick and nothing more)."""
        rotation = self.rotation
        self.rotation += 1
        if policy == ROUND_ROBIN and not scored and not adapter and not full:
            return Choice(pool[rotation % len(pool)], (), None)
        return self.choose(
            pool,
            policy,
            rotation=rotation,
            in_flight=self.in_flight,
            request_id=request_id,
            prefix=prefix,
            load_bound=load_bound,
            adapter=adapter,
            full=full,
            matches=matches,
        )

    def choose(
        self,
        pool: Sequence[NodeState],
        policy: Policy,
        *,
        rotation: int,
        in_flight: Mapping[str, int],
        request_id: str,
        prefix: str,
        load_bound: float,
        remembered: str | None = None,
        adapter: str = "",
        full: Collection[str] = (),
        matches: Mapping[str, KvBlocks] = {},
    ) -> Choice:
        """`policy`'s choice from `pool` (not empty), scored, with a LoRA `adapter`'s affinity
        when given, passing over the nodes `full` for the request while another has room, with the
        prompt's blocks each node holds (`matches`, kv_aware's). Prefix affinity and kv_aware
        start from the node the prefix last went to (`remembered` when given: a recorded pick's),
        and remember the one they chose."""
        affine = policy in (PREFIX_AFFINITY, KV_AWARE) and bool(prefix)
        if remembered is None:
            remembered = self.prefixes.node_of(prefix) if affine else ""
        choice = choose(
            policy,
            pool,
            rotation=rotation,
            in_flight=in_flight,
            request_id=request_id,
            prefix=prefix,
            load_bound=load_bound,
            remembered=remembered,
            adapter=adapter,
            full=full,
            matches=matches,
        )
        if affine:
            self.prefixes.remember(prefix, choice.node.ip)
        return choice

"""Tenants' quota: the buckets that hold it (the authority) and how a process takes from them.

Each limited tenant has a bucket per limit (`REQUESTS`, `TOKENS`, `IN_FLIGHT`). The per-minute
limits refill continuously (a token bucket: full at the start, `limit / 60` a second, never
above the limit); the in-flight limit does not refill, a slot is given back when its request
ends. Tokens may go into debt: a request is admitted while the bucket holds any, its whole
reservation is taken, and the settlement to the node's `usage` gives back or takes the
difference, so the count over a minute follows what the nodes reported.

The authority (`Buckets`) lives in one process: the gateway itself, or the leader of `serve
--workers`. A gateway alone takes from it directly (`LocalQuota`); a worker takes quota in
blocks (`LeasedQuota`: a lease is the limit over LEASE_FRACTION), asked up its socketpair
(`QuotaAsk`), granted down it (`QuotaGrant`), and gives back what it has not used after
LEASE_SECONDS (`QuotaReturn`), so that there is no message per request.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import msgspec
import trio

REQUESTS, TOKENS, IN_FLIGHT = "requests", "tokens", "in_flight"
LIMITS = (REQUESTS, TOKENS, IN_FLIGHT)
"""A tenant's limits, as refusals and metrics name them."""

LEASE_FRACTION = 20
"""A worker's lease is the limit divided by this (at least one)."""
LEASE_SECONDS = 2.0
"""Quota a worker holds unused this long after its last grant goes back to the leader."""
LEASE_WAIT_SECONDS = 1.0
"""How long a request waits for its worker's lease. A leader that does not answer by then does
not hold the request: it is admitted, and the quota it took is owed (taken at the next grant)."""


class LimitState(msgspec.Struct, frozen=True):
    """One limit of one tenant as the authority last saw it: the limit, what is left of it, and
    the seconds until it is whole again (`reset`) and until one more unit is there (`retry`)."""

    limit: int
    remaining: int
    reset: float
    retry: float


class Bucket:
    """One limit of one tenant at the authority."""

    __slots__ = ("capacity", "per_second", "level", "updated")

    def __init__(self, capacity: int, per_second: float, now: float) -> None:
        self.capacity = capacity
        self.per_second = per_second
        self.level = float(capacity)
        self.updated = now

    def refill(self, now: float) -> None:
        if self.per_second and self.level < self.capacity:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.per_second)
        self.updated = now

    def resize(self, capacity: int, per_second: float, now: float) -> None:
        """A reload's new limit: what was used stays used."""
        self.refill(now)
        self.level = capacity - (self.capacity - self.level)
        self.capacity = capacity
        self.per_second = per_second

    def state(self, now: float) -> LimitState:
        self.refill(now)
        missing = self.capacity - self.level
        if not self.per_second:
            return LimitState(self.capacity, max(0, math.floor(self.level)), 0.0, 0.0 if self.level >= 1 else 1.0)
        need = max(0.0, (1 if self.level < 1 else 0) - self.level)
        return LimitState(
            self.capacity, max(0, math.floor(self.level)), missing / self.per_second, need / self.per_second
        )


def _per_second(limit: str, capacity: int) -> float:
    return 0.0 if limit == IN_FLIGHT else capacity / 60


def can_take(limit: str, available: float, amount: int) -> bool:
    """Whether `amount` may be taken from `available`: tokens while any are left (the rest
    becomes debt), requests and in-flight slots whole."""
    return available > 0 if limit == TOKENS else available >= amount


class Buckets:
    """The authority: every limited tenant's buckets, by tenant name and limit."""

    def __init__(self) -> None:
        self._buckets: dict[tuple[str, str], Bucket] = {}
        self._limits: object = None

    def configure(self, limits: dict[tuple[str, str], int], now: float) -> None:
        """The limits in force (`TenantLimits.quota_limits`): new buckets start full, changed
        ones keep what was used, those of tenants no longer limited go."""
        if limits is self._limits:
            return
        self._limits = limits
        kept = {}
        for key, capacity in limits.items():
            bucket = self._buckets.get(key)
            per_second = _per_second(key[1], capacity)
            if bucket is None:
                bucket = Bucket(capacity, per_second, now)
            elif bucket.capacity != capacity:
                bucket.resize(capacity, per_second, now)
            kept[key] = bucket
        self._buckets = kept

    def take(self, tenant: str, limit: str, amount: int, now: float) -> LimitState | None:
        """Take `amount`: None when taken, else the limit's state (refused)."""
        bucket = self._buckets.get((tenant, limit))
        if bucket is None:
            return None
        bucket.refill(now)
        if not can_take(limit, bucket.level, amount):
            return bucket.state(now)
        bucket.level -= amount
        return None

    def grant(self, tenant: str, limit: str, amount: int, now: float) -> int:
        """A lease: as much of `amount` as there is (whole units), taken."""
        bucket = self._buckets.get((tenant, limit))
        if bucket is None:
            return amount
        bucket.refill(now)
        granted = max(0, min(amount, math.floor(bucket.level)))
        bucket.level -= granted
        return granted

    def give(self, tenant: str, limit: str, amount: float, now: float) -> None:
        """Give back `amount` (negative: take it, a debt settled)."""
        bucket = self._buckets.get((tenant, limit))
        if bucket is not None:
            bucket.refill(now)
            bucket.level = min(bucket.capacity, bucket.level + amount)

    def state(self, tenant: str, limit: str, now: float) -> LimitState | None:
        bucket = self._buckets.get((tenant, limit))
        return None if bucket is None else bucket.state(now)


class Quota(Protocol):
    """How the data plane takes quota: from the authority in this process, or leased from the leader."""

    def configure(self, limits: dict[tuple[str, str], int]) -> None: ...

    async def take(self, tenant: str, limit: str, amount: int) -> LimitState | None:
        """None when taken, else the limit's state (refused)."""

    def give(self, tenant: str, limit: str, amount: float) -> None: ...

    def state(self, tenant: str, limit: str) -> LimitState | None:
        """The limit's state as this process knows it (for the `x-ratelimit-*` headers)."""


class LocalQuota:
    """A gateway without workers: the authority is here."""

    def __init__(self, buckets: Buckets | None = None) -> None:
        self.buckets = buckets or Buckets()

    def configure(self, limits: dict[tuple[str, str], int]) -> None:
        self.buckets.configure(limits, trio.current_time())

    async def take(self, tenant: str, limit: str, amount: int) -> LimitState | None:
        return self.buckets.take(tenant, limit, amount, trio.current_time())

    def give(self, tenant: str, limit: str, amount: float) -> None:
        self.buckets.give(tenant, limit, amount, trio.current_time())

    def state(self, tenant: str, limit: str) -> LimitState | None:
        return self.buckets.state(tenant, limit, trio.current_time())


# --- leases: a worker's quota, taken from its leader in blocks


class QuotaAsk(msgspec.Struct, frozen=True, tag="quota_ask", tag_field="type"):
    """A worker asks its leader for `amount` of a tenant's limit."""

    tenant: str
    limit: str
    amount: int


class QuotaReturn(msgspec.Struct, frozen=True, tag="quota_return", tag_field="type"):
    """A worker gives back what it holds unused (negative: what it owes)."""

    tenant: str
    limit: str
    amount: float


class QuotaGrant(msgspec.Struct, frozen=True, tag="quota_grant", tag_field="type"):
    """The leader's answer to a `QuotaAsk`: what it granted, and the limit's state after it."""

    tenant: str
    limit: str
    granted: int
    state: LimitState


def lease_block(capacity: int) -> int:
    return max(1, math.ceil(capacity / LEASE_FRACTION))


class _Lease:
    __slots__ = ("held", "asking", "granted_at", "state", "empty_until", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0.0
        """Quota in hand; negative: owed to the leader."""
        self.asking: trio.Event | None = None
        self.granted_at = 0.0
        self.state: LimitState | None = None
        """The leader's state at its last grant."""
        self.empty_until = 0.0
        """Until when the leader had nothing left to grant: refused here without asking."""


class LeasedQuota:
    """A worker's quota: leases from the leader's `Buckets`, asked and returned through `send`
    (the worker's reports), granted through `granted` (called for each `QuotaGrant`)."""

    def __init__(self, send: Callable[[QuotaAsk | QuotaReturn], None]) -> None:
        self._send = send
        self._leases: dict[tuple[str, str], _Lease] = {}
        self._limits: object = None

    def configure(self, limits: dict[tuple[str, str], int]) -> None:
        if limits is self._limits:
            return
        self._limits = limits
        leases = {}
        for key, capacity in limits.items():
            lease = self._leases.get(key) or _Lease(capacity)
            lease.capacity = capacity
            leases[key] = lease
        self._leases = leases

    async def take(self, tenant: str, limit: str, amount: int) -> LimitState | None:
        lease = self._leases.get((tenant, limit))
        if lease is None:
            return None
        while True:
            if can_take(limit, lease.held, amount):
                lease.held -= amount
                return None
            now = trio.current_time()
            if now < lease.empty_until and lease.state is not None:
                return lease.state
            if lease.asking is None:
                lease.asking = trio.Event()
                ask = max(lease_block(lease.capacity), amount) - math.floor(lease.held)
                self._send(QuotaAsk(tenant=tenant, limit=limit, amount=ask))
            asking = lease.asking
            with trio.move_on_after(LEASE_WAIT_SECONDS):
                await asking.wait()
            if not asking.is_set():
                if lease.asking is asking:
                    lease.asking = None
                lease.held -= amount  # the leader did not answer in time: admitted, owed
                return None
            # Granted: take from it, or (another request took it first) ask again, unless the
            # leader had nothing left (`empty_until`).

    def granted(self, grant: QuotaGrant) -> None:
        lease = self._leases.get((grant.tenant, grant.limit))
        if lease is None:
            if grant.granted:  # the tenant's limit went away meanwhile: the quota goes back
                self._send(QuotaReturn(tenant=grant.tenant, limit=grant.limit, amount=grant.granted))
            return
        now = trio.current_time()
        lease.held += grant.granted
        lease.granted_at = now
        lease.state = grant.state
        lease.empty_until = now + grant.state.retry if grant.granted == 0 else 0.0
        if lease.asking is not None:
            lease.asking.set()
            lease.asking = None

    def give(self, tenant: str, limit: str, amount: float) -> None:
        lease = self._leases.get((tenant, limit))
        if lease is not None:
            lease.held += amount

    def state(self, tenant: str, limit: str) -> LimitState | None:
        lease = self._leases.get((tenant, limit))
        if lease is None or lease.state is None:
            return None
        state = lease.state
        return LimitState(state.limit, state.remaining + max(0, math.floor(lease.held)), state.reset, state.retry)

    async def return_unused(self) -> None:
        """Give back what each lease has held unused since its last grant for LEASE_SECONDS (a
        debt is settled the same way), looking a few times per LEASE_SECONDS."""
        while True:
            await trio.sleep(LEASE_SECONDS / 4)
            now = trio.current_time()
            for (tenant, limit), lease in self._leases.items():
                if lease.held and lease.asking is None and now - lease.granted_at >= LEASE_SECONDS:
                    self._send(QuotaReturn(tenant=tenant, limit=limit, amount=lease.held))
                    lease.held = 0.0


class LeaseAuthority:
    """The leader's side of the leases: its `Buckets` under the config in force, and what each
    worker holds of the in-flight limits (given back when the worker exits)."""

    def __init__(self, limits: Callable[[], dict[tuple[str, str], int]]) -> None:
        self.buckets = Buckets()
        self._limits = limits
        self._in_flight_held: dict[int, dict[tuple[str, str], float]] = {}

    def ask(self, worker: int, ask: QuotaAsk) -> QuotaGrant:
        now = trio.current_time()
        self.buckets.configure(self._limits(), now)
        granted = self.buckets.grant(ask.tenant, ask.limit, ask.amount, now)
        if ask.limit == IN_FLIGHT:
            held = self._in_flight_held.setdefault(worker, {})
            held[(ask.tenant, ask.limit)] = held.get((ask.tenant, ask.limit), 0) + granted
        state = self.buckets.state(ask.tenant, ask.limit, now) or LimitState(ask.amount, ask.amount, 0.0, 0.0)
        return QuotaGrant(tenant=ask.tenant, limit=ask.limit, granted=granted, state=state)

    def returned(self, worker: int, given: QuotaReturn) -> None:
        now = trio.current_time()
        self.buckets.configure(self._limits(), now)
        self.buckets.give(given.tenant, given.limit, given.amount, now)
        if given.limit == IN_FLIGHT:
            held = self._in_flight_held.setdefault(worker, {})
            held[(given.tenant, given.limit)] = held.get((given.tenant, given.limit), 0) - given.amount

    def worker_gone(self, worker: int) -> None:
        """A worker exited: the in-flight slots it held are free again (its requests are gone)."""
        now = trio.current_time()
        for (tenant, limit), amount in self._in_flight_held.pop(worker, {}).items():
            self.buckets.give(tenant, limit, amount, now)

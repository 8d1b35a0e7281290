"""A config's tenants as requests need them (`[[tenants]]`, `[gateway]`'s keys, the keyless
`default`), computed once per config (`dataplane.views.ConfigView`)."""

from __future__ import annotations

from dataplane.admission.quota import IN_FLIGHT, REQUESTS, TOKENS
from events.config import DEFAULT_TENANT, GATEWAY_TENANT, Config, TenantConfig


class TenantView:
    """One tenant as requests need it."""

    __slots__ = (
        "name", "priority", "requests_per_minute", "tokens_per_minute", "max_in_flight", "max_queue_seconds",
        "limited", "counts_tokens",
    )  # fmt: skip

    def __init__(self, tenant: TenantConfig) -> None:
        self.name = tenant.name
        self.priority = tenant.priority
        self.requests_per_minute = tenant.requests_per_minute
        self.tokens_per_minute = tenant.tokens_per_minute
        self.max_in_flight = tenant.max_in_flight
        self.max_queue_seconds = tenant.max_queue_seconds
        self.counts_tokens = tenant.tokens_per_minute is not None
        self.limited = any(limit is not None for _, limit in self.limits())

    def limits(self) -> tuple[tuple[str, int | None], ...]:
        """Each limit (in the order admission checks them) and its value (None: none)."""
        return (
            (REQUESTS, self.requests_per_minute),
            (TOKENS, self.tokens_per_minute),
            (IN_FLIGHT, self.max_in_flight),
        )


class TenantLimits:
    """What requests need of a config's tenants, computed once per config (`ConfigView`)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.key_digests: tuple[tuple[bytes, str], ...] = tuple(
            [(digest.encode(), GATEWAY_TENANT) for digest in config.gateway.api_key_hashes]
            + [(digest.encode(), tenant.name) for tenant in config.tenants for digest in tenant.api_key_hashes]
        )
        """Every accepted key's digest with its tenant; () when every request is DEFAULT_TENANT."""
        self.tenants = {tenant.name: TenantView(tenant) for tenant in config.tenants}
        for name in (GATEWAY_TENANT, DEFAULT_TENANT):
            self.tenants.setdefault(name, TenantView(TenantConfig(name=name)))
        self.objectives = dict(config.admission.objectives)
        self.default_max_tokens = config.admission.default_max_tokens
        self.quota_limits = {
            (tenant.name, limit): value
            for tenant in self.tenants.values()
            for limit, value in tenant.limits()
            if value is not None
        }
        """Every limited tenant's limits, by (tenant, limit): what the quota's buckets hold."""

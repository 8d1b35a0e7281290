"""`interlock check-config`'s summary of a loaded config."""

from __future__ import annotations

from controlplane.infrastructure.gocompat import format_go_seconds
from events.config import Config, GatewayConfig, ModelEntry


def _describe_log(gateway: GatewayConfig, key: str) -> str:
    """`gateway.<key>` (a log) with its segment size and retention, as `check-config` shows it."""
    path = getattr(gateway, key)
    if not path:
        return "none"
    kept = []
    if retain_bytes := getattr(gateway, f"{key}_retain_bytes"):
        kept.append(f"up to {_size_text(retain_bytes)}")
    if retain_age := getattr(gateway, f"{key}_retain_age"):
        kept.append(f"for {format_go_seconds(retain_age)}")
    retention = f", keeping {' and '.join(kept)}" if kept else ", kept without bound"
    return f"{path} (segments of {_size_text(getattr(gateway, f'{key}_max_bytes'))}{retention})"


def _timeouts_text(config: Config, model: str) -> str:
    """The upstream timeouts `model` is served with ("": a model without its own)."""
    timeouts = config.upstream_timeouts(model)
    return (
        f"connect {format_go_seconds(timeouts.connect)}, first byte {format_go_seconds(timeouts.first_byte)}, "
        f"response {format_go_seconds(timeouts.response)}"
    )


def describe_config(config: Config) -> str:
    """A short summary of a loaded config, for `interlock check-config`."""
    gateway = config.gateway
    lines = [
        f"cluster: {config.cluster.name or '(unnamed)'}",
        f"listen: {gateway.listen} (metrics {gateway.metrics_listen})",
        f"health: every {format_go_seconds(gateway.health_interval)}, "
        f"dead after {gateway.health_fail_threshold} consecutive failures, "
        f"probe timeout {format_go_seconds(gateway.probe_timeout)}",
        f"nodes ({len(config.nodes)}):",
    ]
    for node in config.nodes:
        ring = f"ring {node.ring}" if node.ring else "standalone"
        limit = f"  at most {node.max_in_flight} in flight" if node.max_in_flight is not None else ""
        lines.append(f"  {node.name or '(unnamed)'}  {node.ip}:{node.vllm_port}  {ring}{limit}")
    default_model = config.models.default or "(none)"
    lines.append(f"models ({len(config.models.available)}), default {default_model}:")
    for model in config.models.available:
        if model.target:
            lines.append(f"  {model.name}  alias of {model.target}")
            continue
        ring = f"ring {model.ring}" if model.ring else "standalone"
        policy = f"  policy {model.policy}" if model.policy else ""
        own = (model.connect_timeout, model.first_byte_timeout, model.response_timeout) != (None, None, None)
        timeouts = f"  timeouts {_timeouts_text(config, model.name)}" if own else ""
        lines.append(f"  {model.name}  {ring}{policy}{timeouts}{_tokenizer_text(config, model)}")
    lines.append(f"timeouts: {_timeouts_text(config, '')}")
    lines.append(_describe_routing(config))
    lines.append(_describe_admission(config))
    for key, what in (("event_log", "event log"), ("decision_log", "decision log")):
        lines.append(f"{what}: {_describe_log(gateway, key)}")
    tenant_keys = sum(len(tenant.api_key_hashes) for tenant in config.tenants)
    if gateway.api_key_hashes or tenant_keys:
        health = "needs one too" if gateway.health_requires_api_key else "stays open"
        accepted = f"{len(gateway.api_key_hashes) + tenant_keys} accepted"
        if tenant_keys:
            accepted += f" ({tenant_keys} of them tenants')"
        lines.append(f"client API keys: {accepted}; a request without one gets 401; /health {health}")
    else:
        lines.append("client API keys: none (every client is served)")
    lines += _describe_tenants(config)
    key_files = config.upstream_key_files()
    if key_files:
        lines.append(f"upstream keys: sent to {len(key_files)} of {len(config.nodes)} nodes")
    if gateway.retry_unanswered:
        lines.append("unanswered requests: retried on another node, and so past a timeout (retry_unanswered = true)")
    else:
        lines.append("unanswered requests: 502, and 504 past a timeout (retry_unanswered = false)")
    lines.append(f"log: {gateway.log_format} lines, {gateway.log_level} and above")
    return "\n".join(lines)


def _describe_tenants(config: Config) -> list[str]:
    """Each tenant's keys, priority and limits, and the named priorities, as `check-config` shows them."""
    if not config.tenants and not config.admission.objectives:
        return []
    lines = [f"tenants ({len(config.tenants)}):"]
    for tenant in config.tenants:
        limits = [
            f"{value} {what}"
            for value, what in (
                (tenant.requests_per_minute, "requests/min"),
                (tenant.tokens_per_minute, "tokens/min"),
                (tenant.max_in_flight, "in flight"),
            )
            if value is not None
        ]
        if tenant.max_queue_seconds is not None:
            limits.append(f"queued at most {tenant.max_queue_seconds:g} s")
        keys = f"{len(tenant.api_key_hashes)} keys" if tenant.api_key_hashes else "no keys"
        lines.append(f"  {tenant.name}  priority {tenant.priority}  {keys}  {', '.join(limits) or 'no limits'}")
    if config.admission.objectives:
        named = ", ".join(f"{name} = {priority}" for name, priority in config.admission.objectives.items())
        lines.append(f"objectives (x-gateway-inference-objective): {named}")
    return lines


def _describe_routing(config: Config) -> str:
    """The cluster's policy and how often load is scraped, as `check-config` shows it."""
    routing = config.routing
    interval = config.load_scrape_interval()
    scraped = f"every {format_go_seconds(interval)}" if interval else "never"
    if routing.load_scrape_interval is None:
        scraped += " (load_scrape_interval unset: the default for these policies and the admission queue)"
    text = f"routing: {routing.policy}; node load scraped {scraped}"
    if {"prefix_affinity", "kv_aware"} & {routing.policy, *(model.policy for model in config.models.available)}:
        messages = f"first {routing.prefix_messages} messages" if routing.prefix_messages else "every message"
        text += f"; prefix: {messages}, up to {routing.prefix_bytes} bytes; load bound {routing.load_bound:g}"
    return text


def _tokenizer_text(config: Config, model: ModelEntry) -> str:
    """A model's tokenizer directory, and what kv_aware does without one."""
    if model.tokenizer:
        return f"  tokenizer {model.tokenizer}"
    if config.model_policy(model.name) == "kv_aware":
        return "  no tokenizer: kv_aware routes it as prefix_affinity"
    return ""


def _describe_admission(config: Config) -> str:
    """When requests wait in the gateway's queue, and how many may, as `check-config` shows it."""
    admission = config.admission
    if not admission.queue:
        return "admission queue: off (no [admission] table, or queue = false: every request goes to a node at once)"
    return (
        f"admission queue: requests queue while every node of a model has {admission.saturation_waiting} or more"
        f" waiting, KV cache {admission.saturation_kv_cache:g} or more used, or its max_in_flight reached;"
        f" up to {admission.queue_size} queued ({admission.tenant_queue_size} per tenant),"
        f" each for at most {admission.max_queue_seconds:g} s"
        + (
            f"; priority_headroom {admission.priority_headroom}: below the highest tenant priority a node is full"
            f" {admission.priority_headroom} places before its max_in_flight"
            if admission.priority_headroom
            else ""
        )
    )


def _size_text(size: int) -> str:
    """`64 MiB` for 67108864: the largest binary unit that divides the size, else bytes."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= factor and size % factor == 0:
            return f"{size // factor} {unit}"
    return f"{size} bytes"

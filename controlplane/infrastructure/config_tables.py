"""Each table of the gateway's config checked, once `controlplane.infrastructure.config` has
read and decoded the file: plinth's Validate in its order (first failure wins), then Interlock's
own checks, a table at a time. A check rejects a key by raising what `invalid(key, message)`
makes, the loader's `ConfigError`, which names the file.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable

import nkeys
from msgspec.structs import replace

from controlplane.infrastructure.gocompat import format_go_seconds, go_quote, parse_listen_address
from controlplane.infrastructure.small_files import read_small_file
from controlplane.infrastructure.tlsfiles import check_server_files, client_context
from controlplane.infrastructure.tokenizer_files import read_tokenizer_directory
from events.config import (
    DEFAULT_MAX_BUFFERED_RESPONSE_BYTES,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_TENANT,
    GATEWAY_TENANT,
    LOG_FORMATS,
    LOG_LEVELS,
    POLICIES,
    ROLES,
    SCHEDULING,
    AdmissionConfig,
    Config,
    FleetConfig,
    GatewayConfig,
    NodeConfig,
    TenantConfig,
)

Invalid = Callable[[str, str], Exception]
"""Makes the error rejecting a key (`nodes[2].ip`) with plinth's message."""

MODEL_DURATION_KEYS = ("connect_timeout", "first_byte_timeout", "response_timeout")
"""The keys of a `[[models.available]]` entry that hold durations (the loader parses them), each
overriding its `[gateway]` key for the model."""


def validate(invalid: Invalid, config: Config) -> Config:
    """plinth's Validate, in its order (first failure wins), then Interlock's own checks; returns
    the config with the size limits' zero values replaced by their defaults, as Validate does.

    Interlock's own gateway keys are checked right after plinth's gateway keys.
    """
    gateway = config.gateway
    if gateway.health_interval <= 0:
        raise invalid("gateway.health_interval", "health_interval must be greater than zero")
    if gateway.health_fail_threshold <= 0:
        raise invalid(
            "gateway.health_fail_threshold", "health_fail_threshold must be greater than zero"
        )
    if gateway.max_buffered_response_bytes < -1:
        raise invalid(
            "gateway.max_buffered_response_bytes",
            "max_buffered_response_bytes must be -1 (unlimited) or non-negative",
        )
    if gateway.max_request_body_bytes < 0:
        raise invalid(
            "gateway.max_request_body_bytes",
            "max_request_body_bytes must be non-negative (0 uses the default)",
        )
    if gateway.probe_timeout <= 0:
        raise invalid("gateway.probe_timeout", "probe_timeout must be greater than zero")
    for key in ("request_body_timeout", "request_body_idle_timeout", "response_body_timeout", *MODEL_DURATION_KEYS):
        if getattr(gateway, key) <= 0:
            raise invalid(f"gateway.{key}", f"{key} must be greater than zero")
    _check_tls_files(gateway, invalid)
    if gateway.shutdown_grace < 0:
        raise invalid("gateway.shutdown_grace", "shutdown_grace must be non-negative")
    if gateway.decision_log and gateway.decision_log == gateway.event_log:
        raise invalid("gateway.decision_log", "decision_log must not be the event log's path")
    for log in ("event_log", "decision_log"):
        if getattr(gateway, f"{log}_max_bytes") <= 0:
            raise invalid(f"gateway.{log}_max_bytes", f"{log}_max_bytes must be greater than zero")
        if getattr(gateway, f"{log}_retain_bytes") < 0:
            raise invalid(f"gateway.{log}_retain_bytes", f"{log}_retain_bytes must be non-negative (0: no bound)")
        if getattr(gateway, f"{log}_retain_age") < 0:
            raise invalid(f"gateway.{log}_retain_age", f"{log}_retain_age must be non-negative (0: no bound)")
    if gateway.workers != "auto" and gateway.workers < 1:
        raise invalid("gateway.workers", 'workers must be at least 1, or "auto" (one per usable core)')
    for key, allowed in (("log_level", LOG_LEVELS), ("log_format", LOG_FORMATS)):
        value = getattr(gateway, key)
        if value not in allowed:
            raise invalid(f"gateway.{key}", f"{key} must be one of {', '.join(allowed)} (got {go_quote(value)})")

    if not config.nodes:
        raise invalid("nodes", "at least one node must be configured")
    seen_ips = set()
    for index, node in enumerate(config.nodes):
        if node.ip in seen_ips:
            raise invalid(
                f"nodes[{index}].ip",
                f"duplicate node IP {go_quote(node.ip)}: plinth node identity is IP-based",
            )
        seen_ips.add(node.ip)

    rings = {node.ring for node in config.nodes}
    for index, model in enumerate(config.models.available):
        if model.target:
            continue  # an alias is routed as its target (`_check_aliases`)
        if model.ring and model.ring not in rings:
            raise invalid(
                f"models.available[{index}].ring",
                f"model {go_quote(model.name)} references ring {go_quote(model.ring)}, "
                "but no node belongs to that ring",
            )
        if not model.ring and "" not in rings:
            raise invalid(
                f"models.available[{index}].ring",
                f"model {go_quote(model.name)} has no ring, but every node belongs to a ring",
            )

    _check_addresses_and_models(invalid, config)
    _check_aliases(invalid, config)
    _check_adapters(invalid, config)
    _check_routing(invalid, config)
    _check_kv_events(invalid, config)
    _check_fleet(invalid, config.fleet)
    _check_admission(invalid, config)
    gateway = replace(
        gateway,
        max_buffered_response_bytes=gateway.max_buffered_response_bytes
        or DEFAULT_MAX_BUFFERED_RESPONSE_BYTES,
        max_request_body_bytes=gateway.max_request_body_bytes or DEFAULT_MAX_REQUEST_BODY_BYTES,
    )
    return replace(config, gateway=gateway)


def _check_tls_files(gateway: GatewayConfig, invalid: Invalid) -> None:
    """The listener's certificate and key: both or neither, and a pair the listener can load."""
    if bool(gateway.tls_certificate) != bool(gateway.tls_key):
        given, missing = ("tls_certificate", "tls_key") if gateway.tls_certificate else ("tls_key", "tls_certificate")
        raise invalid(f"gateway.{missing}", f"{given} is set: {missing} must be set too (both for HTTPS, or neither)")
    if gateway.tls_certificate:
        try:
            check_server_files(gateway.tls_certificate, gateway.tls_key)
        except ValueError as error:
            raise invalid("gateway.tls_certificate", str(error)) from None


def _check_node_tls(invalid: Invalid, index: int, node: NodeConfig) -> None:
    """A node's scheme, and for https the files its connections are made with, as each process
    will load them (`controlplane.infrastructure.keyfiles.UpstreamKeys`)."""
    prefix = f"nodes[{index}]."
    if node.scheme not in ("http", "https"):
        raise invalid(prefix + "scheme", f'scheme must be "http" or "https" (got {go_quote(node.scheme)})')
    files = ("ca_file", "client_certificate", "client_key")
    if node.scheme == "http":
        for key in files:
            if getattr(node, key):
                raise invalid(prefix + key, f'{key} is set: scheme must be "https" (it is "http")')
        return
    if bool(node.client_certificate) != bool(node.client_key):
        pair = ("client_certificate", "client_key")
        given, missing = pair if node.client_certificate else pair[::-1]
        raise invalid(prefix + missing, f"{given} is set: {missing} must be set too (both for mutual TLS, or neither)")
    try:
        client_context(node.ca_file, "", "")
    except ValueError as error:
        raise invalid(prefix + "ca_file", str(error)) from None
    if node.client_certificate:
        try:
            client_context(node.ca_file, node.client_certificate, node.client_key)
        except ValueError as error:
            raise invalid(prefix + "client_certificate", str(error)) from None


def _check_addresses_and_models(invalid: Invalid, config: Config) -> None:
    """Interlock's checks after plinth's, in file order: what plinth accepts and `serve` would
    then refuse (a listen address it cannot parse, both listeners on one port) or mishandle (a
    node address or port no connection can use, a model routed to one place and listed twice)."""
    gateway = config.gateway
    bound = {}
    for key in ("listen", "metrics_listen"):
        try:
            bound[key] = parse_listen_address(getattr(gateway, key))
        except ValueError as exc:
            raise invalid(f"gateway.{key}", str(exc)) from None
    (api_host, api_port), (metrics_host, metrics_port) = bound["listen"], bound["metrics_listen"]
    if api_port == metrics_port != 0 and _hosts_overlap(api_host, metrics_host):
        raise invalid(
            "gateway.metrics_listen",
            f"metrics_listen {go_quote(gateway.metrics_listen)} and listen {go_quote(gateway.listen)} "
            f"both bind port {api_port}",
        )

    for index, node in enumerate(config.nodes):
        problem = _node_address_problem(node.ip)
        if problem:
            raise invalid(f"nodes[{index}].ip", f"invalid node IP {go_quote(node.ip)}: {problem}")
        if node.role not in ROLES:
            raise invalid(
                f"nodes[{index}].role", f"role must be one of {', '.join(ROLES)} (got {go_quote(node.role)})"
            )
        if node.scheduling not in SCHEDULING:
            raise invalid(
                f"nodes[{index}].scheduling",
                f"scheduling must be one of {', '.join(SCHEDULING)} (got {go_quote(node.scheduling)})",
            )
        for key in ("vllm_port", "metrics_port"):
            port = getattr(node, key)
            if not 1 <= port <= 65535:
                raise invalid(f"nodes[{index}].{key}", f"{key} must be between 1 and 65535 (got {port})")
        _check_node_tls(invalid, index, node)

    first_listed: dict[str, int] = {}
    for index, model in enumerate(config.models.available):
        for key in MODEL_DURATION_KEYS:
            value = getattr(model, key)
            if value is not None and value <= 0:
                raise invalid(f"models.available[{index}].{key}", f"{key} must be greater than zero")
        earlier = first_listed.setdefault(model.name, index)
        if earlier != index:
            entries = config.models.available
            raise invalid(
                f"models.available[{index}].name",
                f"model {go_quote(model.name)} is listed twice: models.available[{earlier}] "
                f"({_placement(entries[earlier].ring)}) and models.available[{index}] ({_placement(model.ring)})",
            )


def _check_aliases(invalid: Invalid, config: Config) -> None:
    """An alias (`target`) stands for a model that is not itself an alias, and is routed as that
    model: it has no ring, policy or pipeline stages of its own."""
    aliases = config.aliases()
    for index, model in enumerate(config.models.available):
        if not model.target:
            continue
        key = f"models.available[{index}]"
        if model.target == model.name:
            raise invalid(f"{key}.target", f"model {go_quote(model.name)} is an alias of itself")
        if model.target in aliases:
            raise invalid(
                f"{key}.target",
                f"alias {go_quote(model.name)} targets {go_quote(model.target)}, which is an alias itself "
                "(an alias must name a served model)",
            )
        for setting in ("ring", "policy", "pipeline_stages", "tokenizer", *MODEL_DURATION_KEYS):
            if getattr(model, setting):
                raise invalid(
                    f"{key}.{setting}",
                    f"alias {go_quote(model.name)} is routed as its target {go_quote(model.target)}: "
                    f"set {setting} on the target's entry",
                )


def _check_adapters(invalid: Invalid, config: Config) -> None:
    """A LoRA adapter (`parent`) applies to a base model other than itself, is no alias, and is
    loaded (`lora_path`) only with its parent named."""
    aliases = config.aliases()
    for index, model in enumerate(config.models.available):
        key = f"models.available[{index}]"
        if model.lora_path and not model.parent:
            raise invalid(
                f"{key}.parent",
                f"adapter {go_quote(model.name)} has a lora_path but no parent: name the base model it is loaded onto",
            )
        if not model.parent:
            continue
        if model.target:
            raise invalid(f"{key}.parent", f"alias {go_quote(model.name)} cannot be an adapter too (target and parent)")
        if model.parent == model.name:
            raise invalid(f"{key}.parent", f"adapter {go_quote(model.name)} names itself as its parent")
        if model.parent in aliases:
            raise invalid(
                f"{key}.parent",
                f"adapter {go_quote(model.name)} names the alias {go_quote(model.parent)} as its parent "
                "(a parent must be a served model)",
            )


def _check_routing(invalid: Invalid, config: Config) -> None:
    """The [routing] table, then each model's policy and tokenizer directory, in file order. A bound must be finite:
    the config is recorded as JSON, which has no infinity."""
    routing = config.routing
    policies = ", ".join(POLICIES)
    if routing.policy not in POLICIES:
        raise invalid("routing.policy", f"policy must be one of {policies} (got {go_quote(routing.policy)})")
    if routing.load_scrape_interval is not None and routing.load_scrape_interval < 0:
        raise invalid("routing.load_scrape_interval", "load_scrape_interval must be non-negative (0: never)")
    if routing.prefix_messages < 0:
        raise invalid("routing.prefix_messages", "prefix_messages must be non-negative (0: every message)")
    if routing.prefix_bytes <= 0:
        raise invalid("routing.prefix_bytes", "prefix_bytes must be greater than zero")
    if not (math.isfinite(routing.load_bound) and routing.load_bound >= 1):
        raise invalid(
            "routing.load_bound", f"load_bound must be a finite number of at least 1 (got {routing.load_bound})"
        )
    for index, model in enumerate(config.models.available):
        if model.policy and model.policy not in POLICIES:
            raise invalid(
                f"models.available[{index}].policy",
                f'policy must be one of {policies}, or "" for routing.policy (got {go_quote(model.policy)})',
            )
        if model.tokenizer:
            try:
                read_tokenizer_directory(model.tokenizer)
            except ValueError as error:
                raise invalid(f"models.available[{index}].tokenizer", f"tokenizer: {error}") from None


_TCP_ENDPOINT = re.compile(r"tcp://(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*):([0-9]{1,5})")


def _check_kv_events(invalid: Invalid, config: Config) -> None:
    """Each node's KV event sockets (ZeroMQ endpoints the gateway connects to), then the index's bound."""
    for index, node in enumerate(config.nodes):
        for key in ("kv_events", "kv_events_replay"):
            endpoint = getattr(node, key)
            found = _TCP_ENDPOINT.fullmatch(endpoint)
            if endpoint and not (found and 1 <= int(found[1]) <= 65535):
                raise invalid(
                    f"nodes[{index}].{key}", f'{key} must be "tcp://HOST:PORT" (got {go_quote(endpoint)})'
                )
        for key in ("kv_events_replay", "kv_events_topic"):
            if getattr(node, key) and not node.kv_events:
                raise invalid(
                    f"nodes[{index}].{key}", f"{key} is set but kv_events is not: set where the node publishes"
                )
        if node.kv_events and node.kv_events == node.kv_events_replay:
            raise invalid(
                f"nodes[{index}].kv_events_replay", "kv_events_replay must be another socket than kv_events"
            )
    if config.routing.kv_index_blocks < 1:
        raise invalid("routing.kv_index_blocks", "kv_index_blocks must be at least 1")


_LIMITS = ("requests_per_minute", "tokens_per_minute", "max_in_flight")


def check_tenants(
    invalid: Invalid,
    gateway: GatewayConfig,
    tenants: tuple[TenantConfig, ...],
    admission: AdmissionConfig,
    *,
    keys: bool = True,
) -> None:
    """The `[[tenants]]` tables, in file order, then `[admission]`: names given and unique
    (`gateway` is the tenant of `[gateway]`'s keys when it has some), limits positive, a tenant
    with keys unless it is the keyless DEFAULT_TENANT."""
    seen: dict[str, int] = {}
    for index, tenant in enumerate(tenants):
        key = f"tenants[{index}]"
        if not tenant.name:
            raise invalid(f"{key}.name", "a tenant must have a name")
        if len(tenant.name) > MAX_TENANT_NAME_LENGTH:
            raise invalid(f"{key}.name", f"a tenant's name must be at most {MAX_TENANT_NAME_LENGTH} characters")
        earlier = seen.setdefault(tenant.name, index)
        if earlier != index:
            raise invalid(f"{key}.name", f"tenant {go_quote(tenant.name)} is also tenants[{earlier}]")
        if tenant.name == GATEWAY_TENANT and gateway.api_key_hashes:
            raise invalid(f"{key}.name", f"{go_quote(GATEWAY_TENANT)} is the tenant of [gateway]'s keys")
        for limit in _LIMITS:
            value = getattr(tenant, limit)
            if value is not None and value <= 0:
                raise invalid(f"{key}.{limit}", f"{limit} must be greater than zero (leave it out for no limit)")
        if tenant.max_queue_seconds is not None and not (
            math.isfinite(tenant.max_queue_seconds) and tenant.max_queue_seconds >= 0
        ):
            raise invalid(f"{key}.max_queue_seconds", "max_queue_seconds must be a finite number of at least 0")
        if keys and not tenant.api_key_hashes and tenant.name != DEFAULT_TENANT:
            raise invalid(
                f"{key}.api_keys",
                f"tenant {go_quote(tenant.name)} has no keys (api_keys, api_key_hashes or api_key_file); "
                f"only {go_quote(DEFAULT_TENANT)} serves requests without keys",
            )
    if admission.default_max_tokens <= 0:
        raise invalid("admission.default_max_tokens", "default_max_tokens must be greater than zero")
    for name in admission.objectives:
        if not name or len(name) > MAX_TENANT_NAME_LENGTH:
            raise invalid(
                "admission.objectives", f"an objective's name must be 1 to {MAX_TENANT_NAME_LENGTH} characters"
            )


MAX_TENANT_NAME_LENGTH = 128
"""A tenant's or an objective's name labels metrics and fills decision records: bounded."""


def _check_admission(invalid: Invalid, config: Config) -> None:
    """The [admission] table's queue keys, then each node's `max_in_flight`, which only the queue reads."""
    admission = config.admission
    for index, node in enumerate(config.nodes):
        if node.max_in_flight is None:
            continue
        key = f"nodes[{index}].max_in_flight"
        if not admission.queue:
            raise invalid(key, "max_in_flight needs the admission queue (an [admission] table without queue = false)")
        if node.max_in_flight < 1:
            raise invalid(key, f"max_in_flight must be at least 1 (got {node.max_in_flight})")
        if node.max_in_flight <= admission.priority_headroom:
            raise invalid(
                key,
                f"max_in_flight must be above [admission] priority_headroom ({admission.priority_headroom}),"
                f" or no request below the top priority would ever reach the node (got {node.max_in_flight})",
            )
    if admission.priority_headroom < 0:
        raise invalid(
            "admission.priority_headroom",
            f"priority_headroom must be a number of in-flight places, 0 or more (got {admission.priority_headroom})",
        )
    if admission.priority_headroom and not any(node.max_in_flight for node in config.nodes):
        raise invalid(
            "admission.priority_headroom",
            "priority_headroom keeps places free below a node's max_in_flight: set [[nodes]] max_in_flight",
        )
    if admission.saturation_waiting < 1:
        raise invalid(
            "admission.saturation_waiting",
            f"saturation_waiting must be at least 1 (got {admission.saturation_waiting})",
        )
    if not 0 < admission.saturation_kv_cache <= 1:
        raise invalid(
            "admission.saturation_kv_cache",
            f"saturation_kv_cache must be a fraction above 0, at most 1 (got {admission.saturation_kv_cache})",
        )
    if admission.queue_size < 1:
        raise invalid("admission.queue_size", f"queue_size must be at least 1 (got {admission.queue_size})")
    if not 1 <= admission.tenant_queue_size <= admission.queue_size:
        raise invalid(
            "admission.tenant_queue_size",
            f"tenant_queue_size must be 1 to queue_size ({admission.queue_size}) (got {admission.tenant_queue_size})",
        )
    if not (math.isfinite(admission.max_queue_seconds) and admission.max_queue_seconds >= 0):
        raise invalid(
            "admission.max_queue_seconds",
            f"max_queue_seconds must be a finite number of seconds, 0 or more (got {admission.max_queue_seconds})",
        )


_FLEET_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A fleet's name: it prefixes JetStream stream and bucket names, which allow no `.`, `*`, `>` or space."""

_REPLICA_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


MAX_STREAM_REPLICAS = 5
"""JetStream's own bound on a stream's replicas."""


def _check_fleet(invalid: Invalid, fleet: FleetConfig | None) -> None:
    """The [fleet] table (defaults applied): servers, names, and a renewal well inside the lease."""
    if fleet is None:
        return
    if not fleet.nats:
        raise invalid("fleet.nats", "nats must list at least one NATS server URL (nats://host:4222)")
    for index, url in enumerate(fleet.nats):
        scheme, separator, address = url.partition("://")
        if scheme not in ("nats", "tls") or not separator or not address or "/" in address:
            raise invalid(f"fleet.nats[{index}]", f"not a NATS server URL (nats://host:port): {go_quote(url)}")
    if not _FLEET_NAME.fullmatch(fleet.name):
        raise invalid("fleet.name", f"name must be 1-64 letters, digits, - or _ (got {go_quote(fleet.name)})")
    if not _REPLICA_NAME.fullmatch(fleet.replica):
        raise invalid(
            "fleet.replica", f"replica must be 1-128 letters, digits, ., - or _ (got {go_quote(fleet.replica)})"
        )
    if fleet.lease <= 0:
        raise invalid("fleet.lease", "lease must be greater than zero")
    if not 0 <= fleet.stream_replicas <= MAX_STREAM_REPLICAS:
        raise invalid(
            "fleet.stream_replicas", f"stream_replicas must be 1 to {MAX_STREAM_REPLICAS}, or 0 for one per server up to 3"
        )
    if not 0 < fleet.lease_renewal <= fleet.lease / 2:
        raise invalid(
            "fleet.lease_renewal",
            "lease_renewal must be greater than zero and at most half the lease "
            f"({format_go_seconds(fleet.lease / 2)})",
        )
    if not 0 < fleet.partition_after < math.inf:
        raise invalid("fleet.partition_after", "partition_after must be a duration greater than zero")
    if fleet.decision_spool_bytes <= 0:
        raise invalid(
            "fleet.decision_spool_bytes",
            f"decision_spool_bytes must be a number of bytes greater than zero (got {fleet.decision_spool_bytes})",
        )
    if fleet.config_version:
        raise invalid("fleet.config_version", "config_version is the fleet's config document's, not a key of the file")
    _check_fleet_credentials(invalid, fleet)


MAX_NATS_CREDENTIALS_BYTES = 64 * 1024
"""The largest NKey seed or credentials file the fleet's connection reads (one is well under a kilobyte)."""


def _check_fleet_credentials(invalid: Invalid, fleet: FleetConfig) -> None:
    """How the replica authenticates to NATS: one way at most (user and password, token, NKey
    seed, credentials file), its files readable now, and the TLS files a context loads."""
    if bool(fleet.user) != bool(fleet.password):
        given, missing = ("user", "password") if fleet.user else ("password", "user")
        raise invalid(f"fleet.{missing}", f"{given} is set: {missing} must be set too")
    ways = [key for key in ("user", "token", "nkey_seed_file", "creds_file") if getattr(fleet, key)]
    if len(ways) > 1:
        raise invalid(f"fleet.{ways[1]}", f"{ways[0]} and {ways[1]} are two ways to authenticate to NATS: give one")
    for key in ("nkey_seed_file", "creds_file"):
        path = getattr(fleet, key)
        if not path:
            continue
        try:
            content = read_small_file(path, MAX_NATS_CREDENTIALS_BYTES, "an NKey seed or credentials file")
        except OSError as error:
            raise invalid(f"fleet.{key}", f"reading {path}: {error.strerror or error}") from None
        except ValueError as error:
            raise invalid(f"fleet.{key}", str(error)) from None
        if key == "nkey_seed_file":
            _check_nkey_seed(invalid, key, path, content.strip())
        else:
            _check_creds_file(invalid, key, path, content)
    if bool(fleet.tls_certificate) != bool(fleet.tls_key):
        given, missing = ("tls_certificate", "tls_key") if fleet.tls_certificate else ("tls_key", "tls_certificate")
        raise invalid(f"fleet.{missing}", f"{given} is set: {missing} must be set too (mutual TLS), or neither")
    try:
        client_context(fleet.tls_ca_file, "", "")
    except ValueError as error:
        raise invalid("fleet.tls_ca_file", str(error)) from None
    if fleet.tls_certificate:
        try:
            client_context(fleet.tls_ca_file, fleet.tls_certificate, fleet.tls_key)
        except ValueError as error:
            raise invalid("fleet.tls_certificate", str(error)) from None


def _check_nkey_seed(invalid: Invalid, key: str, path: str, seed: bytes) -> None:
    """`seed` is an NKey seed (`SU…`): nats-py signs the server's nonce with it at each connect."""
    try:
        nkeys.from_seed(bytearray(seed)).wipe()
    except (nkeys.NkeysError, ValueError):  # ValueError: PyNaCl's, for a key of the wrong length
        message = f"{path} holds no valid NKey seed (a line SU…, as `nsc` or `nk -gen user` writes)"
        raise invalid(f"fleet.{key}", message) from None


def _check_creds_file(invalid: Invalid, key: str, path: str, content: bytes) -> None:
    """`content` is a credentials file: a user JWT, then the user's NKey seed, each on the line
    after its BEGIN marker (nats-py reads it so at each connect, and loops forever on a file
    without the JWT's marker)."""
    lines = content.splitlines()

    def after(marker: bytes, what: str) -> bytes:
        for index, line in enumerate(lines[:-1]):
            if marker in line and lines[index + 1].strip():
                return lines[index + 1].strip()
        raise invalid(f"fleet.{key}", f"{path} is not a NATS credentials file: no {what} after {marker.decode()}")

    after(b"BEGIN NATS USER JWT", "user JWT")
    _check_nkey_seed(invalid, key, path, after(b"BEGIN USER NKEY SEED", "NKey seed"))


def _hosts_overlap(first: str, second: str) -> bool:
    """Whether listeners on these two hosts (as `parse_listen_address` returns them) and one port
    would collide: the same host, or the IPv4 wildcard and any IPv4 address or name, or the IPv6
    wildcard (which takes IPv4 too) and anything."""
    if first == second or "::" in (first, second):
        return True
    return "0.0.0.0" in (first, second) and ":" not in first + second


def _node_address_problem(ip: str) -> str:
    """Why a node's `ip` cannot be connected to, or "". plinth takes any text and host names
    work; what looks like an IPv4 address must be one, and a colon means an IPv6 address (a
    port or a scheme written into `ip` would never connect)."""
    if re.fullmatch(r"[0-9.]+", ip):
        try:
            ipaddress.IPv4Address(ip)
        except ValueError:
            return "not a valid IPv4 address"
    elif ":" in ip:
        try:
            ipaddress.IPv6Address(ip)
        except ValueError:
            return "not a valid IPv6 address (ports go in vllm_port and metrics_port)"
    return ""


def _placement(ring: str) -> str:
    return f"ring {go_quote(ring)}" if ring else "standalone"

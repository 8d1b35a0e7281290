"""Loading and validating the gateway's config file (plinth §1); the schema is `events.config`.

`load_config` follows plinth's loader step by step: read the file, decode the TOML (unknown keys
ignored, but reported with the closest known key; keys matched to fields case-insensitively; a
wrong TOML type is an error), apply the loader defaults, parse the Go duration strings, then
validate in plinth's order, first failure wins. Error messages are plinth's exact texts;
`ConfigError` adds the file and the key. After plinth's checks come Interlock's own, for what
plinth accepts and the gateway then mishandles: listen addresses, node addresses and ports, a
model listed twice; and the `[fleet]` table's.

Go's text formats (durations, quoting, host:port) are `controlplane.infrastructure.gocompat`'s, the key files
`controlplane.infrastructure.keyfiles`'s, and `check-config`'s summary is `interlock.describe`'s.
"""

from __future__ import annotations

import difflib
import hashlib
import ipaddress
import math
import os
import re
import socket
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import msgspec.inspect
from msgspec.structs import replace

from controlplane.infrastructure.gocompat import format_go_seconds, go_quote, join_host_port, parse_go_duration, parse_listen_address
from controlplane.infrastructure.keyfiles import NOT_A_DIGEST, SHA256_HEX, read_key_digests, read_upstream_key
from controlplane.infrastructure.tlsfiles import check_server_files, client_context
from events.config import (
    DEFAULT_DECISION_LOG_MAX_BYTES,
    DEFAULT_EVENT_LOG_MAX_BYTES,
    DEFAULT_FLEET_LEASE,
    DEFAULT_FLEET_LEASE_RENEWAL,
    DEFAULT_FLEET_NAME,
    DEFAULT_HEALTH_FAIL_THRESHOLD,
    DEFAULT_LISTEN,
    DEFAULT_MAX_BUFFERED_RESPONSE_BYTES,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_METRICS_LISTEN,
    DEFAULT_METRICS_PORT,
    DEFAULT_TENANT,
    DEFAULT_VLLM_PORT,
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


class ConfigError(Exception):
    """An invalid or unreadable config file.

    `message` is plinth's exact text; `key` is the offending dotted key (`gateway.listen`,
    `nodes[2].ip`) or "" when no single key is at fault.
    """

    def __init__(self, path: str, key: str, message: str) -> None:
        super().__init__(path, key, message)
        self.path = path
        self.key = key
        self.message = message

    def __str__(self) -> str:
        if self.key:
            return f"{self.path}: {self.key}: {self.message}"
        return f"{self.path}: {self.message}"


@dataclass(frozen=True)
class UnknownKey:
    """A key of the config file that no setting has (ignored, as plinth does, but reported).

    `key` is its dotted path (`gateway.helth_interval`, `nodes[1].vlm_port`, `gatway`); `closest`
    the most similar known key at the same place, or "" when none is close.
    """

    path: str
    key: str
    closest: str

    @property
    def message(self) -> str:
        return f"unknown key (did you mean {self.closest}?)" if self.closest else "unknown key"

    def __str__(self) -> str:
        return f"{self.path}: {self.key}: {self.message}"


@dataclass(frozen=True)
class Overrides:
    """Gateway settings given on the command line (`interlock serve --listen …`). They win over
    the file's at start and at every reload, so a reload never sees them change; the config the
    event log records is the one in force. None leaves the file's setting.

    `host` and `port` (vLLM's `--host`/`--port`) each replace one half of `listen`. The demo
    places the event and decision logs in its own directory with `event_log` and `decision_log`.
    """

    listen: str | None = None
    metrics_listen: str | None = None
    host: str | None = None
    port: int | None = None
    log_level: str | None = None
    log_format: str | None = None
    event_log: str | None = None
    decision_log: str | None = None
    shutdown_grace: float | None = None
    fleet_nats: tuple[str, ...] | None = None
    """`serve --fleet URL[,URL…]`: the fleet's NATS servers (a `[fleet]` table if the file has none)."""

    def apply(self, gateway: GatewayConfig) -> GatewayConfig:
        given = {
            key: value
            for key in (
                "listen", "metrics_listen", "log_level", "log_format", "event_log", "decision_log", "shutdown_grace"
            )  # fmt: skip
            if (value := getattr(self, key)) is not None
        }
        if self.host is not None or self.port is not None:
            listen = given.get("listen", gateway.listen)
            try:
                _, port = parse_listen_address(listen)
            except ValueError:
                pass  # the file's address is invalid: validation names it
            else:
                host_part = listen[: listen.rfind(":")]  # as written: "" (all interfaces) stays ""
                given["listen"] = (
                    join_host_port(self.host, port if self.port is None else self.port)
                    if self.host is not None
                    else f"{host_part}:{self.port}"
                )
        return replace(gateway, **given)


NO_OVERRIDES = Overrides()


# ---------------------------------------------------------------------------------------------
# Loading

_IGNORED_SECTIONS = ("provision",)
"""Top-level tables plinth's gateway accepts and does not use (its provisioning CLI's)."""

_DURATION_KEYS = {
    "gateway": (
        "health_interval",
        "probe_timeout",
        "event_log_retain_age",
        "decision_log_retain_age",
        "request_body_timeout",
        "request_body_idle_timeout",
        "response_body_timeout",
        "connect_timeout",
        "first_byte_timeout",
        "response_timeout",
        "shutdown_grace",
    ),
    "routing": ("load_scrape_interval",),
    "fleet": ("lease", "lease_renewal"),
}
"""The keys, by table, that hold Go duration strings in the file and float seconds in the schema."""
_MODEL_DURATION_KEYS = ("connect_timeout", "first_byte_timeout", "response_timeout")
"""The keys of a `[[models.available]]` entry that do so."""
_MODEL_ENTRY = re.compile(r"models\.available\[(\d+)\]")


def load_config(
    path: str | os.PathLike[str],
    *,
    warn: Callable[[UnknownKey], None] | None = None,
    overrides: Overrides = NO_OVERRIDES,
) -> Config:
    """Read, decode, default and validate the config file at `path`, with `overrides` applied
    before validation; raise ConfigError if bad.

    `warn` is called for each unknown key, in file order, before any validation error is raised
    (a misspelt key often explains the error: `[[node]]` leaves no nodes configured).
    """
    path = os.fspath(path)

    def report(key: str, closest: str) -> None:
        if warn is not None:
            warn(UnknownKey(path, key, closest))

    document, inline_key_hashes = _take_inline_api_keys(path, _read_toml(path))
    document = _match_field_names(document, msgspec.inspect.type_info(Config), "", report)
    document, duration_texts = _split_durations(path, document)
    admission = document.get("admission")
    if isinstance(admission, dict) and "queue" not in admission:
        document["admission"] = {**admission, "queue": True}  # the table turns the queue on
    try:
        config = msgspec.convert(document, Config)
    except msgspec.ValidationError as exc:
        message, key = _split_validation_error(exc)
        raise ConfigError(path, key, f"parsing config: {message}") from None
    if overrides.fleet_nats is not None:
        config = replace(config, fleet=replace(config.fleet or FleetConfig(), nats=overrides.fleet_nats))
    config = _apply_loader_defaults(path, config, duration_texts)
    config = replace(config, gateway=overrides.apply(config.gateway))
    return _with_access_keys(path, _validate(path, config), inline_key_hashes)


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as exc:
        raise ConfigError(path, "", f"reading config: {exc}") from None
    try:
        return tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(path, "", f"parsing config: {exc}") from None


def _match_field_names(
    table: Any, schema: msgspec.inspect.StructType, prefix: str, report: Callable[[str, str], None]
) -> Any:
    """Rename a TOML table's keys to the schema's field names, case-insensitively, as go-toml v2
    does, and drop the keys the schema does not know (plinth ignores them, `[provision]` too),
    reporting each but `[provision]` as `report(dotted key, closest known key or "")`. `prefix`
    is the table's own dotted path ("" for the document).

    A value of the wrong shape is left as it is, for msgspec.convert to report with its key.
    """
    if not isinstance(table, dict):
        return table
    fields = {field.name.lower(): field for field in schema.fields}
    renamed = {}
    for key, value in table.items():
        field = fields.get(key.lower())
        if field is None:
            if not (prefix == "" and key.lower() in _IGNORED_SECTIONS):
                closest = difflib.get_close_matches(key.lower(), list(fields), n=1)
                report(prefix + key, prefix + closest[0] if closest else "")
            continue
        struct_type = _struct_type(field.type)
        if struct_type is not None:
            value = _match_field_names(value, struct_type, f"{prefix}{field.name}.", report)
        elif isinstance(field.type, msgspec.inspect.VarTupleType) and isinstance(value, list):
            item_schema = field.type.item_type
            if isinstance(item_schema, msgspec.inspect.StructType):
                value = [
                    _match_field_names(item, item_schema, f"{prefix}{field.name}[{index}].", report)
                    for index, item in enumerate(value)
                ]
        renamed[field.name] = value
    return renamed


def _struct_type(schema: msgspec.inspect.Type) -> msgspec.inspect.StructType | None:
    """The table type of a field: a Struct, or the Struct of an optional one (`[fleet]`)."""
    if isinstance(schema, msgspec.inspect.UnionType):
        structs = [member for member in schema.types if isinstance(member, msgspec.inspect.StructType)]
        return structs[0] if len(structs) == 1 else None
    return schema if isinstance(schema, msgspec.inspect.StructType) else None


def _split_durations(path: str, document: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Take the duration strings out of their tables, checking that they are strings; returns
    the rest of the document and the texts by dotted key (`gateway.health_interval`)."""
    texts = {}

    def take(where: str, table: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
        for name in names:
            if name in table:
                value = table[name]
                if not isinstance(value, str):
                    raise ConfigError(
                        path,
                        f"{where}.{name}",
                        f'parsing config: {name} must be a duration string such as "1s", "500ms" or "2m" '
                        f"(got {value!r})",
                    )
                texts[f"{where}.{name}"] = value
        return {key: value for key, value in table.items() if key not in names}

    for section, names in _DURATION_KEYS.items():
        table = document.get(section)
        if isinstance(table, dict):
            document = {**document, section: take(section, table, names)}
    models = document.get("models")
    if isinstance(models, dict) and isinstance(models.get("available"), list):
        entries = [
            take(f"models.available[{index}]", entry, _MODEL_DURATION_KEYS) if isinstance(entry, dict) else entry
            for index, entry in enumerate(models["available"])
        ]
        document = {**document, "models": {**models, "available": entries}}
    return document, texts


def _take_inline_api_keys(path: str, document: dict[str, Any]) -> tuple[dict[str, Any], InlineKeys]:
    """Take the client keys themselves (`gateway.api_keys`, `tenants[i].api_keys`) out of the
    document, as the SHA-256 hex digests the schema keeps (`api_key_hashes`), so that no key
    goes further than here. Returns the digests by table: "gateway", or the tenant's index."""
    digests: InlineKeys = {}
    for section, table in document.items():
        if section.lower() == "gateway" and isinstance(table, dict):
            digests["gateway"] = _pop_api_keys(path, "gateway", table)
        elif section.lower() == "tenants" and isinstance(table, list):
            for index, tenant in enumerate(table):
                if isinstance(tenant, dict):
                    digests[index] = _pop_api_keys(path, f"tenants[{index}]", tenant)
    return document, digests


InlineKeys = dict[str | int, tuple[str, ...]]


def _pop_api_keys(path: str, where: str, table: dict[str, Any]) -> tuple[str, ...]:
    """The digests of a table's `api_keys`, taken out of it."""
    digests: tuple[str, ...] = ()
    for key in [key for key in table if key.lower() == "api_keys"]:
        keys = table.pop(key)
        if not isinstance(keys, list) or not all(isinstance(item, str) for item in keys):
            raise ConfigError(path, f"{where}.api_keys", "parsing config: api_keys must be an array of strings")
        for index, item in enumerate(keys):
            if not item:
                raise ConfigError(path, f"{where}.api_keys[{index}]", "an API key must not be empty")
        digests += tuple(hashlib.sha256(item.encode()).hexdigest() for item in keys)
    return digests


def _split_validation_error(exc: msgspec.ValidationError) -> tuple[str, str]:
    """Split msgspec's "Expected `int`, got `str` - at `$.nodes[0].ip`" into text and dotted key."""
    match = re.fullmatch(r"(.*) - at `\$\.?(.*)`", str(exc), flags=re.DOTALL)
    if match is None:
        return str(exc), ""
    return match.group(1), match.group(2)


def _apply_loader_defaults(path: str, config: Config, duration_texts: dict[str, str]) -> Config:
    """plinth's loader: empty or zero values take their defaults; duration strings are parsed."""
    durations: dict[str, dict[str, float]] = {section: {} for section in _DURATION_KEYS}
    model_durations: dict[int, dict[str, float]] = {}
    for key, text in duration_texts.items():
        if text == "":
            continue  # absent or empty: the schema default stands
        table, name = key.rsplit(".", 1)
        try:
            seconds = parse_go_duration(text) / 1e9
        except ValueError as exc:
            raise ConfigError(path, key, f"parsing {name}: {exc}") from None
        if entry := _MODEL_ENTRY.fullmatch(table):
            model_durations.setdefault(int(entry.group(1)), {})[name] = seconds
        else:
            durations[table][name] = seconds
    gateway = config.gateway
    gateway = replace(
        gateway,
        listen=gateway.listen or DEFAULT_LISTEN,
        metrics_listen=gateway.metrics_listen or DEFAULT_METRICS_LISTEN,
        health_fail_threshold=gateway.health_fail_threshold or DEFAULT_HEALTH_FAIL_THRESHOLD,
        event_log_max_bytes=gateway.event_log_max_bytes or DEFAULT_EVENT_LOG_MAX_BYTES,
        log_level=gateway.log_level or LOG_LEVELS[0],
        log_format=gateway.log_format or LOG_FORMATS[0],
        decision_log_max_bytes=gateway.decision_log_max_bytes or DEFAULT_DECISION_LOG_MAX_BYTES,
        **durations["gateway"],
    )
    routing = replace(config.routing, policy=config.routing.policy or POLICIES[0], **durations["routing"])
    nodes = tuple(
        replace(
            node,
            vllm_port=node.vllm_port or DEFAULT_VLLM_PORT,
            metrics_port=node.metrics_port or DEFAULT_METRICS_PORT,
            scheme=node.scheme or "http",
        )
        for node in config.nodes
    )
    fleet = config.fleet
    if fleet is not None:
        lease = {"lease": DEFAULT_FLEET_LEASE, "lease_renewal": DEFAULT_FLEET_LEASE_RENEWAL} | durations["fleet"]
        fleet = replace(
            fleet, name=fleet.name or DEFAULT_FLEET_NAME, replica=fleet.replica or socket.gethostname(), **lease
        )
    available = tuple(
        replace(model, **model_durations.get(index, {})) for index, model in enumerate(config.models.available)
    )
    models = replace(config.models, available=available)
    return replace(config, gateway=gateway, nodes=nodes, routing=routing, fleet=fleet, models=models)


def _validate(path: str, config: Config) -> Config:
    """plinth's Validate, in its order (first failure wins), then Interlock's own checks; returns
    the config with the size limits' zero values replaced by their defaults, as Validate does.

    Interlock's own gateway keys are checked right after plinth's gateway keys.
    """

    def invalid(key: str, message: str) -> ConfigError:
        return ConfigError(path, key, message)

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
    for key in ("request_body_timeout", "request_body_idle_timeout", "response_body_timeout", *_MODEL_DURATION_KEYS):
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
    _check_fleet(invalid, config.fleet)
    _check_admission(invalid, config)
    gateway = replace(
        gateway,
        max_buffered_response_bytes=gateway.max_buffered_response_bytes
        or DEFAULT_MAX_BUFFERED_RESPONSE_BYTES,
        max_request_body_bytes=gateway.max_request_body_bytes or DEFAULT_MAX_REQUEST_BODY_BYTES,
    )
    return replace(config, gateway=gateway)


def _with_access_keys(path: str, config: Config, inline_key_hashes: InlineKeys) -> Config:
    """Check the access settings and gather every accepted client key digest (`api_keys`,
    `api_key_hashes`, `api_key_file`'s lines), of `[gateway]` and of each tenant, into its
    `api_key_hashes`, in that order, once each; a key belongs to one tenant (`[gateway]`'s keys
    are the tenant GATEWAY_TENANT). Each upstream key file must hold a usable key now (it is
    read again by each process)."""
    gateway = config.gateway
    gateway = replace(
        gateway,
        api_key_hashes=_gathered_digests(
            path, "gateway", inline_key_hashes.get("gateway", ()), gateway.api_key_hashes, gateway.api_key_file
        ),
    )
    tenants = tuple(
        replace(
            tenant,
            api_key_hashes=_gathered_digests(
                path, f"tenants[{index}]", inline_key_hashes.get(index, ()), tenant.api_key_hashes, tenant.api_key_file
            ),
        )
        for index, tenant in enumerate(config.tenants)
    )
    _check_tenants(lambda key, message: ConfigError(path, key, message), gateway, tenants, config.admission)
    owners = dict.fromkeys(gateway.api_key_hashes, GATEWAY_TENANT)
    for index, tenant in enumerate(tenants):
        for digest in tenant.api_key_hashes:
            owner = owners.setdefault(digest, tenant.name)
            if owner != tenant.name:
                raise ConfigError(
                    path,
                    f"tenants[{index}].api_keys",
                    f"a key of tenant {go_quote(tenant.name)} is also a key of "
                    f"{go_quote(owner) if owner != GATEWAY_TENANT else '[gateway]'}: a key belongs to one tenant",
                )
    for key, key_file in [("gateway.upstream_api_key_file", gateway.upstream_api_key_file)] + [
        (f"nodes[{index}].api_key_file", node.api_key_file) for index, node in enumerate(config.nodes)
    ]:
        if key_file:
            try:
                read_upstream_key(key_file)
            except ValueError as exc:
                raise ConfigError(path, key, str(exc)) from None
    return replace(config, gateway=gateway, tenants=tenants)


def _gathered_digests(
    path: str, where: str, inline: tuple[str, ...], hashes: tuple[str, ...], key_file: str
) -> tuple[str, ...]:
    """One table's client key digests: its `api_keys` (hashed), `api_key_hashes`, `api_key_file`."""
    digests = list(inline)
    for index, digest in enumerate(hashes):
        if not SHA256_HEX.fullmatch(digest.lower()):
            raise ConfigError(path, f"{where}.api_key_hashes[{index}]", NOT_A_DIGEST)
        digests.append(digest.lower())
    if key_file:
        try:
            digests += read_key_digests(key_file)
        except ValueError as exc:
            raise ConfigError(path, f"{where}.api_key_file", str(exc)) from None
    return tuple(dict.fromkeys(digests))


def _check_tls_files(gateway: GatewayConfig, invalid: Callable[[str, str], ConfigError]) -> None:
    """The listener's certificate and key: both or neither, and a pair the listener can load."""
    if bool(gateway.tls_certificate) != bool(gateway.tls_key):
        given, missing = ("tls_certificate", "tls_key") if gateway.tls_certificate else ("tls_key", "tls_certificate")
        raise invalid(f"gateway.{missing}", f"{given} is set: {missing} must be set too (both for HTTPS, or neither)")
    if gateway.tls_certificate:
        try:
            check_server_files(gateway.tls_certificate, gateway.tls_key)
        except ValueError as error:
            raise invalid("gateway.tls_certificate", str(error)) from None


def _check_node_tls(invalid: Callable[[str, str], ConfigError], index: int, node: NodeConfig) -> None:
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


def _check_addresses_and_models(invalid: Callable[[str, str], ConfigError], config: Config) -> None:
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
        for key in _MODEL_DURATION_KEYS:
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


def _check_aliases(invalid: Callable[[str, str], ConfigError], config: Config) -> None:
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
        for setting in ("ring", "policy", "pipeline_stages", *_MODEL_DURATION_KEYS):
            if getattr(model, setting):
                raise invalid(
                    f"{key}.{setting}",
                    f"alias {go_quote(model.name)} is routed as its target {go_quote(model.target)}: "
                    f"set {setting} on the target's entry",
                )


def _check_adapters(invalid: Callable[[str, str], ConfigError], config: Config) -> None:
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


def _check_routing(invalid: Callable[[str, str], ConfigError], config: Config) -> None:
    """The [routing] table, then each model's policy, in file order. A bound must be finite:
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


_LIMITS = ("requests_per_minute", "tokens_per_minute", "max_in_flight")


def load_tenants(path: str | os.PathLike[str]) -> tuple[TenantConfig, ...]:
    """The `[[tenants]]` tables of a file (a whole config, or those tables alone), checked as
    the loader checks them but for their keys, which are not read (`interlock whatif --tenants`
    replays recorded requests, which name their tenant)."""
    path = os.fspath(path)
    document = _read_toml(path)
    tables = next((value for key, value in document.items() if key.lower() == "tenants"), [])
    schema = msgspec.inspect.type_info(TenantConfig)
    if not isinstance(tables, list):
        raise ConfigError(path, "tenants", "parsing config: tenants must be an array of tables ([[tenants]])")
    limits = []
    for index, table in enumerate(tables):
        table = _match_field_names(table, schema, f"tenants[{index}].", lambda key, closest: None)
        if isinstance(table, dict):
            table = {key: value for key, value in table.items() if key not in ("api_key_hashes", "api_key_file")}
        try:
            limits.append(msgspec.convert(table, TenantConfig))
        except msgspec.ValidationError as exc:
            message, key = _split_validation_error(exc)
            where = f"tenants[{index}]" + (f".{key}" if key else "")
            raise ConfigError(path, where, f"parsing config: {message}") from None
    tenants = tuple(limits)
    _check_tenants(
        lambda key, message: ConfigError(path, key, message), GatewayConfig(), tenants, AdmissionConfig(), keys=False
    )
    return tenants


def _check_tenants(
    invalid: Callable[[str, str], ConfigError],
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


def _check_admission(invalid: Callable[[str, str], ConfigError], config: Config) -> None:
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


def _check_fleet(invalid: Callable[[str, str], ConfigError], fleet: FleetConfig | None) -> None:
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

"""Loading the gateway's config file (plinth §1); the schema is `events.config`, each table's
checks are `controlplane.infrastructure.config_tables`'.

`load_config` follows plinth's loader step by step: read the file, decode the TOML (unknown keys
ignored, but reported with the closest known key; keys matched to fields case-insensitively; a
wrong TOML type is an error), apply the loader defaults, parse the Go duration strings, then
validate in plinth's order, first failure wins, and gather the client keys. Error messages are
plinth's exact texts; `ConfigError` adds the file and the key. After plinth's checks come
Interlock's own, for what plinth accepts and the gateway then mishandles: listen addresses, node
addresses and ports, a model listed twice; and the `[fleet]` table's.

Go's text formats (durations, quoting, host:port) are `controlplane.infrastructure.gocompat`'s, the key files
`controlplane.infrastructure.keyfiles`'s, and `check-config`'s summary is `interlock.describe`'s.
"""

from __future__ import annotations

import difflib
import hashlib
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

from controlplane.infrastructure.config_tables import MODEL_DURATION_KEYS, check_tenants, validate
from controlplane.infrastructure.gocompat import go_quote, join_host_port, parse_go_duration, parse_listen_address
from controlplane.infrastructure.keyfiles import NOT_A_DIGEST, SHA256_HEX, read_key_digests, read_upstream_key
from events.config import (
    DEFAULT_DECISION_LOG_MAX_BYTES,
    DEFAULT_DECISION_SPOOL_BYTES,
    DEFAULT_EVENT_LOG_MAX_BYTES,
    DEFAULT_FLEET_LEASE,
    DEFAULT_FLEET_LEASE_RENEWAL,
    DEFAULT_FLEET_NAME,
    DEFAULT_HEALTH_FAIL_THRESHOLD,
    DEFAULT_LISTEN,
    DEFAULT_METRICS_LISTEN,
    DEFAULT_METRICS_PORT,
    DEFAULT_PARTITION_DIR,
    DEFAULT_TENANT_QUEUE_SIZE,
    DEFAULT_VLLM_PORT,
    GATEWAY_TENANT,
    LOG_FORMATS,
    LOG_LEVELS,
    PARTITION_AFTER_INTERVALS,
    POLICIES,
    RESTART_KEYS,
    AdmissionConfig,
    Config,
    FleetConfig,
    GatewayConfig,
    TenantConfig,
)


def fleet_wide(config: Config, version: int = 0) -> Config:
    """The fleet-wide part of `config`, as the fleet's config document holds it and the fleet's
    events carry it: the one place that says which keys are the fleet's and which a replica's.

    A replica's own keys are read from its file, never from the fleet: the `[gateway]` keys a
    running gateway keeps until it restarts (RESTART_KEYS: where it listens, its TLS files, its
    logs' paths and retention, its workers), here at their defaults, and the whole `[fleet]`
    table (the connection to NATS, its credentials, the replica's name), here a table naming
    the document's `version` alone. Every other key is the fleet's, one config for all
    replicas: the nodes, the models, routing, the health rules and timeouts, admission, the
    tenants and their keys, and what the logs say (`log_level`, `log_format`)."""
    own = GatewayConfig()
    gateway = replace(config.gateway, **{key: getattr(own, key) for key in RESTART_KEYS})
    return replace(config, gateway=gateway, fleet=FleetConfig(config_version=version))


def fleet_config_digest(config: Config) -> str:
    """A short hash of `config`'s fleet-wide part, its version left out: equal for two files
    whose fleet-wide keys are the same, whatever their replica's own keys."""
    return hashlib.sha256(msgspec.json.encode(fleet_wide(config))).hexdigest()[:16]


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
    "fleet": ("lease", "lease_renewal", "partition_after"),
}
"""The keys, by table, that hold Go duration strings in the file and float seconds in the schema."""
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
        document["admission"] = admission = {**admission, "queue": True}  # the table turns the queue on
    if isinstance(admission, dict) and "tenant_queue_size" not in admission:
        queue_size = admission.get("queue_size")
        if type(queue_size) is int and 1 <= queue_size < DEFAULT_TENANT_QUEUE_SIZE:
            # A tenant may wait in no more places than the queue has: the default follows it down.
            document["admission"] = {**admission, "tenant_queue_size": queue_size}
    try:
        config = msgspec.convert(document, Config)
    except msgspec.ValidationError as exc:
        message, key = _split_validation_error(exc)
        raise ConfigError(path, key, f"parsing config: {message}") from None
    if overrides.fleet_nats is not None:
        config = replace(config, fleet=replace(config.fleet or FleetConfig(), nats=overrides.fleet_nats))
    config = _apply_loader_defaults(path, config, duration_texts)
    config = replace(config, gateway=overrides.apply(config.gateway))
    config = validate(lambda key, message: ConfigError(path, key, message), config)
    return _with_access_keys(path, config, inline_key_hashes)


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
            take(f"models.available[{index}]", entry, MODEL_DURATION_KEYS) if isinstance(entry, dict) else entry
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
        timing = {
            "lease": DEFAULT_FLEET_LEASE,
            "lease_renewal": DEFAULT_FLEET_LEASE_RENEWAL,
            "partition_after": PARTITION_AFTER_INTERVALS * gateway.health_interval,
        } | durations["fleet"]
        fleet = replace(
            fleet,
            name=fleet.name or DEFAULT_FLEET_NAME,
            replica=fleet.replica or socket.gethostname(),
            partition_dir=fleet.partition_dir or DEFAULT_PARTITION_DIR,
            decision_spool_bytes=fleet.decision_spool_bytes or DEFAULT_DECISION_SPOOL_BYTES,
            **timing,
        )
    available = tuple(
        replace(model, **model_durations.get(index, {})) for index, model in enumerate(config.models.available)
    )
    models = replace(config.models, available=available)
    return replace(config, gateway=gateway, nodes=nodes, routing=routing, fleet=fleet, models=models)


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
    check_tenants(lambda key, message: ConfigError(path, key, message), gateway, tenants, config.admission)
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
    check_tenants(
        lambda key, message: ConfigError(path, key, message), GatewayConfig(), tenants, AdmissionConfig(), keys=False
    )
    return tenants



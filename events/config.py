"""The gateway's configuration schema (plinth §1): frozen msgspec Structs with plinth's defaults.

The schema is vocabulary: `RunStarted` and `ConfigReloaded` carry a `Config`, so a recorded log
decodes straight into typed configs. Reading and validating a TOML file is
`controlplane.infrastructure.config.load_config`; durations are float seconds here (Go duration strings in
the file).
"""

from __future__ import annotations

from typing import Literal, get_args

from msgspec import Struct

DEFAULT_LISTEN = ":8000"
DEFAULT_METRICS_LISTEN = ":9090"
DEFAULT_HEALTH_INTERVAL = 3.0
DEFAULT_HEALTH_FAIL_THRESHOLD = 3
DEFAULT_MAX_BUFFERED_RESPONSE_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_PROBE_TIMEOUT = 5.0
DEFAULT_REQUEST_BODY_TIMEOUT = 60.0
DEFAULT_REQUEST_BODY_IDLE_TIMEOUT = 10.0
DEFAULT_RESPONSE_BODY_TIMEOUT = 60.0
DEFAULT_CONNECT_TIMEOUT = 5.0
DEFAULT_FIRST_BYTE_TIMEOUT = 10.0
DEFAULT_RESPONSE_TIMEOUT = 60.0
"""plinth's upstream timeouts (its dial, first stream chunk and response header limits)."""
DEFAULT_SHUTDOWN_GRACE = 10.0
DEFAULT_EVENT_LOG_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_DECISION_LOG_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_LOG_RETAIN_BYTES = 1024 * 1024 * 1024
DEFAULT_VLLM_PORT = 8000
DEFAULT_METRICS_PORT = 9100
LOG_LEVELS = ("info", "warn", "error")
"""plinth's levels, least severe first: `gateway.log_level` drops the lines below the one it names."""
LOG_FORMATS = ("json", "text")
"""`gateway.log_format`: plinth's JSON lines, or text for a terminal."""


Policy = Literal["round_robin", "least_load", "power_of_two", "prefix_affinity", "kv_aware"]
"""`routing.policy` and a model's `policy`: how a node is chosen among those routing allows.
plinth's round robin is the default; the others read load (`LoadScraped`, in-flight counts);
`kv_aware` also the blocks of the prompt each node's KV events say it holds (`kvcache`).
The config's fields are plain strings, checked by the loader (its error names the choices)."""
POLICIES: tuple[Policy, ...] = get_args(Policy)
DEFAULT_LOAD_SCRAPE_INTERVAL = 2.0
"""Seconds between load scrapes of a node when a load-aware policy is configured and
`routing.load_scrape_interval` is not set."""
DEFAULT_PREFIX_BYTES = 512
DEFAULT_LOAD_BOUND = 1.25
DEFAULT_KV_INDEX_BLOCKS = 100_000
"""The KV index's bound per node: a few million tokens of cache at vLLM's block sizes, more
than one GPU holds."""

DEFAULT_FLEET_NAME = "interlock"
DEFAULT_FLEET_LEASE = 3.0
DEFAULT_FLEET_LEASE_RENEWAL = 1.0
PARTITION_AFTER_INTERVALS = 3
"""`fleet.partition_after`'s default, in health intervals: a few probe rounds missed."""
DEFAULT_PARTITION_DIR = "partitions"
DEFAULT_DECISION_SPOOL_BYTES = 32 * 1024 * 1024

RESTART_KEYS = (
    "listen",
    "tls_certificate",
    "tls_key",
    "metrics_listen",
    "event_log",
    "event_log_max_bytes",
    "event_log_retain_bytes",
    "event_log_retain_age",
    "decision_log",
    "decision_log_max_bytes",
    "decision_log_retain_bytes",
    "decision_log_retain_age",
    "workers",
)
"""`[gateway]` settings a running gateway keeps until it restarts (a reload warns for each, as plinth
does for the listen addresses); in a fleet, each replica's own (`controlplane.infrastructure.
config.fleet_wide`)."""

Workers = int | Literal["auto"]
"""`gateway.workers`: a count of processes, or "auto"."""


class ClusterConfig(Struct, frozen=True, kw_only=True):
    name: str = ""


class GatewayConfig(Struct, frozen=True, kw_only=True):
    listen: str = DEFAULT_LISTEN
    metrics_listen: str = DEFAULT_METRICS_LISTEN
    health_interval: float = DEFAULT_HEALTH_INTERVAL
    """Seconds between health rounds (a Go duration string in the file)."""
    health_fail_threshold: int = DEFAULT_HEALTH_FAIL_THRESHOLD
    max_buffered_response_bytes: int = DEFAULT_MAX_BUFFERED_RESPONSE_BYTES
    """The validated raw value: -1 means unlimited. Read `response_buffer_limit` to apply it."""
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    # Interlock additions.
    probe_timeout: float = DEFAULT_PROBE_TIMEOUT
    """Seconds one probe of a node may take (a Go duration string in the file)."""
    event_log: str = ""
    """Path of the JSON Lines event log; "" = no event log."""
    event_log_max_bytes: int = DEFAULT_EVENT_LOG_MAX_BYTES
    """The event log starts a new segment once the current one reaches this size."""
    event_log_retain_bytes: int = DEFAULT_LOG_RETAIN_BYTES
    """The oldest event-log segments are removed while all of them together are larger; 0 = no bound."""
    event_log_retain_age: float = 0.0
    """Event-log segments last written longer ago (seconds; a Go duration in the file) are
    removed; 0 = no bound."""
    decision_log: str = ""
    """Path of the per-request decision log; "" = no decision log."""
    decision_log_max_bytes: int = DEFAULT_DECISION_LOG_MAX_BYTES
    decision_log_retain_bytes: int = DEFAULT_LOG_RETAIN_BYTES
    decision_log_retain_age: float = 0.0
    """The decision log's segments and retention, as the event log's."""
    workers: Workers = 1
    """Processes serving the API: 1 is the gateway alone; more (or "auto", one per usable core)
    start that many workers that follow this process's control plane."""
    request_body_timeout: float = DEFAULT_REQUEST_BODY_TIMEOUT
    """Seconds a client may take to send a request body (a Go duration string in the file)."""
    request_body_idle_timeout: float = DEFAULT_REQUEST_BODY_IDLE_TIMEOUT
    """Seconds a request body may go without a byte arriving (a Go duration string in the file)."""
    response_body_timeout: float = DEFAULT_RESPONSE_BODY_TIMEOUT
    """Seconds a node may take to send the body of a non-streaming answer, from its head to its
    end (a Go duration string in the file); plinth has no such limit."""
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    """Seconds to open a connection to a node (a Go duration string in the file). A node that
    cannot be reached in time is marked offline and the request tried on the next one."""
    first_byte_timeout: float = DEFAULT_FIRST_BYTE_TIMEOUT
    """Seconds a stream may take from its request to the first byte of its body, the first
    token's time (a long prompt's prefill); a model's own overrides it."""
    response_timeout: float = DEFAULT_RESPONSE_TIMEOUT
    """Seconds a non-streaming request may take to the head of its answer, which vLLM sends once
    the whole generation is done; a model's own overrides it. Past either, the attempt ends
    (the node is not marked offline: slowness is load) and is retried on another node only
    with `retry_unanswered`, else the request gets a 504."""
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE
    """Seconds the drain after SIGTERM lets requests and streams in flight finish (a Go duration
    string in the file); a stream still open then ends with an error event. plinth's 10 s."""
    tls_certificate: str = ""
    """A PEM certificate (chain) file: with `tls_key`, the API listener serves HTTPS; "" = HTTP."""
    tls_key: str = ""
    """The PEM private key file of `tls_certificate`."""
    http2: bool = False
    """Serve HTTP/2 (cleartext, prior knowledge or `Upgrade: h2c`) on the API listener too."""
    retry_unanswered: bool = False
    """Retry a non-streaming request on another node when its connection broke before any byte
    of the response arrived (plinth answers 502), and any request whose node passed
    `first_byte_timeout` or `response_timeout` (else a 504)."""
    api_key_hashes: tuple[str, ...] = ()
    """SHA-256 hex digests of the client API keys the API listener accepts; () = no key needed.
    The loader gathers them from the file's `api_keys` (hashed as they are read), its
    `api_key_hashes` and the lines of `api_key_file`: a key itself is never kept, so the event
    log records only digests."""
    api_key_file: str = ""
    """A file of SHA-256 hex digests of client keys, one a line; read at each (re)load."""
    health_requires_api_key: bool = False
    """With client keys: whether `/health` and `/ready` on the API listener need one too (load
    balancers usually probe without)."""
    health_hides_errors: bool = False
    """`/health` on the API listener leaves out the nodes' error texts (they name addresses)."""
    upstream_api_key_file: str = ""
    """A file holding the key every node expects (vLLM's `--api-key`), sent by the model listing
    and the proxy; a node's own `api_key_file` takes precedence. A path, not the key, so that no
    key enters the event log; every process reads the file when it takes up a config."""
    log_level: str = LOG_LEVELS[0]
    """The least severe level logged, one of LOG_LEVELS."""
    log_format: str = LOG_FORMATS[0]
    """One of LOG_FORMATS."""

    @property
    def response_buffer_limit(self) -> int:
        """plinth's effective response buffer limit: 0 (no bound) when negative, default when 0.

        Holds for configs built directly, which never went through validation.
        """
        if self.max_buffered_response_bytes < 0:
            return 0
        return self.max_buffered_response_bytes or DEFAULT_MAX_BUFFERED_RESPONSE_BYTES

    @property
    def request_body_limit(self) -> int:
        """plinth's effective request body limit: the default when <= 0 (there is no unlimited)."""
        if self.max_request_body_bytes <= 0:
            return DEFAULT_MAX_REQUEST_BODY_BYTES
        return self.max_request_body_bytes


class RoutingConfig(Struct, frozen=True, kw_only=True):
    """How a node is chosen among the ones routing allows (ring, model list, health, offline)."""

    policy: str = POLICIES[0]
    """The cluster-wide policy, one of POLICIES; a model's own `policy` overrides it."""
    load_scrape_interval: float | None = None
    """Seconds between scrapes of each node's vLLM `/metrics` (a Go duration in the file); 0 =
    never. Unset: DEFAULT_LOAD_SCRAPE_INTERVAL when any configured policy reads load, else never
    (set it under round robin to record load for `interlock whatif`)."""
    prefix_messages: int = 0
    """`prefix_affinity`: the prompt prefix is the first this many chat messages (0 = all of them)…"""
    prefix_bytes: int = DEFAULT_PREFIX_BYTES
    """…cut to this many bytes of their text (a completion's prompt: its first bytes)."""
    load_bound: float = DEFAULT_LOAD_BOUND
    """`prefix_affinity`: a node whose work (load weighed by its time between tokens) is above
    this factor times the pool's mean is passed over for the next node in the prefix's order
    (consistent hashing with bounded loads)."""
    kv_index_blocks: int = DEFAULT_KV_INDEX_BLOCKS
    """The KV index (nodes with `kv_events`): the most blocks it keeps per node, the oldest
    stored forgotten first."""


class NodeConfig(Struct, frozen=True, kw_only=True):
    ip: str = ""
    """The node's identity: unique among the nodes."""
    name: str = ""
    vllm_port: int = DEFAULT_VLLM_PORT
    metrics_port: int = DEFAULT_METRICS_PORT
    ring: str = ""
    """"" = a standalone (ring-less) node."""
    api_key_file: str = ""
    """A file holding this node's key (vLLM's `--api-key`); "" = `gateway.upstream_api_key_file`."""
    role: str = "both"
    """One of ROLES: what the node does in prefill/decode disaggregation (vLLM's NixlConnector).
    A model whose candidates include a `prefill` or a `decode` node is served in two legs: the
    prefill on a `prefill` (or `both`) node, the decode on a `decode` (or `both`) node."""
    scheme: str = "http"
    """How the vLLM port is reached: "http" or "https" (the GPU exporter's port stays plain HTTP)."""
    ca_file: str = ""
    """https: the PEM CA certificates the node's certificate is checked against; "" = the system's."""
    client_certificate: str = ""
    client_key: str = ""
    """https: the certificate (PEM chain) and key the gateway shows the node (mutual TLS); both or neither."""
    max_in_flight: int | None = None
    """The admission queue: the node counts as saturated while this gateway process has this many
    requests in flight to it (`AdmissionConfig`); None = no such bound. Needs the queue on."""
    kv_events: str = ""
    """Where the node publishes its KV events, "tcp://HOST:PORT" (vLLM's `--kv-events-config`
    `endpoint`, as the gateway reaches it); "" = none: the gateway knows nothing of its cache."""
    kv_events_replay: str = ""
    """The node's replay socket, "tcp://HOST:PORT" (vLLM's `replay_endpoint`), asked for the
    batches a gap lost; "" = none: a gap clears the node's index."""
    kv_events_topic: str = ""
    """The topic the node publishes on (vLLM's `topic`); "" = any."""
    scheduling: str = "fcfs"
    """One of SCHEDULING, as the node's vLLM `--scheduling-policy`: "priority" = the gateway sends
    each request's rank (`saturation.rank`: its admission priority, and ahead within it for a
    tenant under its fair share) in the body's `priority` member, negated (vLLM handles lower
    values first), so the node admits and preempts by it."""


SCHEDULING = ("fcfs", "priority")
"""A node's `scheduling`: vLLM's `--scheduling-policy`."""

ROLES = ("both", "prefill", "decode")
"""A node's `role`: whole requests (and either leg), the prefill leg only, the decode leg only."""


class ModelEntry(Struct, frozen=True, kw_only=True):
    name: str = ""
    """Must equal the id the node serves (`GET /v1/models` `data[].id`) exactly."""
    pipeline_stages: int = 0
    """Informational only."""
    ring: str = ""
    policy: str = ""
    """This model's routing policy (one of POLICIES); "" = `routing.policy`."""
    target: str = ""
    """An alias: the model this name stands for. A request naming it is routed as a request for
    `target` (its ring, policy and nodes), with the body's `model` rewritten to `target`; "" = not
    an alias."""
    parent: str = ""
    """A LoRA adapter: the base model it applies to (vLLM lists a loaded adapter in `/v1/models`
    with this `parent`); requests for it prefer the nodes that run it. "" = not an adapter."""
    lora_path: str = ""
    """With `parent`: where vLLM loads the adapter from. The gateway loads it (`POST
    /v1/load_lora_adapter`) onto each healthy node that lists `parent` and not the adapter; "" =
    the gateway loads nothing."""
    tokenizer: str = ""
    """A local directory of the model's tokenizer (tokenizer.json, tokenizer_config.json with its
    chat template): `kv_aware` tokenizes each prompt with it as vLLM does (`kvcache.tokenizer`);
    "" = its prompts are not tokenized (kv_aware falls back to prefix affinity)."""
    connect_timeout: float | None = None
    first_byte_timeout: float | None = None
    response_timeout: float | None = None
    """This model's upstream timeouts (Go durations in the file); None = `[gateway]`'s."""


class UpstreamTimeouts(Struct, frozen=True):
    """The limits on one attempt at a node, in seconds (`GatewayConfig.connect_timeout` and the two after it)."""

    connect: float
    first_byte: float
    response: float


class ModelsConfig(Struct, frozen=True, kw_only=True):
    default: str = ""
    """Injected into requests that name no model; not checked against `available`."""
    available: tuple[ModelEntry, ...] = ()


class FleetConfig(Struct, frozen=True, kw_only=True):
    """`[fleet]`: replicas on several hosts that follow one leader through NATS JetStream."""

    nats: tuple[str, ...] = ()
    """The NATS servers' URLs (`nats://host:4222`); `interlock serve --fleet` sets them."""
    name: str = ""
    """The prefix of the fleet's streams and keys (the loader's default: DEFAULT_FLEET_NAME)."""
    replica: str = ""
    """This host's name in the fleet (the loader's default: the host name)."""
    lease: float = 0.0
    """Seconds the leader's lease lasts unless renewed (the loader's default: DEFAULT_FLEET_LEASE)."""
    lease_renewal: float = 0.0
    """Seconds between the leader's renewals, at most half the lease (DEFAULT_FLEET_LEASE_RENEWAL)."""
    stream_replicas: int = 0
    """Copies JetStream keeps of the fleet's streams, set when the first replica creates them;
    0: one per server of the cluster the replica knows, up to three."""
    user: str = ""
    password: str = ""
    """The NATS user and its password (both or neither)."""
    token: str = ""
    """A NATS authentication token."""
    nkey_seed_file: str = ""
    """A file holding the NKey seed (`SU…`) this replica signs the server's challenge with."""
    creds_file: str = ""
    """A NATS credentials file (a user JWT and its NKey seed, as `nsc` writes it)."""
    tls_ca_file: str = ""
    """The PEM CA certificates the NATS servers' certificates are checked against; "" = the system's."""
    tls_certificate: str = ""
    tls_key: str = ""
    """The certificate (PEM chain) and key this replica shows the NATS servers (mutual TLS); both or neither."""
    partition_after: float = 0.0
    """Seconds without the fleet's stream after which this replica enters a partition: it probes
    the nodes and numbers its own events (`fleet.partition`); the loader's default:
    PARTITION_AFTER_INTERVALS health intervals."""
    partition_dir: str = ""
    """Where this replica writes each partition's records, a directory per partition (the
    loader's default: DEFAULT_PARTITION_DIR, in the working directory)."""
    decision_spool_bytes: int = 0
    """The bound of this replica's encoded decision records waiting for the fleet's decision
    stream (`fleet.decisions`; the loader's default: DEFAULT_DECISION_SPOOL_BYTES)."""
    config_version: int = 0
    """Not a key of the file: in the config the fleet runs (its events' `[fleet]`, every other
    key of the table empty), the version of the fleet's config document it is (0 elsewhere)."""


DEFAULT_TENANT = "default"
"""The tenant of every request when no client keys are configured (a `[[tenants]]` of that name
may set its limits)."""
GATEWAY_TENANT = "gateway"
"""The tenant of the keys in `[gateway]`: no limits."""
DEFAULT_MAX_TOKENS = 1024
"""`admission.default_max_tokens`'s default."""


class TenantConfig(Struct, frozen=True, kw_only=True):
    """`[[tenants]]`: who a client is (its keys) and how much it may use. Every limit is optional."""

    name: str = ""
    api_key_hashes: tuple[str, ...] = ()
    """SHA-256 hex digests of the tenant's keys, gathered by the loader as `[gateway]`'s are
    (`api_keys` hashed as read, `api_key_hashes`, the lines of `api_key_file`)."""
    api_key_file: str = ""
    priority: int = 0
    """Higher is served first when requests wait."""
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    """Prompt plus completion tokens, as the node reports them in `usage`."""
    max_in_flight: int | None = None
    max_queue_seconds: float | None = None
    """Seconds a request of the tenant may wait in the gateway's queue (None: `[admission]`'s
    `max_queue_seconds`)."""


DEFAULT_SATURATION_WAITING = 5
DEFAULT_SATURATION_KV_CACHE = 0.8
DEFAULT_QUEUE_SIZE = 1024
DEFAULT_TENANT_QUEUE_SIZE = 256
DEFAULT_MAX_QUEUE_SECONDS = 30.0


class AdmissionConfig(Struct, frozen=True, kw_only=True):
    """`[admission]`: how requests are admitted. Tenants' limits (`[[tenants]]`) hold whether
    or not the table is there; the queue (`dataplane.admission.queue`) runs only when `queue`."""

    objectives: dict[str, int] = {}
    """Named priorities that llm-d's `x-gateway-inference-objective` header may ask for (a
    request's priority is never raised above its tenant's)."""
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    """Tokens reserved for a completion whose body names no `max_tokens` (a tenant with a
    token limit); a chat or text completion gets it as its `max_tokens`, less when the tenant's
    remaining tokens allow less (`dataplane.admission.tokens.completion_bound`)."""
    queue: bool = False
    """While every node that could serve a model is saturated, its requests wait in the gateway
    (`dataplane.admission.queue`), not in the nodes' own queues. The loader makes it true when
    the file has an `[admission]` table that does not set it (`queue = false` keeps the table's
    other keys without the queue)."""
    saturation_waiting: int = DEFAULT_SATURATION_WAITING
    """A node is saturated while its scraped `vllm:num_requests_waiting` is at least this…"""
    saturation_kv_cache: float = DEFAULT_SATURATION_KV_CACHE
    """…or its scraped KV-cache usage (0 to 1) at least this (or `NodeConfig.max_in_flight` is reached)."""
    queue_size: int = DEFAULT_QUEUE_SIZE
    """Requests that may wait in one gateway process's queue, all tenants together; more get a 429."""
    tenant_queue_size: int = DEFAULT_TENANT_QUEUE_SIZE
    """Requests of one tenant that may wait in one process's queue; more get a 429."""
    max_queue_seconds: float = DEFAULT_MAX_QUEUE_SECONDS
    """Seconds a request may wait in the queue (a tenant's `max_queue_seconds` overrides it), then
    a 503 with Retry-After (0: never waits)."""
    priority_headroom: int = 0
    """In-flight places per node kept free for the highest configured tenant priority: a request
    of a lower priority counts a node with a `max_in_flight` as saturated this many places early
    (`controlplane.rules.saturation.priority_headroom`), so a higher one finds a place at once rather
    than after the next request ends. 0: every priority may fill `max_in_flight`."""


class Config(Struct, frozen=True, kw_only=True):
    cluster: ClusterConfig = ClusterConfig()
    gateway: GatewayConfig = GatewayConfig()
    nodes: tuple[NodeConfig, ...] = ()
    models: ModelsConfig = ModelsConfig()
    routing: RoutingConfig = RoutingConfig()
    fleet: FleetConfig | None = None
    """None: one host, no NATS (no `[fleet]` table and no `serve --fleet`)."""
    tenants: tuple[TenantConfig, ...] = ()
    admission: AdmissionConfig = AdmissionConfig()

    def aliases(self) -> dict[str, str]:
        """Each alias (`ModelEntry.target`) with the model it stands for."""
        return {model.name: model.target for model in self.models.available if model.target}

    def loaded_adapters(self) -> dict[str, ModelEntry]:
        """Each adapter the gateway loads onto nodes (`ModelEntry.lora_path`), by name."""
        return {model.name: model for model in self.models.available if model.lora_path}

    def served_models(self) -> tuple[str, ...]:
        """The configured models that nodes serve: every entry but the aliases, in file order."""
        return tuple(model.name for model in self.models.available if not model.target)

    def model_ring(self, name: str) -> str:
        """plinth's ModelRing: the ring of the first available model named `name`, else ""."""
        for model in self.models.available:
            if model.name == name:
                return model.ring
        return ""

    def model_policy(self, name: str) -> str:
        """The policy `name` is routed by: the first available model named so, else the cluster's."""
        for model in self.models.available:
            if model.name == name:
                return model.policy or self.routing.policy
        return self.routing.policy

    def upstream_timeouts(self, name: str) -> UpstreamTimeouts:
        """The timeouts of an attempt for model `name`: the first available model named so sets
        its own, `[gateway]` the others."""
        gateway = self.gateway
        timeouts = [gateway.connect_timeout, gateway.first_byte_timeout, gateway.response_timeout]
        for model in self.models.available:
            if model.name == name:
                own = (model.connect_timeout, model.first_byte_timeout, model.response_timeout)
                timeouts = [default if value is None else value for value, default in zip(own, timeouts)]
                break
        return UpstreamTimeouts(*timeouts)

    def load_scrape_interval(self) -> float:
        """Seconds between load scrapes of each node; 0 = none (see `RoutingConfig`). Admission
        reads load as the load-aware policies do."""
        interval = self.routing.load_scrape_interval
        if interval is not None:
            return interval
        policies = {self.routing.policy, *(model.policy for model in self.models.available if model.policy)}
        reads_load = policies != {POLICIES[0]} or self.admission.queue
        return DEFAULT_LOAD_SCRAPE_INTERVAL if reads_load else 0.0

    def upstream_key_files(self) -> dict[str, str]:
        """The key file of each node that has one (its own, else the cluster-wide one), by IP."""
        cluster_wide = self.gateway.upstream_api_key_file
        files = {node.ip: node.api_key_file or cluster_wide for node in self.nodes}
        return {ip: path for ip, path in files.items() if path}

    def disaggregation_roles(self) -> dict[str, str]:
        """The role of each node that is not `both`, by IP (empty: no disaggregation)."""
        return {node.ip: node.role for node in self.nodes if node.role != ROLES[0]}

    def https_nodes(self) -> list[NodeConfig]:
        """The nodes whose vLLM port is reached over HTTPS."""
        return [node for node in self.nodes if node.scheme == "https"]

    def node(self, ip: str) -> NodeConfig | None:
        for node in self.nodes:
            if node.ip == ip:
                return node
        return None

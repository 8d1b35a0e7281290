"""Probes: the effects that turn a node's HTTP answers into events (plinth §2.2, §8.3).

Every probe is one `GET` through `ProbeClient`, the single place that talks HTTP: one shared
client (`transport.http11`, keep-alive connections per node and port, each probe's request
bytes built once), one deadline covering connect and read, and a hard cap on the body (plinth
follow-up #39), so a hung or hostile node can cost neither time nor memory beyond its bounds.

The probes are step generators (`transport.readiness`): generators that never block, so that one
task runs every probe of a round together (`controlplane.effects.prober.Prober`).

The probe functions never raise (cancellation aside): a transport or parse failure is part of
the event they return, and `check_node` turns any unexpected exception into a ProbeCrashed.
"""

from __future__ import annotations

import json
import math
import re
import ssl
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec
import trio

from events.config import ModelEntry, NodeConfig
from events.state import MAX_LORA_ADAPTERS, GpuSample, LoraInfo, ModelCard
from events.types import (
    MAX_MODEL_NAME_LENGTH,
    AdapterLoaded,
    AdapterLoadFailed,
    Event,
    GpuScraped,
    HealthProbed,
    LoadScraped,
    ModelsListed,
    ProbeCrashed,
)
from transport.http11 import BodyTooLarge, HttpClient, HttpError
from transport.steps import PreparedRequest, request_steps
from transport.readiness import InThread, Steps, TimedOut

MAX_BODY_BYTES = 4 * 1024 * 1024
"""Largest response body a probe reads (#39); a larger one is a probe error."""

MAX_LISTED_MODELS = 4096
"""The most ids a node's model listing may hold; a longer listing is a listing error. A vLLM
node lists its model and its LoRA adapters (hundreds for a many-tenant node); every listing
goes whole into the event log, /health and the node's state, so a node that lists without
limit would grow each of them (each id is at most MAX_MODEL_NAME_LENGTH characters)."""

MAX_LISTING_CHARACTERS = 1024 * 1024
"""The most characters a node's listing may keep in all (its ids, parents and roots); a larger
listing is a listing error. The count and each id's length bound it already, but at their
limits a listing would weigh over 2 MB in the node's state and in each change recorded."""

MAX_GPUS_PER_SCRAPE = 256
"""The most GPUs a node's GPU exporter may report (a node has eight or sixteen); a scrape that
reports more is a scrape error, as every scrape goes whole into the event log and /health."""

PARSE_ON_LOOP_BYTES = 64 * 1024
"""The largest answer parsed on the event loop: a larger one is parsed in a worker thread, so
that a node's big answer (up to MAX_BODY_BYTES) never holds up the API or the other probes.
A vLLM `/metrics` is tens of KB; the trip to a thread costs more than parsing a small answer."""

MAX_LOAD_LABEL_SETS = 256
"""The most samples a node's vLLM `/metrics` may give one load gauge or histogram (one per
engine and model: a handful); a scrape with more is a scrape error, read no further."""

KEEPALIVE_SECONDS = 60.0
"""How long an idle connection to a node is kept for the next probe (longer than a health interval)."""

MAX_IDLE_PER_PORT = 3
"""Idle connections kept per node and port: `/health`, `/v1/models` and `/metrics` may overlap on the vLLM port."""

_HEADERS = ((b"user-agent", b"interlock-probe"), (b"accept-encoding", b"identity"))

Clock = Callable[[], float]


class ProbeError(Exception):
    """A probe that got no usable answer; the text goes into the event."""


class ProbeResponse(NamedTuple):
    status: int
    body: bytes


class ProbeClient:
    """The probes' HTTP client: `GET` within a deadline, reading at most `max_body_bytes`.

    One instance serves every probe of every node, keeping connections alive per node and port.
    """

    def __init__(self, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.max_body_bytes = max_body_bytes
        self._http = HttpClient(max_idle_per_host=MAX_IDLE_PER_PORT, idle_seconds=KEEPALIVE_SECONDS)
        self._prepared: dict[tuple[str, int, bytes, bytes], PreparedRequest] = {}

    async def __aenter__(self) -> ProbeClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._http.close()

    async def forget(self, host: str) -> None:
        """Close the connections to a node that is no longer probed."""
        self._http.forget(host)
        for key in [key for key in self._prepared if key[0] == host]:
            del self._prepared[key]

    def get_steps(
        self,
        host: str,
        port: int,
        path: bytes,
        timeout: float,
        authorization: bytes = b"",
        tls: ssl.SSLContext | None = None,
    ) -> Steps:
        """The status and body of `GET path` on host:port (with that `Authorization` header, if
        any; over HTTPS with `tls`), as a step generator; raises ProbeError on a transport failure, when connecting and
        reading take longer than `timeout` seconds, or when the body is too big (then the
        connection is dropped unread)."""
        key = (host, port, path, authorization)
        request = self._prepared.get(key)
        if request is None or request.pool.tls is not tls:  # new, or a reload's new context
            headers = (*_HEADERS, (b"authorization", authorization)) if authorization else _HEADERS
            request = self._prepared[key] = self._http.prepare(b"GET", host, port, path, headers, tls=tls)
        try:
            status, body = yield from request_steps(request, trio.current_time() + timeout, self.max_body_bytes)
        except BodyTooLarge as exc:
            raise ProbeError(str(exc)) from None
        except HttpError as exc:
            raise ProbeError(f'Get "{node_url(host, port, path, tls is not None)}": {exc}') from None
        except TimedOut:
            url = node_url(host, port, path, tls is not None)
            raise ProbeError(f'Get "{url}": timed out after {timeout:g}s') from None
        return ProbeResponse(status, body)

    async def post(
        self,
        host: str,
        port: int,
        path: bytes,
        body: bytes,
        timeout: float,
        authorization: bytes = b"",
        tls: ssl.SSLContext | None = None,
    ) -> ProbeResponse:
        """The status and body of a JSON `POST path` (the control plane's rare requests to a
        node, such as loading an adapter); ProbeError as `get_steps`."""
        headers = [*_HEADERS, (b"content-type", b"application/json")]
        if authorization:
            headers.append((b"authorization", authorization))
        url = node_url(host, port, path, tls is not None)
        with trio.move_on_after(timeout):
            try:
                response = await self._http.request(
                    b"POST", host, port, path, headers, body, connect_timeout=timeout, tls=tls
                )
                try:
                    return ProbeResponse(response.status, await response.read_body(self.max_body_bytes))
                finally:
                    response.close()
            except BodyTooLarge as exc:
                raise ProbeError(str(exc)) from None
            except HttpError as exc:
                raise ProbeError(f'Post "{url}": {exc}') from None
        raise ProbeError(f'Post "{url}": timed out after {timeout:g}s')


def parsed(parse: Callable[[bytes], Any], body: bytes) -> Steps:
    """`parse(body)`, in a worker thread when the body is over PARSE_ON_LOOP_BYTES."""
    if len(body) > PARSE_ON_LOOP_BYTES:
        return (yield InThread(parse, body))
    return parse(body)


def node_url(ip: str, port: int, path: bytes, https: bool = False) -> str:
    host = f"[{ip}]" if ":" in ip else ip
    return f"{'https' if https else 'http'}://{host}:{port}{path.decode()}"


def probe(
    client: ProbeClient,
    node: NodeConfig,
    port: int,
    path: bytes,
    *,
    timeout: float,
    answered: Callable[[Any], Event],
    failed: Callable[[str], Event],
    parse: Callable[[bytes], Any] | None = None,
    endpoint: str = "",
    crashed: str = "",
    authorization: bytes = b"",
    tls: ssl.SSLContext | None = None,
) -> Steps:
    """Every probe's skeleton: `GET path` on the node's `port`, then its event. With `parse`,
    an answer other than 200 is an error (`<endpoint> returned status N`), and the body is
    parsed (in a thread when large) into what `answered` makes the event of; without, the
    response itself is the answer. A transport or parse failure (ProbeError) is the event
    `failed` makes of its text; any other exception too, as `<crashed> crashed: …`, when the
    probe names itself so (a bug must cost one probe, never its loop), and raises otherwise."""
    try:
        response = yield from client.get_steps(node.ip, port, path, timeout, authorization, tls)
        if parse is None:
            return answered(response)
        if response.status != 200:
            raise ProbeError(f"{endpoint} returned status {response.status}")
        answer = yield from parsed(parse, response.body)
    except ProbeError as exc:
        return failed(str(exc))
    except Exception as exc:
        if not crashed:
            raise
        return failed(f"{crashed} crashed: {type(exc).__name__}: {exc}")
    return answered(answer)


# --- health and GPU metrics (one health check) ----------------------------------------------


def check_node(
    client: ProbeClient, node: NodeConfig, *, timeout: float, now: Clock, tls: ssl.SSLContext | None = None
) -> Steps:
    """One health check as plinth runs it: `/health`, then the GPU scrape.

    Returns (HealthProbed, GpuScraped), or (ProbeCrashed,) if anything raised unexpectedly:
    plinth's recovered panic, which leaves the node's health untouched.
    """
    try:
        health = yield from probe_health(client, node, timeout=timeout, now=now, tls=tls)
        gpus = yield from scrape_gpus(client, node, timeout=timeout, now=now)
    except Exception as exc:
        return (ProbeCrashed(at=now(), node=node.ip, error=f"{type(exc).__name__}: {exc}"),)
    return (health, gpus)


def probe_health(
    client: ProbeClient, node: NodeConfig, *, timeout: float, now: Clock, tls: ssl.SSLContext | None = None
) -> Steps:
    """`GET /health` on the vLLM port (over HTTPS with `tls`): healthy iff it answers 200 (a HealthProbed)."""
    started = trio.current_time()
    return (
        yield from probe(
            client, node, node.vllm_port, b"/health", timeout=timeout, tls=tls,
            answered=lambda response: HealthProbed(
                at=now(), node=node.ip, ok=response.status == 200, status=response.status, latency=_since(started)
            ),
            failed=lambda error: HealthProbed(at=now(), node=node.ip, ok=False, error=error, latency=_since(started)),
        )
    )  # fmt: skip


def _since(started: float) -> float:
    return round(trio.current_time() - started, 6)


def scrape_gpus(client: ProbeClient, node: NodeConfig, *, timeout: float, now: Clock) -> Steps:
    """`GET /metrics` on the gpu-exporter port (a GpuScraped); `gpus` is empty when the scrape
    gave no result."""
    return (
        yield from probe(
            client, node, node.metrics_port, b"/metrics", timeout=timeout,
            parse=parse_gpu_metrics, endpoint="metrics endpoint",
            answered=lambda gpus: GpuScraped(at=now(), node=node.ip, gpus=gpus),
            failed=lambda error: GpuScraped(at=now(), node=node.ip, error=error),
        )
    )  # fmt: skip


_GPU_FIELDS = {
    "gpu_memory_used_bytes": "memory_used",
    "gpu_memory_total_bytes": "memory_total",
    "gpu_utilization_percent": "utilization",
    "gpu_temperature_celsius": "temperature",
}
_INT64_MAX = 2**63 - 1


def parse_gpu_metrics(body: bytes) -> tuple[GpuSample, ...]:
    """plinth's scrape parser (§2.2): `name{…gpu="UUID"…} value` lines, by GPU in order of
    first appearance. A line with an unknown metric name still creates its GPU's entry.
    Raises ProbeError once more than MAX_GPUS_PER_SCRAPE GPUs appear."""
    gpus: dict[str, dict[str, int]] = {}
    for line in body.decode("utf-8", "replace").split("\n"):
        if line.startswith("#"):
            continue  # most lines are HELP and TYPE comments: skip them before splitting
        fields = line.split()
        if len(fields) != 2 or fields[0].startswith("#"):
            continue
        token, text = fields
        value = parse_sample_value(text)
        uuid = _gpu_label(token)
        if value is None or not uuid:
            continue
        sample = gpus.get(uuid)
        if sample is None:
            if len(gpus) == MAX_GPUS_PER_SCRAPE:
                raise ProbeError(f"gpu scrape: more than {MAX_GPUS_PER_SCRAPE} GPUs")
            sample = gpus[uuid] = {}
        field = _GPU_FIELDS.get(token.partition("{")[0])
        if field is not None and math.isfinite(value):
            sample[field] = max(-_INT64_MAX - 1, min(_INT64_MAX, int(value)))  # Go's int64(f) truncates
    return tuple(GpuSample(uuid=uuid, **values) for uuid, values in gpus.items())


def parse_sample_value(text: str) -> float | None:
    """A sample's value as Prometheus' text format has it, read as Go's strconv.ParseFloat reads
    it (plinth's GPU scrape, Prometheus itself): a decimal or `NaN`, `+Inf`, `-Inf`; else None.
    Python's float() also takes underscores (`1_000`) and other scripts' digits, which neither does."""
    if "_" in text or not text.isascii():
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _gpu_label(token: str) -> str:
    start = token.find('gpu="')
    if start < 0:
        return ""
    value, closed, _ = token[start + 5 :].partition('"')
    return value if closed else ""


# --- load (vLLM's own metrics) --------------------------------------------------------------


def scrape_load(
    client: ProbeClient,
    node: NodeConfig,
    *,
    timeout: float,
    now: Clock,
    authorization: bytes = b"",
    tls: ssl.SSLContext | None = None,
) -> Steps:
    """`GET /metrics` on the vLLM port (a LoadScraped): the requests running and waiting, and
    the KV-cache usage, or the error (capped) when the scrape gave no usable answer.

    `authorization` is the node's upstream key header. vLLM's `--api-key` guards only `/v1`, but
    a node behind a proxy that guards every path needs it, and it goes to the host and port that
    already get it with every model listing and completion, so sending it reveals nothing new.
    """
    return (
        yield from probe(
            client, node, node.vllm_port, b"/metrics", timeout=timeout, authorization=authorization, tls=tls,
            parse=parse_vllm_load, endpoint="vLLM metrics endpoint", crashed="load scrape",
            answered=lambda load: LoadScraped(
                at=now(), node=node.ip, running=load.running, waiting=load.waiting,
                kv_cache_usage=load.kv_cache_usage, token_seconds=load.token_seconds, tokens=load.tokens,
                lora=load.lora,
            ),
            failed=lambda error: LoadScraped(at=now(), node=node.ip, error=_capped(error)),
        )
    )  # fmt: skip


MAX_LOAD_ERROR_CHARS = 300
"""Longest scrape error kept in a LoadScraped (and so in the event log, /health and the state)."""

LOAD_METRICS_MISSING = "load metrics missing: no vllm:num_requests_running nor vllm:num_requests_waiting sample"

_RUNNING, _WAITING = b"vllm:num_requests_running", b"vllm:num_requests_waiting"
_KV_CACHE_USAGE = (b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc")
"""KV-cache usage (0..1) under vLLM's newer name and its older one."""
_TOKEN_HISTOGRAMS = (b"vllm:inter_token_latency_seconds", b"vllm:time_per_output_token_seconds")
"""The histogram of the time between two output tokens, under vLLM's newer name and its older
one; when a node exports both, the newer one is read."""

_LORA_INFO = b"vllm:lora_requests_info"
"""vLLM's LoRA gauge: its labels name the adapters running and waiting, its value is the time
the label set was last current (a new set is added whenever they change)."""

_LOAD_SAMPLE = re.compile(
    rb"\n(vllm:(?:num_requests_running|num_requests_waiting|kv_cache_usage_perc|gpu_cache_usage_perc"
    rb"|lora_requests_info|(?:inter_token_latency|time_per_output_token)_seconds_(?:sum|count)))"
    rb'[ \t]*(\{(?:[^"}\n]++|"(?:[^"\\\n]++|\\.)*+")*+\})?[ \t]+([^ \t\r\n]+)'
)
"""One sample line of a load gauge, of the LoRA gauge, or of the token histogram's sum or count,
in Prometheus' text format: the name at the start of a line (so `# HELP` and `# TYPE` never
match), any labels (a quoted value may hold `}`, spaces and escaped quotes), whitespace, the
value; a timestamp after it is ignored. A longer name (`vllm:num_requests_running_max`) does not
match: its next character is neither `{` nor blank. The labels are read in runs that never give back
(possessive quantifiers): what the parse costs is mostly the labels of the histograms' sums."""


class VllmLoad(NamedTuple):
    """What a node's vLLM `/metrics` says of its load."""

    running: float
    waiting: float
    kv_cache_usage: float | None = None
    token_seconds: float | None = None
    """The token histogram's sum: seconds between output tokens, counted since the node started."""
    tokens: float | None = None
    """The token histogram's count: the gaps between output tokens summed in `token_seconds`."""
    lora: LoraInfo | None = None


def parse_vllm_load(body: bytes) -> VllmLoad:
    """Requests running and waiting, summed over the label sets (models, engines), the largest
    KV-cache usage, and the token histogram's sum and count (each summed over its label sets),
    from vLLM's `/metrics`. A sample that is not a finite non-negative number (`NaN`, `+Inf`,
    junk) is skipped. A gauge with no sample counts 0 if the other has one; neither is
    ProbeError(LOAD_METRICS_MISSING), and more than MAX_LOAD_LABEL_SETS samples of one name a
    ProbeError naming it. Only these lines are looked at (a regular expression over the whole
    body), since vLLM's exposition is mostly histograms."""
    sums: dict[bytes, float] = {}
    samples: dict[bytes, int] = {}
    kv_cache_usage = None
    lora: tuple[float, bytes] | None = None
    """The newest LoRA sample: its value and its labels."""
    for match in _LOAD_SAMPLE.finditer(b"\n" + body):
        name, labels, text = match.groups()
        value = parse_sample_value(text.decode("latin-1"))
        if name == _LORA_INFO:  # label sets pile up as adapters come and go: only the newest counts
            if value is not None and math.isfinite(value) and (lora is None or value >= lora[0]):
                lora = value, labels or b""
            continue
        samples[name] = count = samples.get(name, 0) + 1
        if count > MAX_LOAD_LABEL_SETS:
            raise ProbeError(f"{name.decode()}: more than {MAX_LOAD_LABEL_SETS} label sets")
        if value is None or not (math.isfinite(value) and value >= 0):
            continue
        if name in _KV_CACHE_USAGE:
            kv_cache_usage = value if kv_cache_usage is None else max(kv_cache_usage, value)
        else:
            sums[name] = sums.get(name, 0.0) + value
    if _RUNNING not in sums and _WAITING not in sums:
        raise ProbeError(LOAD_METRICS_MISSING)
    token_seconds = tokens = None
    for histogram in _TOKEN_HISTOGRAMS:
        if histogram + b"_sum" in sums and histogram + b"_count" in sums:
            token_seconds, tokens = sums[histogram + b"_sum"], sums[histogram + b"_count"]
            break
    lora_info = parse_lora_labels(lora[1]) if lora is not None else None
    return VllmLoad(sums.get(_RUNNING, 0.0), sums.get(_WAITING, 0.0), kv_cache_usage, token_seconds, tokens, lora_info)


_LABEL = re.compile(rb'([A-Za-z_][A-Za-z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"')
_LABEL_ESCAPES = re.compile(rb"\\(.)")
MAX_LORA_SLOTS = 1 << 16
"""The largest `max_lora` kept (vLLM's `--max-loras` is a handful); a larger figure is read as this."""


def parse_lora_labels(labels: bytes) -> LoraInfo:
    """The `max_lora`, `running_lora_adapters` and `waiting_lora_adapters` labels of a
    `vllm:lora_requests_info` sample (the adapters comma-separated). Each list keeps at most
    MAX_LORA_ADAPTERS names of at most MAX_MODEL_NAME_LENGTH characters; the others are counted
    in `truncated`."""
    values = {
        name: _LABEL_ESCAPES.sub(lambda escape: b"\n" if escape[1] == b"n" else escape[1], value)
        for name, value in _LABEL.findall(labels)
    }
    truncated = 0

    def adapters(label: bytes) -> tuple[str, ...]:
        nonlocal truncated
        names = [name for name in values.get(label, b"").decode("utf-8", "replace").split(",") if name]
        kept = [name for name in names if len(name) <= MAX_MODEL_NAME_LENGTH][:MAX_LORA_ADAPTERS]
        truncated += len(names) - len(kept)
        return tuple(kept)

    slots = values.get(b"max_lora", b"").strip()
    max_lora = min(int(slots), MAX_LORA_SLOTS) if slots.isdigit() else 0
    running, waiting = adapters(b"running_lora_adapters"), adapters(b"waiting_lora_adapters")
    return LoraInfo(max_lora=max_lora, running=running, waiting=waiting, truncated=truncated)


def _capped(error: str) -> str:
    return error if len(error) <= MAX_LOAD_ERROR_CHARS else error[: MAX_LOAD_ERROR_CHARS - 1] + "…"


# --- loading a LoRA adapter (vLLM's runtime API) --------------------------------------------

ADAPTER_LOAD_TIMEOUT = 120.0
"""Seconds a node may take to answer a load of an adapter (vLLM may fetch it from a hub first)."""

_ALREADY_LOADED = b"has already been loaded"
"""vLLM's 400 for an adapter it has: the load's purpose is met."""


async def load_adapter(
    client: ProbeClient,
    node: NodeConfig,
    adapter: ModelEntry,
    *,
    now: Clock,
    authorization: bytes = b"",
    tls: ssl.SSLContext | None = None,
) -> AdapterLoaded | AdapterLoadFailed:
    """`POST /v1/load_lora_adapter {"lora_name", "lora_path"}` (vLLM run with
    `VLLM_ALLOW_RUNTIME_LORA_UPDATING`): AdapterLoaded when the node has the adapter, else
    AdapterLoadFailed with its status and answer, or the transport error (capped). Never raises
    (cancellation aside)."""
    body = msgspec.json.encode({"lora_name": adapter.name, "lora_path": adapter.lora_path})
    try:
        response = await client.post(
            node.ip, node.vllm_port, b"/v1/load_lora_adapter", body, ADAPTER_LOAD_TIMEOUT, authorization, tls
        )
    except ProbeError as exc:
        return AdapterLoadFailed(at=now(), node=node.ip, adapter=adapter.name, error=_capped(str(exc)))
    if response.status == 200 or (response.status == 400 and _ALREADY_LOADED in response.body):
        return AdapterLoaded(at=now(), node=node.ip, adapter=adapter.name)
    answer = response.body.decode("utf-8", "replace")
    error = _capped(f"load_lora_adapter returned status {response.status}: {answer}")
    return AdapterLoadFailed(at=now(), node=node.ip, adapter=adapter.name, error=error, status=response.status)


# --- model discovery (GH-31) ----------------------------------------------------------------


def list_models(
    client: ProbeClient,
    node: NodeConfig,
    *,
    timeout: float,
    now: Clock,
    authorization: bytes = b"",
    tls: ssl.SSLContext | None = None,
) -> Steps:
    """`GET /v1/models` (a ModelsListed): the ids the node serves, in its order, or None and the
    error (§8.3). `authorization` is the node's upstream key header (vLLM's `--api-key` guards
    `/v1`; its `/health` is open, so the health check sends none)."""
    return (
        yield from probe(
            client, node, node.vllm_port, b"/v1/models", timeout=timeout, authorization=authorization, tls=tls,
            parse=parse_model_list, endpoint="models endpoint", crashed="model listing",
            answered=lambda listing: ModelsListed(
                at=now(), node=node.ip, models=listing.ids, parents=listing.parents, cards=listing.cards
            ),
            failed=lambda error: ModelsListed(at=now(), node=node.ip, error=error),
        )
    )  # fmt: skip


MISSING_DATA = "parse model list: missing data field"

_JSON_WHITESPACE = " \t\n\r"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"invalid character {name[0]!r} looking for beginning of value")


_json_decoder = json.JSONDecoder(parse_constant=_reject_constant)


class ModelListing(NamedTuple):
    ids: tuple[str, ...]
    """Every entry's id, in the node's order."""
    parents: tuple[tuple[str, str], ...]
    """The entries with a `parent` (vLLM's loaded LoRA adapters), each with it."""
    cards: tuple[ModelCard, ...]
    """The entries with vLLM's `root` or `max_model_len`, for the gateway's own listing."""


def parse_model_list(body: bytes) -> ModelListing:
    """The ids of an OpenAI model list, as plinth decodes it with Go's encoding/json, and the
    parent of each entry that has one (a string, at most MAX_MODEL_NAME_LENGTH characters, or
    the listing is an error; null or absent: not an adapter).

    Only the first JSON value counts (trailing bytes are ignored); a body without `data` (or
    with `data: null`) is an error, so an error object on HTTP 200 is never an empty list;
    an item without `id` gives "". Keys match case-insensitively, the last match winning, as
    in Go. Raises ProbeError("parse model list: …"), also for a list of more than
    MAX_LISTED_MODELS ids, an id longer than MAX_MODEL_NAME_LENGTH characters, or more than
    MAX_LISTING_CHARACTERS in all. An entry's
    `root` (a string of at most MAX_MODEL_NAME_LENGTH characters) and `max_model_len` (a
    positive integer) are kept when they have that form, and left out otherwise: the gateway only
    shows them.
    """
    text = body.decode("utf-8", "replace")
    start = len(text) - len(text.lstrip(_JSON_WHITESPACE))
    if start == len(text):
        raise ProbeError("parse model list: EOF")
    try:
        document, _ = _json_decoder.raw_decode(text, start)
    except (ValueError, RecursionError) as exc:
        raise ProbeError(f"parse model list: {exc}") from None
    if document is not None and not isinstance(document, dict):
        raise ProbeError(f"parse model list: cannot decode {_json_kind(document)} into the model list object")
    data = _field(document, "data") if document is not None else None
    if data is None:
        raise ProbeError(MISSING_DATA)
    if not isinstance(data, list):
        raise ProbeError(f"parse model list: data is {_json_kind(data)}, not an array")
    if len(data) > MAX_LISTED_MODELS:
        raise ProbeError(f"parse model list: {len(data)} models, more than the {MAX_LISTED_MODELS} a node may list")
    ids: list[str] = []
    parents: list[tuple[str, str]] = []
    cards: list[ModelCard] = []
    for index, item in enumerate(data):
        if item is not None and not isinstance(item, dict):
            raise ProbeError(f"parse model list: data[{index}] is {_json_kind(item)}, not an object")
        model_id = _field(item, "id") if item is not None else None
        if model_id is not None and not isinstance(model_id, str):
            raise ProbeError(f"parse model list: data[{index}].id is {_json_kind(model_id)}, not a string")
        if model_id is not None and len(model_id) > MAX_MODEL_NAME_LENGTH:
            raise ProbeError(
                f"parse model list: data[{index}].id is {len(model_id)} characters, longer than"
                f" the {MAX_MODEL_NAME_LENGTH} a model name may have"
            )
        ids.append(_without_lone_surrogates(model_id or ""))
        parent = _field(item, "parent") if item is not None else None
        if parent is not None:
            if not isinstance(parent, str) or len(parent) > MAX_MODEL_NAME_LENGTH:
                raise ProbeError(
                    f"parse model list: data[{index}].parent is not a model name (a string of at most"
                    f" {MAX_MODEL_NAME_LENGTH} characters)"
                )
            parents.append((ids[-1], _without_lone_surrogates(parent)))
        if item is not None and (card := _card(ids[-1], item)) is not None:
            cards.append(card)
    kept = sum(map(len, ids)) + sum(len(parent) for _, parent in parents) + sum(len(card.root) for card in cards)
    if kept > MAX_LISTING_CHARACTERS:
        raise ProbeError(
            f"parse model list: {kept} characters of ids, parents and roots, more than the"
            f" {MAX_LISTING_CHARACTERS} a node's listing may keep"
        )
    return ModelListing(tuple(ids), tuple(parents), tuple(cards))


def _card(model_id: str, item: dict[str, Any]) -> ModelCard | None:
    """vLLM's `root` and `max_model_len` of a listed entry, those of the right form; None without either."""
    root = _field(item, "root")
    if not (isinstance(root, str) and len(root) <= MAX_MODEL_NAME_LENGTH):
        root = ""
    length = _field(item, "max_model_len")
    if not (type(length) is int and 0 < length < 2**63):
        length = None
    if not root and length is None:
        return None
    return ModelCard(model_id, _without_lone_surrogates(root), length)


def _field(document: dict[str, Any], name: str) -> Any:
    """Go's rule: a key matches case-insensitively, and the last match wins."""
    value = None
    for key, item in document.items():
        if key.lower() == name:
            value = item
    return value


def _without_lone_surrogates(text: str) -> str:
    """A `\\ud800` escape becomes U+FFFD, as in Go; left in, it could never be encoded as UTF-8
    (in the event log or a log line)."""
    if text.isascii():
        return text
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a bool"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"

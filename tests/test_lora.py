"""LoRA adapters through the real gateway and simulated vLLM nodes: affinity (a request for an
adapter goes where it runs, never where it would wait for an adapter place), the gateway loading
a configured adapter through vLLM's runtime API (each load's request and answer are events), a
503 with Retry-After while it loads, and the bounds of what a node's scrape may say."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import httpx
import msgspec
import pytest
import trio

from controlplane.rules.adapters import LOAD_RETRY_SECONDS, loaded_unlisted
from controlplane.rules.policies import LORA_AVOIDED, LORA_FULL, LORA_LOADED, LORA_RUNNING, POLICIES
from controlplane.effects.probes import parse_lora_labels, parse_model_list
from controlplane.rules.reducer import INITIAL_STATE, reduce
from controlplane.rules.transitions import LoadAdapter
from events.config import Config, ModelEntry, ModelsConfig, NodeConfig
from events.decisions import read_decisions_with_gaps
from events.log import read_events
from events.state import MAX_LORA_ADAPTERS, AdapterLoadState, ModelCard
from events.types import (
    MAX_MODEL_NAME_LENGTH,
    AdapterLoaded,
    AdapterLoadFailed,
    AdapterLoadRequested,
    HealthProbed,
    ModelsListed,
    RunStarted,
)
from fixtures.node import NodeSpec, SimulatedNode
from interlock.verify import verify
from journal.segments import list_segments

from harness import MODEL, chat, decision_records, error_message, nodes_and_gateway, running_gateway
from raw_http import raw_node
from test_openai_sdk import sdk_client

CHAT = "/v1/chat/completions"
SQL = "sql-lora"
SCRAPED = {"load_scrape_interval": "50ms"}


def chats(node: SimulatedNode) -> list:
    return [request for request in node.requests if request.method == "POST" and request.path == CHAT]


@asynccontextmanager
async def held(node: SimulatedNode, *models: str) -> AsyncIterator[None]:
    """One request for each of `models` sent straight to `node`, held there (running, or waiting
    for an adapter place) until the block ends."""
    ttft = node.behaviour.ttft
    node.behaviour.ttft = 600.0
    arrived = len(chats(node)) + len(models)
    async with httpx.AsyncClient(timeout=None, trust_env=False) as http, trio.open_nursery() as nursery:
        for model in models:
            nursery.start_soon(partial(http.post, node.url + CHAT, json=chat(model)))
            while len(chats(node)) < arrived - len(models) + models.index(model) + 1:
                await trio.sleep(0.01)  # in order: the first takes the adapter place
        node.behaviour.ttft = ttft  # the requests held already keep waiting; new ones do not
        yield
        nursery.cancel_scope.cancel()


def recorded(events, *kinds: type) -> list:
    """The events of `kinds` in the event log so far (none before its first segment is written)."""
    if not list_segments(events):
        return []
    return [event for event in read_events([events]) if isinstance(event, kinds)]


def lora_node(name: str, index: int, adapters: dict[str, str], max_lora: int = 1) -> NodeSpec:
    return NodeSpec(name=name, host=f"127.0.0.{index + 2}", models=[MODEL], adapters=adapters, max_lora=max_lora)


@pytest.mark.parametrize("policy", POLICIES)
async def test_a_request_for_an_adapter_goes_where_it_runs_and_never_where_it_would_wait(tmp_path, policy):
    """a has the adapter (idle), b runs it (one request: the most loaded), c runs as many
    adapters as it may with another waiting: every policy picks b, then would pick a, never c
    (the record lists them so, each with its standing)."""
    specs = [
        lora_node("a", 0, {SQL: MODEL}),
        lora_node("b", 1, {SQL: MODEL}),
        lora_node("c", 2, {SQL: MODEL, "other": MODEL, "third": MODEL}),
    ]
    events, decisions = tmp_path / "events.jsonl", tmp_path / "decisions.jsonl"
    config = {"routing": {"policy": policy, **SCRAPED}, "decision_log": str(decisions), "event_log": str(events)}
    async with nodes_and_gateway(tmp_path, specs, **config) as ([a, b, c], gateway):
        await gateway.discovered()
        async with held(b, SQL), held(c, "other", "third"):

            def scraped() -> bool:
                lora_b, lora_c = gateway.node(b.host).load.lora, gateway.node(c.host).load.lora
                return bool(lora_b and lora_b.running == (SQL,) and lora_c and lora_c.waiting == ("third",))

            await gateway.wait_for(scraped)
            response = await gateway.http.post(gateway.url + CHAT, json=chat(SQL))
            assert response.status_code == 200 and response.headers["x-interlock-node"] == "b"
            await gateway.wait_for(lambda: len(decision_records(decisions)) == 1)
    [record] = decision_records(decisions)
    assert [(c.node, c.lora, c.note) for c in record.candidates] == [
        (b.host, LORA_RUNNING, ""), (a.host, LORA_LOADED, LORA_AVOIDED), (c.host, LORA_FULL, LORA_AVOIDED)
    ]  # fmt: skip
    assert not [request for request in chats(c) if request.json()["model"] == SQL]
    report = verify([events], read_decisions_with_gaps([decisions]))  # the standings made again from the log
    assert (report.verified, report.divergent) == (1, 0), report.divergences


async def test_the_gateway_loads_a_configured_adapter_and_records_why(tmp_path):
    """n1 serves the adapter's parent and lacks it: the prober loads it through vLLM's runtime
    API, requested and loaded are events, the node lists it, and the SDK's request is served."""
    events, decisions = tmp_path / "events.jsonl", tmp_path / "decisions.jsonl"
    adapters = {SQL: {"parent": MODEL, "lora_path": "/adapters/sql"}}
    specs = [lora_node("n1", 0, {}, max_lora=2)]
    logs = {"event_log": str(events), "decision_log": str(decisions)}
    async with nodes_and_gateway(tmp_path, specs, adapters=adapters, **logs) as ([n1], gateway):
        await gateway.wait_for(lambda: SQL in gateway.node(n1.host).models.listed)
        async with sdk_client(gateway) as client:
            answer = await client.chat.completions.with_raw_response.create(
                model=SQL, messages=[{"role": "user", "content": "hi"}]
            )
        await gateway.wait_for(lambda: len(recorded(events, AdapterLoadRequested, AdapterLoaded)) == 2)
        await gateway.wait_for(lambda: len(decision_records(decisions)) == 1)
        messages = gateway.log.messages(n1.host)
    request_id = answer.headers["x-request-id"]
    explained = subprocess.run(
        [sys.executable, "-m", "interlock.cli", "explain", str(events), "--request-id", request_id,
         "--decisions", str(decisions)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert explained.returncode == 0, explained.stderr
    assert f"the gateway's loads of the adapter {SQL}:" in explained.stdout
    requested_line = "adapter load requested (adapter=sql-lora, parent=test-model, lora_path=/adapters/sql, reason="
    assert requested_line + "node serves the parent and lacks the adapter)" in explained.stdout
    assert f"{n1.host}: seq" in explained.stdout and "adapter loaded (adapter=sql-lora)" in explained.stdout
    answer = answer.parse()
    assert answer.model == SQL
    [load] = [request for request in n1.requests if request.path == "/v1/load_lora_adapter"]
    assert load.method == "POST" and load.json() == {"lora_name": SQL, "lora_path": "/adapters/sql"}
    requested, loaded = recorded(events, AdapterLoadRequested, AdapterLoaded)
    assert (requested.node, requested.adapter, requested.parent, requested.lora_path) == (
        n1.host, SQL, MODEL, "/adapters/sql"
    )
    assert (loaded.node, loaded.adapter) == (n1.host, SQL) and loaded.at >= requested.at
    assert n1.adapters == {SQL: MODEL}
    assert messages.index("adapter load requested") < messages.index("adapter loaded")
    assert gateway.node(n1.host).adapter_load(SQL).state == AdapterLoadState.LOADED


async def test_a_request_for_an_adapter_being_loaded_gets_503_with_retry_after(tmp_path):
    adapters = {SQL: {"parent": MODEL, "lora_path": "/adapters/sql"}}
    [spec] = [lora_node("n1", 0, {}, max_lora=2)]
    spec.behaviour.lora_load_seconds = 600.0
    async with nodes_and_gateway(tmp_path, [spec], adapters=adapters) as ([n1], gateway):
        await gateway.wait_for(lambda: gateway.node(n1.host).adapter_load(SQL) is not None, timeout=10)
        response = await gateway.http.post(gateway.url + CHAT, json=chat(SQL))
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.headers["retry-after-ms"] == "1000"
    assert response.json()["error"]["code"] == "adapter_loading"
    assert error_message(response) == f"LoRA adapter `{SQL}` is being loaded onto a node"
    assert not chats(n1)


async def test_a_failed_load_is_an_event_with_the_nodes_answer(tmp_path):
    events = tmp_path / "events.jsonl"
    adapters = {SQL: {"parent": MODEL, "lora_path": "/adapters/sql"}}
    [spec] = [lora_node("n1", 0, {}, max_lora=2)]
    spec.behaviour.lora_updates = False  # vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING
    async with nodes_and_gateway(tmp_path, [spec], adapters=adapters, event_log=str(events)) as ([n1], gateway):
        await gateway.wait_for(lambda: gateway.node(n1.host).adapter_load(SQL) is not None, timeout=10)
        await gateway.wait_for(lambda: gateway.node(n1.host).adapter_load(SQL).state == AdapterLoadState.FAILED)
        await gateway.wait_for(lambda: recorded(events, AdapterLoadFailed))
        response = await gateway.http.post(gateway.url + CHAT, json=chat(SQL))
    [failed] = recorded(events, AdapterLoadFailed)
    assert failed.status == 404 and "load_lora_adapter returned status 404" in failed.error
    assert response.status_code == 503 and "retry-after" not in response.headers


class Reduced:
    """The reducer run on the events given, from a RunStarted of `config`: its state and every
    effect so far."""

    def __init__(self, config: Config) -> None:
        self.state, self.effects = INITIAL_STATE, []
        self(RunStarted(at=100.0, version="t", config_path="c", config=config))

    def __call__(self, event) -> None:
        self.state, step = reduce(self.state, msgspec.structs.replace(event, seq=self.state.seq + 1))
        self.effects.extend(step.effects)


def test_a_load_falls_due_at_a_listing_with_the_parent_and_again_only_after_the_back_off():
    """The rule, as the reducer applies it: a listing of a healthy node with the adapter's
    parent and without the adapter has the load as its effect; not while a load was asked or
    answered less than LOAD_RETRY_SECONDS ago (time from the events alone), nor once listed."""
    nodes = (NodeConfig(ip="10.0.0.1"), NodeConfig(ip="10.0.0.2"))
    entry = ModelEntry(name=SQL, parent=MODEL, lora_path="/adapters/sql")
    config = Config(nodes=nodes, models=ModelsConfig(available=(ModelEntry(name=MODEL), entry)))
    apply = Reduced(config)
    effects = apply.effects
    effects.clear()
    apply(ModelsListed(at=101.0, node="10.0.0.1", models=(MODEL,)))
    apply(ModelsListed(at=101.0, node="10.0.0.2", models=("another",)))
    assert effects == [LoadAdapter("10.0.0.1", SQL)]
    apply(AdapterLoadRequested(at=102.0, node="10.0.0.1", adapter=SQL, parent=MODEL, lora_path="/adapters/sql"))
    apply(AdapterLoadFailed(at=103.0, node="10.0.0.1", adapter=SQL, error="boom", status=500))
    apply(ModelsListed(at=103.0 + LOAD_RETRY_SECONDS - 1, node="10.0.0.1", models=(MODEL,)))
    assert effects == [LoadAdapter("10.0.0.1", SQL)]  # within the back-off: none
    apply(HealthProbed(at=103.0 + LOAD_RETRY_SECONDS, node="10.0.0.1", ok=False))
    apply(HealthProbed(at=103.0 + LOAD_RETRY_SECONDS, node="10.0.0.1", ok=False))
    apply(HealthProbed(at=103.0 + LOAD_RETRY_SECONDS, node="10.0.0.1", ok=False))
    apply(ModelsListed(at=103.0 + LOAD_RETRY_SECONDS, node="10.0.0.1", models=(MODEL,)))
    assert effects == [LoadAdapter("10.0.0.1", SQL)]  # a dead node: none
    apply(HealthProbed(at=104.0 + LOAD_RETRY_SECONDS, node="10.0.0.1", ok=True))
    apply(ModelsListed(at=104.0 + LOAD_RETRY_SECONDS, node="10.0.0.1", models=(MODEL,)))
    assert effects == [LoadAdapter("10.0.0.1", SQL)] * 2
    assert apply.state.nodes["10.0.0.1"].adapter_load(SQL).state == AdapterLoadState.FAILED
    apply(ModelsListed(at=170.0, node="10.0.0.1", models=(MODEL, SQL), parents=((SQL, MODEL),)))
    assert len(effects) == 2  # listed: loaded
    assert apply.state.nodes["10.0.0.1"].models.adapters == {SQL: MODEL}


async def test_an_adapter_a_node_says_it_loaded_but_never_lists_gets_a_503_naming_it_and_the_node(tmp_path):
    # A node whose runtime LoRA API answers every load with success and whose listing never shows it.
    success = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 7\r\n\r\nSuccess"
    adapters = {SQL: {"parent": MODEL, "lora_path": "/adapters/sql"}}
    async with raw_node(success, name="n1") as n1, running_gateway(tmp_path, [n1], adapters=adapters) as gateway:
        await gateway.wait_for(lambda: loaded_unlisted(gateway.node(n1.host), SQL), timeout=10)
        response = await gateway.http.post(gateway.url + CHAT, json=chat(SQL))
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "adapter_not_listed"
    assert error_message(response) == (
        f"LoRA adapter `{SQL}` was loaded onto node n1 ({n1.host}), which does not list it: the load is asked again"
    )
    assert [request for _, request in n1.completions if not request.startswith(b"POST /v1/load_lora_adapter ")] == []


def test_a_node_that_answers_loads_done_and_never_lists_the_adapter_is_asked_again_after_a_doubling_back_off():
    config = Config(
        nodes=(NodeConfig(ip="10.0.0.1"),),
        models=ModelsConfig(available=(ModelEntry(name=MODEL), ModelEntry(name=SQL, parent=MODEL, lora_path="/a"))),
    )
    apply = Reduced(config)
    at, asked = 100.0, []
    for _ in range(6):
        apply.effects.clear()
        apply(ModelsListed(at=at, node="10.0.0.1", models=(MODEL,)))  # each listing lacks the adapter
        if apply.effects:
            asked.append(at - 100.0)
            apply(AdapterLoadRequested(at=at, node="10.0.0.1", adapter=SQL, parent=MODEL, lora_path="/a"))
            apply(AdapterLoaded(at=at, node="10.0.0.1", adapter=SQL))
        at += LOAD_RETRY_SECONDS
    # Asked at once, then after 1, 2 and 4 times the back-off (the fourth falls beyond the six listings).
    assert asked == [0.0, LOAD_RETRY_SECONDS, 3 * LOAD_RETRY_SECONDS]
    assert apply.state.nodes["10.0.0.1"].adapter_load(SQL).unlisted == 2


def test_a_scrape_keeps_a_bounded_number_of_adapter_names_and_counts_the_rest():
    names = ",".join(f"a{index}" for index in range(MAX_LORA_ADAPTERS + 3))
    long_name = "x" * (MAX_MODEL_NAME_LENGTH + 1)
    labels = f'{{max_lora="2",running_lora_adapters="{names}",waiting_lora_adapters="{long_name},b"}}'
    lora = parse_lora_labels(labels.encode())
    assert (lora.max_lora, len(lora.running), lora.waiting, lora.truncated) == (2, MAX_LORA_ADAPTERS, ("b",), 4)


def test_a_listing_keeps_each_adapters_parent_and_vllm_s_root_and_max_model_len():
    body = (
        b'{"data":[{"id":"m","parent":null,"root":"/models/m","max_model_len":4096},{"id":"sql","parent":"m"},'
        b'{"id":"x","root":7,"max_model_len":true},{"id":"y","max_model_len":-1,"root":"' + b"r" * 513 + b'"}]}'
    )
    # A root or max_model_len not of its form is left out: the gateway only shows them.
    assert parse_model_list(body) == (("m", "sql", "x", "y"), (("sql", "m"),), (ModelCard("m", "/models/m", 4096),))


async def test_the_simulated_node_loads_lists_and_unloads_adapters_as_vllm_does():
    from controlplane.effects.probes import parse_vllm_load
    from fixtures.node import serve_nodes

    async with serve_nodes([lora_node("n1", 0, {}, max_lora=2)]) as [node], httpx.AsyncClient(trust_env=False) as http:
        loaded = await http.post(node.url + "/v1/load_lora_adapter", json={"lora_name": SQL, "lora_path": "/a"})
        again = await http.post(node.url + "/v1/load_lora_adapter", json={"lora_name": SQL, "lora_path": "/a"})
        listing = parse_model_list((await http.get(node.url + "/v1/models")).content)
        answer = await http.post(node.url + CHAT, json=chat(SQL))
        metrics = parse_vllm_load((await http.get(node.url + "/metrics")).content)
        unloaded = await http.post(node.url + "/v1/unload_lora_adapter", json={"lora_name": SQL})
        gone = await http.post(node.url + "/v1/unload_lora_adapter", json={"lora_name": SQL})
        node.behaviour.lora_updates = False
        refused = await http.post(node.url + "/v1/load_lora_adapter", json={"lora_name": SQL, "lora_path": "/a"})
    assert loaded.status_code == 200 and loaded.text == f"Success: LoRA adapter '{SQL}' added successfully."
    assert again.status_code == 400 and "has already been loaded" in again.json()["message"]
    assert listing[:2] == ((MODEL, SQL), ((SQL, MODEL),))
    assert answer.status_code == 200 and answer.json()["model"] == SQL
    lora = metrics.lora
    assert lora is not None and (lora.max_lora, lora.running, lora.waiting) == (2, (), ())
    assert unloaded.status_code == 200 and gone.status_code == 404
    assert refused.status_code == 404


@pytest.mark.parametrize(
    "entry, message",
    [
        ('name = "sql"\nlora_path = "/a"', 'adapter "sql" has a lora_path but no parent'),
        ('name = "sql"\nparent = "sql"', 'adapter "sql" names itself as its parent'),
        ('name = "sql"\nparent = "m"\ntarget = "m"', 'alias "sql" cannot be an adapter too'),
        ('name = "sql"\nparent = "chat"\n[[models.available]]\nname = "chat"\ntarget = "m"',
         'adapter "sql" names the alias "chat" as its parent'),  # fmt: skip
    ],
)
def test_an_adapter_that_cannot_be_loaded_is_refused_naming_its_key(tmp_path, entry, message):
    from controlplane.infrastructure.config import ConfigError, load_config

    path = tmp_path / "gateway.toml"
    path.write_text(f'[[nodes]]\nip = "10.0.0.1"\n[[models.available]]\nname = "m"\n[[models.available]]\n{entry}\n')
    with pytest.raises(ConfigError) as caught:
        load_config(str(path))
    assert caught.value.key == "models.available[1].parent" and message in str(caught.value)

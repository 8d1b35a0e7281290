"""A node is trusted no more than a client: what it lists and what its exporters report is
bounded, a listing of many models never stalls the control plane, and the metrics label only
the configured models and a bounded count of discovered ones. Real simulated nodes, raw servers
for answers no node would give, the real gateway."""

from __future__ import annotations

import re

import msgspec
import pytest

from controlplane.effects.metrics import MAX_DISCOVERED_MODEL_LABELS, OTHER_MODELS, metric_models
from controlplane.effects.probes import (
    MAX_GPUS_PER_SCRAPE,
    MAX_LISTED_MODELS,
    MAX_LISTING_CHARACTERS,
    MAX_LOAD_LABEL_SETS,
    ProbeError,
    parse_model_list,
    parse_vllm_load,
)
from events.log import read_events
from events.state import Discovery
from events.types import MAX_MODEL_NAME_LENGTH, GpuScraped, ModelsListed, ModelsUnchanged
from harness import MODEL, chat, node_specs, nodes_and_gateway
from test_load import prometheus_answer, scrape_raw

CHAT = "/v1/chat/completions"


def model_list(ids: list[str]) -> bytes:
    return msgspec.json.encode({"object": "list", "data": [{"id": model, "object": "model"} for model in ids]})


def model_node_series(page: str) -> set[str]:
    """The models that have `interlock_model_nodes` series on a /metrics page."""
    return set(re.findall(r'^interlock_model_nodes\{model="([^"]*)"', page, flags=re.MULTILINE))


# --- what a listing may hold -------------------------------------------------------------------


def test_a_listing_of_more_ids_than_the_cap_is_an_error_naming_the_count():
    listing = parse_model_list(model_list([f"m{index}" for index in range(MAX_LISTED_MODELS)]))
    assert len(listing.ids) == MAX_LISTED_MODELS
    with pytest.raises(ProbeError) as caught:
        parse_model_list(model_list([f"m{index}" for index in range(MAX_LISTED_MODELS + 1)]))
    assert str(caught.value) == (
        f"parse model list: {MAX_LISTED_MODELS + 1} models, more than the {MAX_LISTED_MODELS} a node may list"
    )


def test_an_id_longer_than_a_model_name_may_be_is_an_error_naming_its_length():
    assert parse_model_list(model_list(["a", "b" * MAX_MODEL_NAME_LENGTH])).ids == ("a", "b" * MAX_MODEL_NAME_LENGTH)
    with pytest.raises(ProbeError) as caught:
        parse_model_list(model_list(["a", "b" * (MAX_MODEL_NAME_LENGTH + 1)]))
    assert str(caught.value) == (
        f"parse model list: data[1].id is {MAX_MODEL_NAME_LENGTH + 1} characters,"
        f" longer than the {MAX_MODEL_NAME_LENGTH} a model name may have"
    )


def test_a_listing_of_more_characters_than_its_bound_is_an_error_naming_them():
    # Within the count and each id's length: 4,095 ids of 512 characters (2 MiB).
    ids = [f"{index:04d}" + "x" * (MAX_MODEL_NAME_LENGTH - 4) for index in range(MAX_LISTED_MODELS - 1)]
    with pytest.raises(ProbeError) as raised:
        parse_model_list(model_list(ids))
    assert str(raised.value) == (
        f"parse model list: {len(ids) * MAX_MODEL_NAME_LENGTH} characters of ids, parents and roots, more than the"
        f" {MAX_LISTING_CHARACTERS} a node's listing may keep"
    )


async def test_health_shows_a_nodes_first_model_names_and_their_count_and_every_one_when_asked(tmp_path):
    ids = [MODEL] + [f"org/model-{index:03d}" for index in range(99)]
    async with nodes_and_gateway(tmp_path, node_specs(1, serving=ids)) as (_, gateway):
        await gateway.discovered()
        [summary] = (await gateway.http.get(gateway.url + "/health")).json()["details"]
        [whole] = (await gateway.http.get(gateway.url + "/health?models=all")).json()["details"]
    assert (summary["models"]["names"], summary["models"]["names_total"]) == (ids[:20], 100)
    assert whole["models"]["names"] == ids and "names_total" not in whole["models"]


def test_a_listing_nested_400000_deep_is_a_listing_error():
    nested = b'{"data": [{"id": "m", "meta": ' + b"[" * 400_000 + b"]" * 400_000 + b"}]}"
    with pytest.raises(ProbeError, match="^parse model list: "):
        parse_model_list(nested)


async def test_a_node_listing_a_1_mb_id_gets_a_listing_error_and_health_stays_small(tmp_path):
    huge = "x" * 1_000_000
    async with nodes_and_gateway(tmp_path, node_specs(1, serving=[MODEL, huge]), health_interval="1s") as (
        [node],
        gateway,
    ):
        await gateway.wait_for(lambda: gateway.node(node.host).models.fails >= 1)
        models = gateway.node(node.host).models
        assert models.last_error == (
            f"parse model list: data[1].id is 1000000 characters, longer than the {MAX_MODEL_NAME_LENGTH}"
            " a model name may have"
        )
        assert models.state == Discovery.UNTRIED  # an error, as any other bad listing
        health = await gateway.http.get(gateway.url + "/health")
        assert health.status_code == 200
        assert len(health.content) < 10_000
        assert len(await gateway.metrics()) < 100_000


async def test_a_listing_probed_again_unchanged_is_logged_by_its_digest(tmp_path):
    ids = [MODEL] + [f"org/{index:04d}-" + "x" * 500 for index in range(400)]  # 0.2 MB, with their roots 0.4
    events = tmp_path / "events.jsonl"
    async with nodes_and_gateway(
        tmp_path, node_specs(1, serving=ids), health_interval="100ms", event_log=str(events)
    ) as ([node], gateway):
        await gateway.wait_for(lambda: sum(r.path == "/v1/models" for r in node.requests) >= 6, timeout=30)
        assert gateway.node(node.host).models.names == tuple(ids)
    listings = [event for event in read_events([events]) if isinstance(event, ModelsListed | ModelsUnchanged)]
    assert len(listings) >= 5
    [whole, *again] = listings
    assert isinstance(whole, ModelsListed) and whole.models == tuple(ids)
    assert {type(event) for event in again} == {ModelsUnchanged}
    assert {event.digest for event in again} == {whole.digest()}
    # The whole list once: the rest of the log is small events.
    assert sum(path.stat().st_size for path in tmp_path.glob("events*")) < len(msgspec.json.encode(whole)) + 100_000


async def test_a_node_listing_20000_ids_gets_a_listing_error_naming_the_count(tmp_path):
    ids = [f"org/model-{index:05d}" for index in range(20_000)]
    async with nodes_and_gateway(tmp_path, node_specs(1, serving=ids), health_interval="1s") as ([node], gateway):
        await gateway.wait_for(lambda: gateway.node(node.host).models.fails >= 1)
        assert gateway.node(node.host).models.last_error == (
            f"parse model list: 20000 models, more than the {MAX_LISTED_MODELS} a node may list"
        )
        assert (await gateway.http.get(gateway.url + "/health")).status_code == 200


# --- what the exporters may report -------------------------------------------------------------


async def test_a_gpu_exporter_reporting_more_gpus_than_the_cap_is_a_scrape_error(tmp_path):
    specs = node_specs(2)
    specs[0].behaviour.gpus = MAX_GPUS_PER_SCRAPE + 1
    specs[1].behaviour.gpus = MAX_GPUS_PER_SCRAPE
    async with nodes_and_gateway(tmp_path, specs, health_interval="1s") as (nodes, gateway):
        scrapes: list[GpuScraped] = []
        gateway.control_plane.applier.add_listener(
            lambda event, state, step: scrapes.append(event) if isinstance(event, GpuScraped) else None
        )
        await gateway.wait_for(lambda: {scrape.node for scrape in scrapes} == {node.host for node in nodes})
        over, at_cap = nodes
        refused = next(scrape for scrape in scrapes if scrape.node == over.host)
        assert (refused.gpus, refused.error) == ((), f"gpu scrape: more than {MAX_GPUS_PER_SCRAPE} GPUs")
        assert len(gateway.node(at_cap.host).gpus) == MAX_GPUS_PER_SCRAPE
        assert gateway.node(over.host).gpus == ()
        assert gateway.node(over.host).status == "healthy"  # telemetry only, as any failed GPU scrape


def test_a_load_scrape_with_more_label_sets_than_the_cap_is_an_error_naming_the_gauge():
    lines = [f'vllm:num_requests_running{{engine="{index}"}} 1' for index in range(MAX_LOAD_LABEL_SETS)]
    assert parse_vllm_load("\n".join(lines).encode()).running == MAX_LOAD_LABEL_SETS
    lines.append('vllm:num_requests_running{engine="over"} 1')
    with pytest.raises(ProbeError) as caught:
        parse_vllm_load("\n".join(lines).encode())
    assert str(caught.value) == f"vllm:num_requests_running: more than {MAX_LOAD_LABEL_SETS} label sets"


async def test_a_load_scrape_over_the_label_set_cap_is_an_error_event():
    body = "".join(f'vllm:num_requests_waiting{{model_name="m{index}"}} 0\n' for index in range(10_000))
    event, _ = await scrape_raw(prometheus_answer(body.encode()))
    assert (event.running, event.waiting) == (None, None)
    assert event.error == f"vllm:num_requests_waiting: more than {MAX_LOAD_LABEL_SETS} label sets"


# --- many models listed: the control plane keeps up, the metrics stay bounded ---------------------


async def test_nodes_listing_20000_models_keep_the_gateway_answering_and_the_metrics_small(tmp_path):
    """Twenty nodes, a thousand models each (under the cap): 20,000 models, whose counts used to
    be recounted in O(models²) after every transition."""
    specs = [
        spec
        for index, spec in enumerate(node_specs(20), start=1)
        for spec.models in [[MODEL, *(f"n{index}/adapter-{number:04d}" for number in range(1000))]]
    ]
    async with nodes_and_gateway(tmp_path, specs, health_interval="1s") as (nodes, gateway):
        await gateway.wait_for(
            lambda: all(node.models.state == Discovery.KNOWN for node in gateway.nodes()), timeout=60
        )
        assert (await gateway.http.get(gateway.url + "/health")).status_code == 200
        labelled = metric_models(gateway.control_plane.view.snapshot)
        assert len(labelled) == 1 + MAX_DISCOVERED_MODEL_LABELS
        unlabelled = next(model for model in specs[0].models if model not in labelled)
        discovered = next(model for model in sorted(labelled) if model != MODEL)
        for model in (MODEL, discovered, unlabelled, unlabelled):
            assert (await gateway.http.post(gateway.url + CHAT, json=chat(model))).status_code == 200
        page = await gateway.metrics()
        assert model_node_series(page) == labelled
        assert 'interlock_model_nodes{model="%s",status="healthy"} 20.0' % MODEL in page
        assert 'interlock_model_nodes{model="%s",status="healthy"} 1.0' % discovered in page
        assert await gateway.metric(f'gateway_requests_total{{model="{discovered}",status="200"}}') == 1
        assert await gateway.metric(f'gateway_requests_total{{model="{OTHER_MODELS}",status="200"}}') == 2
        assert unlabelled not in page
        assert len(page) < 200_000


async def test_a_models_series_go_when_no_node_lists_it_any_more(tmp_path):
    specs = node_specs(1, serving=[MODEL, "kept", "dropped"])
    async with nodes_and_gateway(tmp_path, specs, health_interval="1s", health_fail_threshold=2) as (
        [node],
        gateway,
    ):
        await gateway.discovered()
        assert model_node_series(await gateway.metrics()) == {MODEL, "kept", "dropped"}
        assert (await gateway.http.post(gateway.url + CHAT, json=chat("kept"))).status_code == 200
        assert await gateway.metric('gateway_requests_total{model="kept",status="200"}') == 1
        node.models = [MODEL, "kept"]
        await gateway.wait_for(lambda: gateway.node(node.host).models.names == (MODEL, "kept"))
        assert model_node_series(await gateway.metrics()) == {MODEL, "kept"}
        assert (await gateway.http.post(gateway.url + CHAT, json=chat("kept"))).status_code == 200
        node.behaviour.models = "error"  # until the list expires: it lists nothing any more
        await gateway.wait_for(lambda: gateway.node(node.host).models.state == Discovery.EXPIRED)
        page = await gateway.metrics()
        assert model_node_series(page) == {MODEL}  # configured: it keeps its series
        assert 'interlock_model_nodes{model="%s",status="healthy"} 0.0' % MODEL in page
        # Requests name it no more either (the data plane's labels follow the same lists).
        status = (await gateway.http.post(gateway.url + CHAT, json=chat("kept"))).status_code
        assert await gateway.metric(f'gateway_requests_total{{model="{OTHER_MODELS}",status="{status}"}}') == 1
        assert await gateway.metric('gateway_requests_total{model="kept",status="200"}') == 2

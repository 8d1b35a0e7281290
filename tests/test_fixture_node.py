"""The simulated vLLM node (fixtures/node.py), exercised over real sockets with httpx and the
official openai SDK: endpoints, every fault, recording, the control endpoint and the CLI."""

from __future__ import annotations

import functools
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import trio

from controlplane.effects.probes import parse_vllm_load
from fixtures.node import (
    OVERSIZED_MODELS_BYTES,
    Behaviour,
    NodeSpec,
    RecordedRequest,
    SimulatedNode,
    gpu_uuid,
    serve_node,
    serve_nodes,
    specs_from_config,
)

PROJECT_ROOT = Path(__file__).resolve().parent.parent
MODEL = "m1"
SHORT_READ = httpx.Timeout(60.0, read=0.2)
GPU_GAUGES = ("gpu_memory_used_bytes", "gpu_memory_total_bytes", "gpu_utilization_percent", "gpu_temperature_celsius")


def spec(name: str = "n1", **behaviour) -> NodeSpec:
    return NodeSpec(name=name, models=[MODEL, "m2"], behaviour=Behaviour(**behaviour))


def chat_body(stream: bool = False, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream, **extra}


@asynccontextmanager
async def node_with_client(
    name: str = "n1", timeout: httpx.Timeout | float = 60.0, **behaviour
) -> AsyncIterator[tuple[SimulatedNode, httpx.AsyncClient]]:
    """A node serving MODEL and "m2", and an httpx client for its vLLM port."""
    async with serve_node(spec(name, **behaviour)) as node:
        async with httpx.AsyncClient(base_url=node.url, timeout=timeout) as client:
            yield node, client


async def wait_ended(record: RecordedRequest) -> None:
    with trio.fail_after(60):
        await record.ended.wait()


# ---- endpoints


async def test_health_models_and_vllm_metrics():
    async with node_with_client() as (node, client):
        health = await client.get("/health")
        assert (health.status_code, health.content) == (200, b"")
        assert health.headers["x-served-by"] == "n1"

        models = await client.get("/v1/models")
        assert models.status_code == 200
        listing = models.json()
        assert listing["object"] == "list"
        assert [card["id"] for card in listing["data"]] == [MODEL, "m2"]
        card = listing["data"][0]
        assert card["object"] == "model" and card["owned_by"] == "vllm" and card["root"] == MODEL
        assert isinstance(card["created"], int) and card["max_model_len"] == 32768

        metrics = (await client.get("/metrics")).text
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc"):
            assert f"# HELP {name} " in metrics and f"# TYPE {name} gauge" in metrics
            assert f'{name}{{model_name="{MODEL}"}} 0.0' in metrics

        node.models = ["m3"]  # the served list is live
        assert [card["id"] for card in (await client.get("/v1/models")).json()["data"]] == ["m3"]

        assert (await client.get("/nope")).status_code == 404
        assert (await client.post("/health")).status_code == 405


async def test_gpu_exporter_port_reports_each_gpu():
    async with serve_node(spec(gpus=2)) as node, httpx.AsyncClient(base_url=node.metrics_url) as client:
        assert (await client.get("/health")).text == "ok"
        text = (await client.get("/metrics")).text
        uuids = {gpu_uuid("n1", 0), gpu_uuid("n1", 1)}
        assert len(uuids) == 2 and all(u.startswith("GPU-") for u in uuids)
        for name in GPU_GAUGES:
            assert f"# HELP {name} " in text and f"# TYPE {name} gauge" in text
            samples = [line.split() for line in text.splitlines() if line.startswith(name + "{")]
            assert {token.split('"')[1] for token, _ in samples} == uuids
            assert all(float(value) >= 0 for _, value in samples)

        node.behaviour.gpus = 0
        assert "gpu=" not in (await client.get("/metrics")).text


async def test_no_metrics_listener_when_metrics_port_is_none():
    async with serve_node(NodeSpec(name="n1", metrics_port=None)) as node:
        assert node.metrics_port is None and node.metrics_url is None
        async with httpx.AsyncClient() as client:
            assert (await client.get(node.url + "/health")).status_code == 200


async def test_nodes_on_distinct_loopback_addresses_share_port_numbers():
    async with serve_node(NodeSpec(name="a", host="127.0.0.2")) as a:
        b_spec = NodeSpec(name="b", host="127.0.0.3", vllm_port=a.vllm_port, metrics_port=a.metrics_port)
        async with serve_node(b_spec) as b, httpx.AsyncClient() as client:
            assert (b.vllm_port, b.metrics_port) == (a.vllm_port, a.metrics_port)
            for node in (a, b):
                response = await client.get(f"http://{node.host}:{node.vllm_port}/health")
                assert response.headers["x-served-by"] == node.name


async def test_many_nodes_in_one_run_each_on_its_own_ports():
    specs = [NodeSpec(name=f"node-{index}") for index in range(20)]
    async with serve_nodes(specs) as nodes, httpx.AsyncClient() as client:
        ports = {port for node in nodes for port in (node.vllm_port, node.metrics_port)}
        assert len(ports) == 40
        for node in nodes:
            assert (await client.get(node.url + "/health")).headers["x-served-by"] == node.name


async def test_exit_closes_listeners_and_open_connections():
    async with httpx.AsyncClient(timeout=60) as client:
        async with trio.open_nursery() as nursery:
            async with serve_node(spec(health="hang")) as node:
                url = node.url

                async def hung_probe():
                    with pytest.raises(httpx.RemoteProtocolError):
                        await client.get(url + "/health")

                nursery.start_soon(hung_probe)
                with trio.fail_after(60):
                    while not node.requests:
                        await trio.sleep(0.01)
        with pytest.raises(httpx.ConnectError):
            await client.get(url + "/health")


# ---- completions


async def test_chat_and_text_completions():
    async with node_with_client(name="gpu-node-1", tokens=6) as (node, client):
        chat = await client.post("/v1/chat/completions", json=chat_body())
        assert chat.status_code == 200 and chat.headers["x-served-by"] == "gpu-node-1"
        answer = chat.json()
        assert answer["object"] == "chat.completion" and answer["model"] == MODEL
        assert answer["id"].startswith("chatcmpl-") and isinstance(answer["created"], int)
        assert answer["choices"][0]["message"]["content"].startswith("Hello from gpu-node-1")
        assert answer["choices"][0]["finish_reason"] == "stop"
        assert answer["usage"]["completion_tokens"] == 6

        text = (await client.post("/v1/completions", json={"model": "m2", "prompt": "hi"})).json()
        assert text["object"] == "text_completion" and text["model"] == "m2"
        assert text["choices"][0]["text"].startswith("Hello from gpu-node-1")

        limited = (await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})).json()
        assert limited["choices"][0]["text"] == "Hello from"
        assert limited["choices"][0]["finish_reason"] == "length"

        no_model = await client.post("/v1/completions", json={"prompt": "x"})
        assert no_model.json()["model"] == MODEL  # like vLLM: the first served model


async def test_unknown_model_and_invalid_json():
    async with node_with_client() as (node, client):
        missing = await client.post("/v1/chat/completions", json={**chat_body(), "model": "x"})
        assert missing.status_code == 404
        assert missing.json() == {
            "object": "error",
            "message": "The model `x` does not exist.",
            "type": "NotFoundError",
            "param": None,
            "code": 404,
        }
        assert missing.headers["x-served-by"] == "n1"

        invalid = await client.post("/v1/completions", content=b"{not json")
        assert invalid.status_code == 400
        assert invalid.json()["type"] == "BadRequestError" and invalid.json()["code"] == 400


async def test_streaming_arrives_token_by_token():
    tokens, tpot = 6, 0.05
    async with node_with_client(tokens=tokens, tpot=tpot) as (node, client):
        async with client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as response:
            assert response.headers["content-type"] == "text/event-stream"
            assert response.headers["transfer-encoding"] == "chunked"
            assert response.headers["x-served-by"] == "n1"
            arrivals = []
            async for line in response.aiter_lines():
                if line:
                    arrivals.append((time.monotonic(), line))
    events = [line.removeprefix("data: ") for _, line in arrivals]
    assert all(line.startswith("data: ") for _, line in arrivals)
    assert len(events) == tokens + 1 and events[-1] == "[DONE]"
    chunks = [msgspec.json.decode(event) for event in events[:-1]]
    assert all(chunk["object"] == "chat.completion.chunk" and chunk["model"] == MODEL for chunk in chunks)
    assert "".join(chunk["choices"][0]["delta"]["content"] for chunk in chunks).startswith("Hello from n1")
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    times = [at for at, _ in arrivals]
    assert times == sorted(times)
    assert times[tokens - 1] - times[0] >= 0.5 * (tokens - 1) * tpot  # spread out, not one burst


async def test_time_to_first_token_follows_the_headers():
    ttft = 0.2
    async with node_with_client(ttft=ttft, tokens=2) as (node, client):
        body = {"model": MODEL, "prompt": "x", "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            headers_at = time.monotonic()
            async for line in response.aiter_lines():
                if line:
                    first_token_at = time.monotonic()
                    break
        assert first_token_at - headers_at >= ttft / 2

        started = time.monotonic()
        assert (await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})).status_code == 200
        assert time.monotonic() - started >= ttft * 0.9


async def test_usage_chunk_when_asked():
    async with node_with_client(tokens=3) as (node, client):
        body = chat_body(stream=True, stream_options={"include_usage": True})
        response = await client.post("/v1/chat/completions", json=body)
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
    assert events[-1] == "[DONE]"
    usage_chunk = msgspec.json.decode(events[-2])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 3


# ---- completion faults


async def test_close_mid_stream_ends_without_done():
    async with node_with_client(completion="close_mid_stream", tokens=6) as (node, client):
        lines = []
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    lines.append(line)
        events = [line for line in lines if line]
        assert len(events) == 3 and "data: [DONE]" not in events

        with pytest.raises(httpx.RemoteProtocolError):
            await client.post("/v1/chat/completions", json=chat_body())


async def test_no_first_chunk_sends_headers_only_and_sees_the_client_leave():
    async with node_with_client(completion="no_first_chunk", timeout=SHORT_READ) as (node, client):
        async with client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as response:
            assert response.status_code == 200
            assert response.headers["content-type"] == "text/event-stream"
            with pytest.raises(httpx.ReadTimeout):
                await response.aread()
        record = node.requests[-1]
        await wait_ended(record)
        assert record.disconnected


async def test_hang_never_sends_headers():
    async with node_with_client(completion="hang", timeout=SHORT_READ) as (node, client):
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/chat/completions", json=chat_body())
        record = node.requests[-1]
        await wait_ended(record)
        assert record.disconnected


async def test_http_error_answers_with_the_configured_status():
    async with node_with_client(completion="http_error", error_status=503) as (node, client):
        response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert response.status_code == 503
        assert response.headers["x-served-by"] == "n1"
        error = response.json()
        assert error["code"] == 503 and error["object"] == "error" and error["message"]


async def test_client_leaving_mid_stream_is_seen_within_a_token_interval():
    tpot = 2.0  # the node must notice long before the next token is due
    async with node_with_client(tokens=3, tpot=tpot) as (node, client):
        async with client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as response:
            async for line in response.aiter_lines():
                if line:
                    break
            running = (await client.get("/metrics")).text
            assert f'vllm:num_requests_running{{model_name="{MODEL}"}} 1.0' in running
        left_at = time.monotonic()
        record = next(r for r in node.requests if r.path == "/v1/chat/completions")
        await wait_ended(record)
        assert record.disconnected
        assert time.monotonic() - left_at < tpot / 2
        running = (await client.get("/metrics")).text
        assert f'vllm:num_requests_running{{model_name="{MODEL}"}} 0.0' in running


# ---- health and model-listing faults


async def test_health_fail_and_hang():
    async with node_with_client(health="fail", timeout=SHORT_READ) as (node, client):
        assert (await client.get("/health")).status_code == 503
        node.behaviour.health = "hang"
        with pytest.raises(httpx.ReadTimeout):
            await client.get("/health")
        await wait_ended(node.requests[-1])
        assert node.requests[-1].disconnected
        node.behaviour.health = "ok"
        assert (await client.get("/health")).status_code == 200


@pytest.mark.parametrize(
    ("fault", "status"),
    [("error", 500), ("empty", 200), ("error_body", 200), ("invalid_json", 200)],
)
async def test_models_faults(fault, status):
    async with node_with_client(models=fault) as (node, client):
        response = await client.get("/v1/models")
        assert response.status_code == status
        if fault == "invalid_json":
            with pytest.raises(ValueError):
                response.json()
            return
        body = response.json()
        if fault == "error":
            assert body["code"] == 500 and body["object"] == "error"
        elif fault == "empty":
            assert body == {"object": "list", "data": []}
        else:
            assert "data" not in body and body["error"]["message"] and body["error"]["type"]


async def test_models_hang():
    async with node_with_client(models="hang", timeout=SHORT_READ) as (node, client):
        with pytest.raises(httpx.ReadTimeout):
            await client.get("/v1/models")
        assert (await client.get("/health")).status_code == 200  # only the listing hangs


async def test_models_oversized_is_a_huge_valid_list_sent_in_chunks():
    async with node_with_client(models="oversized") as (node, client):
        async with client.stream("GET", "/v1/models") as response:
            assert response.status_code == 200 and "content-length" not in response.headers
            body = bytearray()
            async for data in response.aiter_raw():
                body += data
        assert len(body) >= OVERSIZED_MODELS_BYTES - 65536
        assert body.startswith(b'{"object": "list", "data": [{"id": ')
        first_mib = body[: body.index(b"}, ", 1 << 20) + 1] + b"]}"  # closed after an entry
        assert len(msgspec.json.decode(first_mib)["data"]) > 10_000
        assert msgspec.json.decode(body[body.rindex(b", ") + 2 : -2])["id"] == MODEL  # ends with "]}"

        async with client.stream("GET", "/v1/models") as response:  # a bounded reader gives up early
            async for data in response.aiter_raw():
                if len(data) > 0:
                    break
        record = node.requests[-1]
        await wait_ended(record)
        assert record.disconnected


# ---- refusing connections


async def test_refuse_closes_both_ports_and_recovers_on_the_same_ports():
    async with serve_node(spec()) as node, httpx.AsyncClient() as client:
        ports = node.vllm_port, node.metrics_port
        assert (await client.get(node.url + "/health")).status_code == 200  # leaves an idle keep-alive

        node.behaviour.refuse = True
        with pytest.raises(httpx.ConnectError):
            await client.get(node.url + "/health")
        with pytest.raises(httpx.ConnectError):
            await client.get(node.metrics_url + "/metrics")

        node.behaviour.refuse = False
        assert (node.vllm_port, node.metrics_port) == ports
        assert (await client.get(node.url + "/health")).status_code == 200
        assert (await client.get(node.metrics_url + "/health")).status_code == 200


async def test_refusing_from_the_start():
    async with serve_node(spec(refuse=True)) as node, httpx.AsyncClient() as client:
        assert node.vllm_port and node.metrics_port
        with pytest.raises(httpx.ConnectError):
            await client.get(node.url + "/health")
        node.behaviour.refuse = False
        assert (await client.get(node.url + "/health")).status_code == 200


# ---- recording and control


async def test_requests_are_recorded_with_headers_and_body():
    body = b'{"model": "m1", "prompt": "recorded", "temperature": 0.10}'
    async with node_with_client() as (node, client):
        before = time.time()
        await client.post(
            "/v1/completions?trace=1", content=body, headers={"X-Request-Id": "abc", "Content-Type": "application/json"}
        )
        record = node.requests[-1]
        await wait_ended(record)
        assert (record.listener, record.method, record.path) == ("vllm", "POST", "/v1/completions?trace=1")
        assert record.body == body and record.json()["prompt"] == "recorded"
        assert record.header("X-Request-Id") == "abc" and ("x-request-id", "abc") in record.headers
        assert before <= record.arrived_at <= time.time()
        assert not record.disconnected

        await client.get(node.metrics_url + "/metrics")
        assert node.requests[-1].listener == "metrics"


async def test_control_endpoint():
    async with node_with_client() as (node, client):
        current = await client.get("/_control")
        assert current.json() == node.behaviour.to_dict() == Behaviour().to_dict()

        changed = await client.post("/_control", json={"models": "empty", "ttft": 0.01})
        assert changed.status_code == 200 and changed.json()["models"] == "empty"
        assert node.behaviour.models == "empty" and node.behaviour.ttft == 0.01
        assert (await client.get("/v1/models")).json()["data"] == []

        unknown = await client.post("/_control", json={"bogus": 1, "tokens": 3})
        assert unknown.status_code == 400 and "bogus" in unknown.json()["message"]
        bad_value = await client.post("/_control", json={"tokens": 3, "health": "maybe"})
        assert bad_value.status_code == 400 and "health" in bad_value.json()["message"]
        assert node.behaviour.tokens == Behaviour().tokens  # nothing applied from a rejected change
        assert (await client.post("/_control", content=b"[]")).status_code == 400

        recorded = (await client.get("/_control/requests")).json()
        assert [r["path"] for r in recorded] == ["/v1/models"]  # control calls are not recorded
        assert recorded[0]["method"] == "GET" and isinstance(recorded[0]["headers"], list)
        assert (await client.delete("/_control/requests")).json() == {"cleared": 1}
        assert not node.requests

        refused = await client.post("/_control", json={"refuse": True})
        assert refused.status_code == 200 and refused.json()["refuse"] is True
        with pytest.raises(httpx.ConnectError):
            await client.get("/health")
        node.behaviour.refuse = False
        assert (await client.get("/health")).status_code == 200


def test_behaviour_rejects_unknown_fields_and_bad_values():
    behaviour = Behaviour()
    with pytest.raises(AttributeError, match="bogus"):
        behaviour.bogus = 1
    with pytest.raises(ValueError, match="completion"):
        behaviour.completion = "explode"
    with pytest.raises(ValueError, match="ttft"):
        Behaviour(ttft=-1)
    with pytest.raises(ValueError, match="refuse"):
        behaviour.refuse = "yes"

    with pytest.raises(ValueError, match="slowness"):
        behaviour.slowness = 0
    with pytest.raises(ValueError, match="prefill_hit_factor"):
        Behaviour(prefill_hit_factor=1.5)
    with pytest.raises(ValueError, match="max_running"):
        behaviour.max_running = -1
    with pytest.raises(ValueError, match="kv_cache_metric"):
        behaviour.kv_cache_metric = "newest"


# ---- the load model


def sample(metrics: str, name: str, model: str = MODEL) -> float:
    """The value of `name{model_name=model}` on a node's /metrics page."""
    prefix = f'{name}{{model_name="{model}"}} '
    return float(next(line[len(prefix) :] for line in metrics.splitlines() if line.startswith(prefix)))


async def test_requests_beyond_max_running_wait_their_turn_in_order():
    async with node_with_client(max_running=2, ttft=600.0, timeout=None) as (node, client):
        finished: list[int] = []

        async def ask(number: int) -> None:
            await client.post("/v1/chat/completions", json=chat_body(user=str(number)))
            finished.append(number)

        async with trio.open_nursery() as nursery:
            for number in range(5):
                nursery.start_soon(ask, number)
                with trio.fail_after(60):
                    while len(node.requests) <= number:
                        await trio.sleep(0.005)
            metrics = (await client.get("/metrics")).text
            assert (sample(metrics, "vllm:num_requests_running"), sample(metrics, "vllm:num_requests_waiting")) == (2, 3)
            assert parse_vllm_load(metrics.encode())[:2] == (2.0, 3.0)  # the gateway's parser reads the same
            node.behaviour.ttft = 0.0
            node.behaviour.max_running = 1  # the two running finish at 600 s: the queue still waits
            await trio.sleep(0.05)
            assert finished == []
            nursery.cancel_scope.cancel()
        # The clients left: those running see it at once, those waiting when their turn comes.
        with trio.fail_after(60):
            while not all(record.ended.is_set() for record in node.requests if record.path != "/metrics"):
                await trio.sleep(0.005)
        metrics = (await client.get("/metrics")).text
        assert (sample(metrics, "vllm:num_requests_running"), sample(metrics, "vllm:num_requests_waiting")) == (0, 0)


async def test_the_queue_is_first_come_first_served():
    async with node_with_client(max_running=1, tpot=0.05, timeout=None) as (node, client):
        finished: list[int] = []

        async def ask(number: int, tokens: int) -> None:
            await client.post("/v1/chat/completions", json=chat_body(max_tokens=tokens))
            finished.append(number)

        async with trio.open_nursery() as nursery:
            for number, tokens in enumerate((8, 4, 1)):  # the later, the shorter
                nursery.start_soon(ask, number, tokens)
                with trio.fail_after(60):
                    while len(node.requests) <= number:
                        await trio.sleep(0.005)
        assert finished == [0, 1, 2]  # without the queue the shortest would end first


@pytest.mark.parametrize(
    ("setting", "names"),
    [
        ("old", ["vllm:gpu_cache_usage_perc"]),
        ("new", ["vllm:kv_cache_usage_perc"]),
        ("both", ["vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"]),
    ],
)
async def test_the_kv_cache_gauge_under_each_name(setting, names):
    async with node_with_client(kv_cache_metric=setting, max_running=4, ttft=600.0, timeout=None) as (node, client):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(client.post, "/v1/chat/completions", json=chat_body()))
            with trio.fail_after(60):
                while not node.requests:
                    await trio.sleep(0.005)
            metrics = (await client.get("/metrics")).text
            nursery.cancel_scope.cancel()
    served = [name for name in ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc") if f"{name}{{" in metrics]
    assert served == names
    assert all(sample(metrics, name) == 0.25 for name in names)  # one of four places in the batch
    assert parse_vllm_load(metrics.encode()).kv_cache_usage == 0.25


async def test_a_prefix_cache_hit_comes_sooner_than_a_miss_and_is_counted():
    system = {"role": "system", "content": "You are a careful assistant. " * 40}
    async with node_with_client(prefix_cache_entries=2, prefill_per_kib=0.2, prefill_hit_factor=0.0) as (node, client):

        async def first_token_after(first_message: dict) -> float:
            body = chat_body(stream=True, messages=[first_message, {"role": "user", "content": "hi"}])
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                started = time.perf_counter()
                async for _ in response.aiter_bytes():
                    return time.perf_counter() - started
            raise AssertionError("no token")

        miss = await first_token_after(system)
        hit = await first_token_after(system)
        for other in ("a", "b"):  # two other prefixes push it out of a cache of two
            await first_token_after({"role": "system", "content": other})
        evicted = await first_token_after(system)
        metrics = (await client.get("/metrics")).text
    assert hit < miss and hit < evicted
    assert sample(metrics, "vllm:prefix_cache_queries_total") == 5
    assert sample(metrics, "vllm:prefix_cache_hits_total") == 1
    assert "# TYPE vllm:prefix_cache_hits_total counter" in metrics


# ---- the official openai SDK


async def test_openai_sdk_parses_every_kind_of_answer():
    async with serve_node(spec(name="gpu-node-7", tokens=5)) as node:
        client = openai.AsyncOpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0)
        try:
            messages = [{"role": "user", "content": "hi"}]
            chat = await client.chat.completions.create(model=MODEL, messages=messages)
            assert chat.choices[0].message.content.startswith("Hello from gpu-node-7")
            assert chat.usage.completion_tokens == 5

            stream = await client.chat.completions.create(model=MODEL, messages=messages, stream=True)
            pieces = [chunk.choices[0].delta.content async for chunk in stream if chunk.choices]
            assert len(pieces) == 5 and "".join(pieces).startswith("Hello from gpu-node-7")

            text = await client.completions.create(model="m2", prompt="hi")
            assert text.model == "m2" and text.choices[0].text.startswith("Hello from gpu-node-7")

            with pytest.raises(openai.NotFoundError, match="does not exist"):
                await client.completions.create(model="absent", prompt="hi")
        finally:
            await client.close()


# ---- configuration files and the command line


GATEWAY_TOML = """
[gateway]
listen = ":8000"

[[nodes]]
ip = "{ip1}"
name = "gpu-node-1"
vllm_port = {vllm_port}
metrics_port = {metrics_port}

[[nodes]]
IP = "{ip2}"
name = "gpu-node-3"
vllm_port = {vllm_port}
metrics_port = {metrics_port}
ring = "ring-a"

[models]
default = "extra-default"

[[models.available]]
name = "big"
ring = "ring-a"

[[models.available]]
name = "small"
"""


def test_specs_from_config_maps_rings_and_default_ports(tmp_path):
    text = GATEWAY_TOML.format(ip1="10.0.0.1", ip2="10.0.0.3", vllm_port=0, metrics_port=0)
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    standalone, ring_node = specs_from_config(str(path), Behaviour(tokens=3))
    assert (standalone.name, standalone.host) == ("gpu-node-1", "10.0.0.1")
    assert standalone.models == ["small", "extra-default"]
    assert (ring_node.name, ring_node.host, ring_node.models) == ("gpu-node-3", "10.0.0.3", ["big"])
    assert (standalone.vllm_port, standalone.metrics_port) == (8000, 9100)
    assert standalone.behaviour.tokens == 3 and standalone.behaviour is not ring_node.behaviour


def free_ports(host: str, count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind((host, 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


@asynccontextmanager
async def running_cli(*args: str, nodes: int) -> AsyncIterator[tuple[trio.Process, list[str]]]:
    """`python -m fixtures.node ARGS`, once it has printed its `nodes` lines; killed if still
    running at the end."""
    command = [sys.executable, "-m", "fixtures.node", *args]
    process = await trio.lowlevel.open_process(command, cwd=PROJECT_ROOT, stdout=subprocess.PIPE)
    try:
        output = b""
        with trio.fail_after(60):
            while output.count(b"\n") < nodes:
                data = await process.stdout.receive_some()
                assert data, f"the CLI exited early: {output!r}"
                output += data
        yield process, output.decode().splitlines()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def stop(process: trio.Process, signum: int) -> int:
    process.send_signal(signum)
    with trio.fail_after(60):
        return await process.wait()


async def test_cli_help():
    result = await trio.run_process(
        [sys.executable, "-m", "fixtures.node", "--help"], cwd=PROJECT_ROOT, capture_stdout=True
    )
    assert result.returncode == 0
    assert b"--from-config" in result.stdout and b"--nodes" in result.stdout


async def test_cli_from_config_serves_each_configured_node(tmp_path):
    vllm_port, metrics_port = free_ports("127.0.0.2", 2)
    path = tmp_path / "gateway.toml"
    ports = {"vllm_port": vllm_port, "metrics_port": metrics_port}
    path.write_text(GATEWAY_TOML.format(ip1="127.0.0.2", ip2="127.0.0.3", **ports))
    async with running_cli("--from-config", str(path), nodes=2) as (process, lines):
        assert "gpu-node-1" in lines[0] and f"http://127.0.0.2:{vllm_port}" in lines[0]
        async with httpx.AsyncClient() as client:
            for ip, expected in (("127.0.0.2", ["small", "extra-default"]), ("127.0.0.3", ["big"])):
                listing = (await client.get(f"http://{ip}:{vllm_port}/v1/models")).json()
                assert [card["id"] for card in listing["data"]] == expected
                assert (await client.get(f"http://{ip}:{metrics_port}/health")).text == "ok"
        assert await stop(process, signal.SIGTERM) == 0


async def test_cli_refuse_is_undone_through_the_control_port_which_never_refuses():
    async with running_cli("--nodes", "1", "--base-port", "0", nodes=1) as (process, [line]):
        fields = line.split()
        vllm_url, control_url = fields[fields.index("vllm") + 1], fields[fields.index("control") + 1]
        async with httpx.AsyncClient() as client:
            refused = await client.post(control_url + "/_control", json={"refuse": True})
            assert refused.json()["refuse"] is True
            with pytest.raises(httpx.ConnectError):
                await client.get(vllm_url + "/health")
            assert (await client.post(control_url + "/_control", json={"refuse": False})).json()["refuse"] is False
            assert (await client.get(vllm_url + "/health")).status_code == 200
            assert (await client.get(control_url + "/health")).status_code == 404  # the control port is only that
        assert await stop(process, signal.SIGTERM) == 0


async def test_cli_from_config_names_the_address_it_cannot_bind(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text('[[nodes]]\nip = "192.0.2.1"\nvllm_port = 8123\n')  # TEST-NET-1: no host has it
    result = await trio.run_process(
        [sys.executable, "-m", "fixtures.node", "--from-config", str(path)],
        cwd=PROJECT_ROOT, capture_stdout=True, capture_stderr=True, check=False,
    )  # fmt: skip
    assert (result.returncode, result.stdout) == (1, b"")
    assert b"cannot bind 192.0.2.1:8123: " in result.stderr, result.stderr


async def test_scenarios_help_shows_help_and_rewrites_nothing():
    logs = [PROJECT_ROOT / "fixtures" / "logs" / name for name in ("scenario.jsonl", "scenario-decisions.jsonl")]
    before = [log.stat().st_mtime_ns for log in logs]
    result = await trio.run_process(
        [sys.executable, "-m", "fixtures.scenarios", "--help"],
        cwd=PROJECT_ROOT, capture_stdout=True, capture_stderr=True,
    )  # fmt: skip
    assert result.stdout.startswith(b"usage: python -m fixtures.scenarios") and result.stderr == b""
    assert [log.stat().st_mtime_ns for log in logs] == before


async def test_cli_nodes_on_free_ports_stop_on_sigint():
    args = ["--nodes", "2", "--base-port", "0", "--models", "a,b", "--tokens", "3"]
    async with running_cli(*args, nodes=2) as (process, lines):
        urls = [line.split()[2] for line in lines]
        async with httpx.AsyncClient() as client:
            for name, url in zip(("gpu-node-1", "gpu-node-2"), urls):
                answer = await client.post(url + "/v1/completions", json={"model": "b", "prompt": "x"})
                assert answer.json()["choices"][0]["text"] == f"Hello from {name}"
        assert await stop(process, signal.SIGINT) == 0

"""The official `openai` Python SDK against the gateway: what OpenAI-compatible clients rely on
(answers, streamed deltas, the model list, typed errors) works through it unchanged. Real
gateway, real sockets, simulated nodes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import openai
import pytest

from fixtures.node import NodeSpec, token_texts

from harness import MODEL, Gateway, node_processes, node_specs, nodes_and_gateway, running_gateway

HI = [{"role": "user", "content": "hi"}]


@asynccontextmanager
async def sdk_client(gateway: Gateway, max_retries: int = 0) -> AsyncIterator[openai.AsyncOpenAI]:
    """An SDK client for the gateway (no retries unless asked, no proxy from the environment)."""
    http_client = openai.DefaultAsyncHttpxClient(trust_env=False)
    base_url = gateway.url + "/v1"
    async with openai.AsyncOpenAI(
        base_url=base_url, api_key="x", max_retries=max_retries, http_client=http_client
    ) as client:
        yield client


@asynccontextmanager
async def gateway_and_sdk(
    tmp_path: Path, specs: list[NodeSpec], **config: object
) -> AsyncIterator[tuple[Gateway, openai.AsyncOpenAI]]:
    """Simulated nodes, the gateway in front of them, and an SDK client for the gateway."""
    async with nodes_and_gateway(tmp_path, specs, **config) as (_, gateway), sdk_client(gateway) as client:
        yield gateway, client


async def test_chat_completion_says_which_node_answered(tmp_path):
    async with gateway_and_sdk(tmp_path, node_specs(1)) as (_, client):
        completion = await client.chat.completions.create(model=MODEL, messages=HI)
    assert completion.choices[0].message.content == "".join(token_texts("n1", 8))
    assert completion.choices[0].message.content.startswith("Hello from n1.")
    assert completion.model == MODEL and completion.choices[0].finish_reason == "stop"


async def test_streamed_chat_deltas_add_up_to_the_whole_answer(tmp_path):
    async with gateway_and_sdk(tmp_path, node_specs(1, tokens=6, tpot=0.01)) as (_, client):
        stream = await client.chat.completions.create(model=MODEL, messages=HI, stream=True)
        chunks = [chunk async for chunk in stream]
    deltas = [chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices]
    assert len(chunks) > 1
    assert "".join(deltas) == "".join(token_texts("n1", 6))
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_a_stream_whose_node_is_killed_mid_stream_raises(tmp_path):
    async with node_processes(1, "--tokens", "200", "--tpot", "0.02") as [node]:
        async with running_gateway(tmp_path, [node]) as gateway, sdk_client(gateway) as client:
            stream = await client.chat.completions.create(model=MODEL, messages=HI, stream=True)
            deltas = []
            with pytest.raises(openai.APIError) as caught:
                async for chunk in stream:
                    deltas.append(chunk.choices[0].delta.content)
                    node.kill()
    assert 1 <= len(deltas) < 200
    assert caught.value.message == "stream terminated by upstream failure"
    assert caught.value.code == "upstream_error"


async def test_legacy_completion(tmp_path):
    async with gateway_and_sdk(tmp_path, node_specs(1)) as (_, client):
        completion = await client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
    assert completion.choices[0].text == "Hello from n1."
    assert completion.choices[0].finish_reason == "length"


async def test_model_list_is_the_configured_models_in_config_order(tmp_path):
    models = [("zeta", ""), (MODEL, ""), ("alpha", "")]
    async with gateway_and_sdk(tmp_path, node_specs(1), models=models) as (_, client):
        page = await client.models.list()
    assert [model.id for model in page.data] == ["zeta", MODEL, "alpha"]


async def test_a_model_no_node_serves_is_the_sdks_not_found_error_and_never_retried(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1)) as (_, gateway), sdk_client(gateway, max_retries=3) as client:
        await gateway.discovered()
        with pytest.raises(openai.NotFoundError) as caught:
            await client.chat.completions.create(model="nobody-serves-this", messages=HI)
        requests = await gateway.metric('gateway_requests_total{model="(other)",status="404"}')
    failure = caught.value
    assert requests == 1  # the SDK did not ask again
    assert failure.status_code == 404 and failure.code == "model_not_found"
    assert failure.body["message"] == "The model `nobody-serves-this` does not exist."


async def test_a_configured_model_no_node_serves_is_the_sdks_internal_server_error(tmp_path):
    models = [(MODEL, ""), ("nobody-serves-this", "")]
    async with gateway_and_sdk(tmp_path, node_specs(1), models=models) as (gateway, client):
        await gateway.discovered()
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(model="nobody-serves-this", messages=HI)
    failure = caught.value
    assert failure.status_code == 503
    assert failure.body["message"] == "no healthy node available"
    assert "no healthy node available" in failure.message
    assert failure.code == "no_healthy_node"


async def test_a_request_over_the_body_limit_is_an_api_status_error_413(tmp_path):
    async with gateway_and_sdk(tmp_path, node_specs(1), max_request_body_bytes=200) as (_, client):
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 500}])
    failure = caught.value
    assert failure.status_code == 413
    assert failure.body["message"] == "request body too large"


async def test_retrieving_a_model_gives_its_object_in_the_list_and_an_unknown_one_the_not_found_error(tmp_path):
    models = [("org/with-a-slash", ""), (MODEL, "")]
    async with gateway_and_sdk(tmp_path, node_specs(1), models=models) as (gateway, client):
        page = await client.models.list()
        retrieved = [await client.models.retrieve(model.id) for model in page.data]
        with pytest.raises(openai.NotFoundError) as caught:
            await client.models.retrieve("org/not-configured")
        raw = await gateway.http.get(gateway.url + "/v1/models/org/with-a-slash")  # the slash unescaped
    assert retrieved == page.data
    assert raw.json() == {"id": "org/with-a-slash", "object": "model", "created": 0, "owned_by": "cluster"}
    assert [model.created for model in page.data] == [0, 0]  # the SDK's Model requires it
    assert caught.value.status_code == 404 and caught.value.code == "model_not_found"
    assert caught.value.body["message"] == "The model `org/not-configured` does not exist."

"""SIGTERM's drain lasts `gateway.shutdown_grace` (`serve --shutdown-grace`): a stream longer
than the default grace survives a restart with a longer one, and a stream still open when the
grace ends gets the SSE error event, which the OpenAI SDK raises, and a proper end (never a bare
cut). The real `interlock serve` in a subprocess, a simulated node, the SDK."""

from __future__ import annotations

import signal

import httpx
import openai
import pytest
import trio

from events.config import DEFAULT_SHUTDOWN_GRACE
from fixtures.node import serve_nodes, token_texts

from harness import MODEL, config_text, free_port, node_specs, wait_until_ready
from test_cli_serve import interlock_serve

HI = [{"role": "user", "content": "hi"}]


async def _ready(url: str) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
        await wait_until_ready(client, url)


def _sdk(url: str) -> openai.AsyncOpenAI:
    http_client = openai.DefaultAsyncHttpxClient(trust_env=False)
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, http_client=http_client)


async def test_a_stream_longer_than_the_default_grace_survives_sigterm_with_a_longer_one(tmp_path):
    tokens, tpot = 24, 0.5
    assert tokens * tpot > DEFAULT_SHUTDOWN_GRACE  # the default grace would end it
    async with serve_nodes(node_specs(1, tokens=tokens, tpot=tpot)) as nodes:
        config_path = tmp_path / "gateway.toml"
        config_path.write_text(config_text(nodes))
        api = free_port()
        options = ("--config", str(config_path), "--listen", f"127.0.0.1:{api}", "--shutdown-grace", "1m")
        async with interlock_serve(*options) as gateway:
            url = f"http://127.0.0.1:{api}"
            await _ready(url)
            async with _sdk(url) as client:
                stream = await client.chat.completions.create(model=MODEL, messages=HI, stream=True)
                chunks = [await anext(stream)]
                gateway.process.send_signal(signal.SIGTERM)
                chunks += [chunk async for chunk in stream]
            code, _, errors = await gateway.stop()
    deltas = [chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices]
    assert "".join(deltas) == "".join(token_texts("n1", tokens))
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert (code, errors) == (0, "")


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_stream_open_when_the_grace_ends_gets_the_error_event_and_a_proper_end(tmp_path, workers):
    async with serve_nodes(node_specs(1, tokens=100, tpot=0.1)) as nodes:
        config_path = tmp_path / "gateway.toml"
        config_path.write_text(config_text(nodes, shutdown_grace="1s", workers=workers))
        api = free_port()
        async with interlock_serve("--config", str(config_path), "--listen", f"127.0.0.1:{api}") as gateway:
            url = f"http://127.0.0.1:{api}"
            await _ready(url)
            request = {"model": MODEL, "messages": HI, "stream": True}
            async with _sdk(url) as client, httpx.AsyncClient(trust_env=False, timeout=60) as raw_client:
                async with raw_client.stream("POST", url + "/v1/chat/completions", json=request) as raw:
                    stream = await client.chat.completions.create(model=MODEL, messages=HI, stream=True)
                    deltas = [(await anext(stream)).choices[0].delta.content]
                    gateway.process.send_signal(signal.SIGTERM)
                    with pytest.raises(openai.APIError) as caught:
                        async for chunk in stream:
                            deltas.append(chunk.choices[0].delta.content)
                    raw_body = b"".join([piece async for piece in raw.aiter_raw()])  # ends whole, or raises
            code, _, errors = await gateway.stop()
    assert not isinstance(caught.value, openai.APIConnectionError)  # the event, not a cut connection
    assert caught.value.message == "stream ended: the gateway is shutting down"
    assert caught.value.code == "gateway_shutting_down"
    assert 1 <= len(deltas) < 100
    events = raw_body.split(b"\n\n")
    assert events[-2].startswith(b'data: {"error":{"message":"stream ended: the gateway is shutting down"')
    assert events[-1] == b"" and b"[DONE]" not in raw_body
    assert (code, errors) == (0, "")

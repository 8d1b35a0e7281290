"""Streaming completions through the gateway: chunks flow as the node sends them, the commit gate
at the first body byte, the first-chunk deadline, truncated streams, and client disconnects."""

from __future__ import annotations

import httpx
import msgspec
import trio

from harness import (
    MODEL,
    chat,
    completions_to,
    error_message,
    node_specs,
    nodes_and_gateway,
    post_and_leave,
    post_cut_short,
    sse_events,
)

CHAT = "/v1/chat/completions"


async def test_chunks_reach_the_client_as_the_node_sends_them(tmp_path):
    tokens, tpot = 6, 0.1
    async with nodes_and_gateway(tmp_path, node_specs(1, tokens=tokens, tpot=tpot)) as (nodes, gateway):
        arrivals = []
        async with gateway.http.stream("POST", gateway.url + CHAT, json=chat(stream=True)) as response:
            assert response.status_code == 200
            assert response.headers["content-type"] == "text/event-stream"
            assert "content-length" not in response.headers
            text = ""
            async for chunk in response.aiter_text():
                arrivals.append(trio.current_time())
                text += chunk
        events = sse_events(text)
        assert len(events) == tokens + 1 and events[-1] == "[DONE]"
        # One arrival per token, spread like the node's token delay (asserted loosely).
        assert len(arrivals) >= tokens
        assert arrivals[-1] - arrivals[0] >= (tokens - 1) * tpot * 0.5
        assert await gateway.metric('gateway_requests_total{model="test-model",status="200"}') == 1
        assert await gateway.metric('gateway_proxy_attempts_total{model="test-model",status="200"}') == 1


async def test_with_retry_unanswered_a_stream_without_a_first_chunk_is_retried_on_the_next_node(tmp_path):
    timeouts = {"first_byte_timeout": "1s", "retry_unanswered": True}
    async with nodes_and_gateway(tmp_path, node_specs(2), **timeouts) as (nodes, gateway):
        await gateway.discovered()
        nodes[0].behaviour.completion = "no_first_chunk"
        response = await gateway.http.post(gateway.url + CHAT, json=chat(stream=True))
        assert response.status_code == 200
        assert response.headers["x-served-by"] == "n2"
        assert sse_events(response.text)[-1] == "[DONE]"
        [retry] = gateway.logged("retrying after streaming failure before first chunk")
        assert retry == retry | {"node": nodes[0].host, "error": "timed out waiting for first stream chunk", "level": "info"}
        assert not gateway.node(nodes[0].host).is_offline(gateway.control_plane.view.now())  # slow is not down
        # The abandoned request was closed on the node.
        with trio.fail_after(60):
            await completions_to(nodes[0])[0].ended.wait()
        assert completions_to(nodes[0])[0].disconnected
        assert await gateway.metric('gateway_proxy_attempts_total{model="test-model",status="502"}') == 1
        assert await gateway.metric('gateway_requests_total{model="test-model",status="200"}') == 1


async def test_a_refused_stream_is_retried_before_the_first_chunk(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(2)) as (nodes, gateway):
        await gateway.discovered()
        nodes[0].behaviour.refuse = True
        response = await gateway.http.post(gateway.url + CHAT, json=chat(stream=True))
        assert response.status_code == 200 and response.headers["x-served-by"] == "n2"
        assert [line["node"] for line in gateway.logged("retrying after streaming failure before first chunk")] == [nodes[0].host]


async def test_a_stream_cut_after_the_first_chunk_ends_with_an_error_event_cut_short_without_done_or_502(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(2, tokens=8, completion="close_mid_stream")) as (nodes, gateway):
        response, content = await post_cut_short(gateway.http, gateway.url + CHAT, chat(stream=True))
        assert response.status_code == 200
        events = sse_events(content.decode())
        assert 2 <= len(events) < 9 and "[DONE]" not in events
        assert content.endswith(b"\n\n")
        error = {"message": "stream terminated by upstream failure", "type": "server_error", "code": "upstream_error"}
        assert msgspec.json.decode(events[-1]) == {"error": error}
        assert all("choices" in msgspec.json.decode(event) for event in events[:-1])
        [terminated] = gateway.logged("stream terminated by upstream failure")
        assert terminated["level"] == "error" and terminated["error"]
        assert gateway.logged("retrying after streaming failure before first chunk") == []
        assert sum(len(completions_to(node)) for node in nodes) == 1  # committed: never retried
        assert await gateway.metric('gateway_requests_total{model="test-model",status="200"}') == 1
        assert await gateway.metric('gateway_requests_total{model="test-model",status="502"}') is None
        served_by = response.headers["x-served-by"]
        [cut_by] = [node.host for node in nodes if node.name == served_by]
        assert await gateway.metric(f'gateway_response_truncated_total{{node="{cut_by}"}}') == 1


async def test_an_http_error_on_a_stream_request_is_passed_through(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(2, completion="http_error", error_status=400)) as (nodes, gateway):
        response = await gateway.http.post(gateway.url + CHAT, json=chat(stream=True))
        assert response.status_code == 400
        assert response.headers["content-type"] == "application/json"
        assert response.json()["type"] == "BadRequestError"
        assert sum(len(completions_to(node)) for node in nodes) == 1


async def test_a_client_that_disconnects_mid_stream_cancels_the_upstream_request(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1, tokens=200, tpot=0.05)) as (nodes, gateway):
        async with httpx.AsyncClient() as client:
            async with client.stream("POST", gateway.url + CHAT, json=chat(stream=True)) as response:
                async for _ in response.aiter_bytes():
                    break  # the first chunk, then hang up
        [upstream] = completions_to(nodes[0])
        with trio.fail_after(60):
            await upstream.ended.wait()
        assert upstream.disconnected
        await gateway.wait_for(lambda: gateway.logged("client write failed after commit"))
        assert await gateway.metric('gateway_response_client_write_failures_total{model="test-model"}') == 1


async def test_a_client_that_leaves_before_anything_was_sent_cancels_the_upstream_request(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1, ttft=5.0)) as (nodes, gateway):
        for stream in (True, False):
            upstream = await post_and_leave(gateway, nodes[0], chat(stream=stream))
            with trio.fail_after(60):
                await upstream.ended.wait()
            assert upstream.disconnected
        # Nothing was answered: no metrics, no retry, no failure logged (plinth's ClientAborted).
        assert await gateway.metric('gateway_requests_total{model="test-model",status="200"}') is None
        assert await gateway.metric('gateway_proxy_attempts_total{model="test-model",status="502"}') is None
        assert gateway.logged("retrying after streaming failure before first chunk") == []
        assert gateway.logged("client write failed after commit") == []


async def test_no_healthy_node_for_a_stream_is_a_json_503(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1), models=[(MODEL, ""), ("missing", "")]) as (nodes, gateway):
        await gateway.discovered()
        response = await gateway.http.post(gateway.url + CHAT, json=chat("missing", stream=True))
        assert response.status_code == 503
        assert error_message(response) == "no healthy node available"

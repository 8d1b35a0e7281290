"""Tenants and their limits (issue 22): requests per minute, tokens per minute settled to the
nodes' `usage`, requests in flight, through the OpenAI SDK (its RateLimitError, OpenAI's
headers), a reload that changes limits, and limits held across two workers. Real gateway, real
sockets, simulated nodes."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from controlplane.infrastructure.config import ConfigError, load_config
from dataplane.admission.tokens import MAX_HELD_EVENT_BYTES, UsageTap
from events.decisions import Verdict
from fixtures.node import serve_nodes, token_texts
from interlock.cli import main
from interlock.describe import describe_config

from harness import (
    MODEL,
    Gateway,
    decision_records,
    free_port,
    node_specs,
    nodes_and_gateway,
    post_cut_short,
    running_gateway,
    serve_process,
    sse_events,
    tenants_toml,
    write_config,
)
from raw_http import ServerConnection, raw_node

HI = [{"role": "user", "content": "hi"}]


def sdk(gateway: Gateway, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=gateway.url + "/v1",
        api_key=key,
        max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(trust_env=False),
    )


async def records_for(gateway: Gateway, decisions: Path, count: int) -> list:
    await gateway.wait_for(lambda: len(decision_records(decisions)) >= count)
    return decision_records(decisions)


async def test_requests_per_minute_through_the_sdk(tmp_path):
    decisions = tmp_path / "decisions.jsonl"
    extra = tenants_toml(
        {"name": "team-a", "api_keys": ["key-a"], "requests_per_minute": 2, "priority": 3},
        {"name": "team-b", "api_keys": ["key-b"]},
    )
    async with nodes_and_gateway(tmp_path, node_specs(1), extra=extra, decision_log=str(decisions)) as (_, gateway):
        async with sdk(gateway, "key-a") as a, sdk(gateway, "key-b") as b:
            first = await a.chat.completions.with_raw_response.create(model=MODEL, messages=HI)
            second = await a.chat.completions.with_raw_response.create(model=MODEL, messages=HI)
            with pytest.raises(openai.RateLimitError) as refused:
                await a.chat.completions.create(model=MODEL, messages=HI)
            unlimited = await b.chat.completions.with_raw_response.create(model=MODEL, messages=HI)
        records = await records_for(gateway, decisions, 4)
        metrics = await gateway.metrics()

    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    assert first.headers["x-ratelimit-reset-requests"].endswith("s")
    assert "x-ratelimit-limit-requests" not in unlimited.headers
    assert "x-ratelimit-limit-tokens" not in first.headers
    error = refused.value
    assert error.status_code == 429 and error.code == "rate_limit_exceeded"
    assert error.type == "rate_limit_exceeded"
    assert "team-a" in error.message and "requests" in error.message
    headers = error.response.headers
    assert int(headers["retry-after"]) >= 1 and int(headers["retry-after-ms"]) > 0
    assert int(headers["retry-after-ms"]) <= int(headers["retry-after"]) * 1000
    assert headers["x-ratelimit-limit-requests"] == "2" and headers["x-ratelimit-remaining-requests"] == "0"

    admissions = [record.admission for record in records]
    assert [(admission.tenant, admission.verdict) for admission in admissions] == [
        ("team-a", Verdict.ADMITTED),
        ("team-a", Verdict.ADMITTED),
        ("team-a", Verdict.REFUSED),
        ("team-b", Verdict.ADMITTED),
    ]
    refusal = admissions[2]
    assert (refusal.refused_by, refusal.limit, refusal.remaining, refusal.priority) == ("requests", 2, 0, 3)
    assert records[2].status == 429 and records[2].attempts == ()
    assert 'interlock_admission_requests_total{priority="3",tenant="team-a"} 2.0' in metrics
    assert 'interlock_admission_refusals_total{limit="requests",priority="3",tenant="team-a"} 1.0' in metrics
    assert 'interlock_admission_requests_total{priority="0",tenant="team-b"} 1.0' in metrics


async def test_tokens_are_reserved_then_settled_to_the_usage_the_node_reports(tmp_path):
    """Not streamed: the reservation (max_tokens plus the prompt's estimate) is settled to the
    answer's usage; the tokens counted are what the nodes reported."""
    decisions = tmp_path / "decisions.jsonl"
    extra = tenants_toml({"name": "team-a", "api_keys": ["key-a"], "tokens_per_minute": 100_000})
    extra += "[admission]\ndefault_max_tokens = 300\n"
    specs = node_specs(1, tokens=5)
    async with nodes_and_gateway(tmp_path, specs, extra=extra, decision_log=str(decisions)) as (_, gateway):
        async with sdk(gateway, "key-a") as a:
            answers = [
                await a.chat.completions.with_raw_response.create(model=MODEL, messages=HI, max_tokens=50),
                await a.completions.with_raw_response.create(model=MODEL, prompt="hello there"),
            ]
        records = await records_for(gateway, decisions, 2)
        metrics = await gateway.metrics()

    usage = [answer.parse().usage.total_tokens for answer in answers]
    assert [record.admission.tokens_used for record in records] == usage
    reserved = [record.admission.tokens_reserved for record in records]
    assert 50 < reserved[0] < 50 + 200 and 300 < reserved[1] < 300 + 200  # the default completion bound
    assert answers[0].headers["x-ratelimit-limit-tokens"] == "100000"
    assert int(answers[0].headers["x-ratelimit-remaining-tokens"]) <= 100_000 - reserved[0]
    assert f'interlock_admission_tokens_total{{priority="0",tenant="team-a"}} {float(sum(usage))}' in metrics


async def test_a_token_limit_refuses_once_spent_and_says_so(tmp_path):
    """A request is admitted while any tokens are left; the node's usage beyond the minute's
    limit is owed, and refuses the next until it has refilled."""
    extra = tenants_toml({"name": "team-a", "api_keys": ["key-a"], "tokens_per_minute": 30})
    async with nodes_and_gateway(tmp_path, node_specs(1, tokens=40), extra=extra) as (_, gateway):
        async with sdk(gateway, "key-a") as a:
            await a.chat.completions.create(model=MODEL, messages=HI)
            with pytest.raises(openai.RateLimitError) as refused:
                await a.chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
    assert "tokens" in refused.value.message
    headers = refused.value.response.headers
    assert headers["x-ratelimit-limit-tokens"] == "30" and headers["x-ratelimit-remaining-tokens"] == "0"
    assert int(headers["retry-after-ms"]) > 2000  # forty-odd tokens owed, at half a token a second


async def test_a_token_refusal_says_to_retry_once_the_bucket_holds_the_request_s_reservation(tmp_path):
    """Ten tokens a second; the first answer leaves the tenant in debt. A refused request that
    reserves about 500 tokens more than another is told to wait about 50 s more (a retry at the
    first token back would only deepen the debt)."""
    extra = tenants_toml({"name": "team-a", "api_keys": ["key-a"], "tokens_per_minute": 600})
    async with nodes_and_gateway(tmp_path, node_specs(1, tokens=700), extra=extra) as (_, gateway):
        url, key = gateway.url + "/v1/chat/completions", {"authorization": "Bearer key-a"}
        assert (await gateway.http.post(url, json={"model": MODEL, "messages": HI}, headers=key)).status_code == 200
        small, large = [
            await gateway.http.post(url, json={"model": MODEL, "messages": HI, "max_tokens": tokens}, headers=key)
            for tokens in (1, 501)
        ]
    assert small.status_code == large.status_code == 429
    waits = [int(response.headers["retry-after-ms"]) for response in (small, large)]
    assert waits[1] - waits[0] > 40_000  # 500 tokens at 10 a second, less what refilled between the two


async def test_a_stream_asks_the_node_for_usage_and_the_client_does_not_see_it(tmp_path):
    """The client did not ask for usage: the node is asked, its usage chunk is settled and left
    out of the client's stream, every other event unchanged."""
    decisions = tmp_path / "decisions.jsonl"
    extra = tenants_toml({"name": "team-a", "api_keys": ["key-a"], "tokens_per_minute": 100_000})
    specs = node_specs(1, tokens=4)
    async with nodes_and_gateway(tmp_path, specs, extra=extra, decision_log=str(decisions)) as ([node], gateway):
        body = {"model": MODEL, "messages": HI, "stream": True, "temperature": 0.5}
        response = await gateway.http.post(
            gateway.url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer key-a"}
        )
        [record] = await records_for(gateway, decisions, 1)
        sent = json.loads(node.requests[-1].body)
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["choices"] for chunk in chunks) and len(chunks) == 4
    assert "".join(chunk["choices"][0]["delta"]["content"] for chunk in chunks) == "".join(token_texts("n1", 4))
    assert response.text.count("\n\n") == len(events)  # every event whole, nothing added
    assert sent["stream_options"] == {"include_usage": True} and sent["temperature"] == 0.5
    assert record.admission.tokens_used is not None and record.admission.tokens_used > 4  # prompt and completion


async def test_a_stream_whose_client_asked_for_usage_gets_it(tmp_path):
    decisions = tmp_path / "decisions.jsonl"
    extra = tenants_toml({"name": "team-a", "api_keys": ["key-a"], "tokens_per_minute": 100_000})
    async with nodes_and_gateway(
        tmp_path, node_specs(1, tokens=4), extra=extra, decision_log=str(decisions)
    ) as ([node], gateway):
        async with sdk(gateway, "key-a") as a:
            stream = await a.chat.completions.create(
                model=MODEL, messages=HI, stream=True, stream_options={"include_usage": True}
            )
            chunks = [chunk async for chunk in stream]
        [record] = await records_for(gateway, decisions, 1)
        sent = json.loads(node.requests[-1].body)
    assert sent["stream_options"] == {"include_usage": True}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert record.admission.tokens_used == usage.total_tokens


async def endless_event(connection: ServerConnection) -> None:
    """A stream's head, one whole event, then an event that never ends (64 KiB pieces, 3 MiB in
    all), then nothing until the gateway closes the connection."""
    await connection.send(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    first = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
    await connection.send(b"%x\r\n%s\r\n" % (len(first), first))
    piece = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * 65_536
    for _ in range(48):
        try:
            await connection.send(b"%x\r\n%s\r\n" % (len(piece), piece))
        except trio.BrokenResourceError:
            return
    await connection.wait_closed_by_client()


async def test_a_stream_event_that_never_ends_is_cut_at_its_bound_and_counted(tmp_path):
    """A token-counted stream's event is held back until it ends (to read its usage): one past
    MAX_HELD_EVENT_BYTES ends the stream as a node failure does, with the error event, counted
    as a truncated response; the gateway answers on."""
    decisions = tmp_path / "decisions.jsonl"
    extra = tenants_toml({"name": "team-a", "api_keys": ["key-a"], "tokens_per_minute": 100_000})
    async with (
        raw_node(endless_event, models=[MODEL]) as node,
        running_gateway(tmp_path, [node], extra=extra, decision_log=str(decisions)) as gateway,
    ):
        await gateway.discovered()
        body = {"model": MODEL, "messages": HI, "stream": True}
        headers = {"authorization": "Bearer key-a"}
        with trio.fail_after(30):
            async with httpx.AsyncClient(timeout=30, trust_env=False, headers=headers) as http:
                response, received = await post_cut_short(http, gateway.url + "/v1/chat/completions", body)
        assert response.status_code == 200
        events = sse_events(received.decode())
        assert json.loads(events[0])["choices"][0]["delta"]["content"] == "Hi"
        assert json.loads(events[-1])["error"]["message"] == "stream terminated by upstream failure"
        assert len(received) < MAX_HELD_EVENT_BYTES  # the unfinished event was held back, then dropped
        assert await gateway.metric(f'gateway_response_truncated_total{{node="{node.host}"}}') == 1
        [record] = await records_for(gateway, decisions, 1)
        assert (await gateway.http.get(gateway.url + "/health")).status_code == 200
    [attempt] = record.attempts
    assert (attempt.outcome, attempt.error) == ("truncated", f"stream event longer than {MAX_HELD_EVENT_BYTES} bytes")


async def test_a_stream_left_before_its_usage_is_charged_what_it_relayed(tmp_path):
    """Without the usage chunk (the client left), the tenant is charged the prompt's estimate
    and an event's token for each event relayed, not given its reservation back."""
    decisions = tmp_path / "decisions.jsonl"
    extra = tenants_toml({"name": "team-a", "api_keys": ["key-a"], "tokens_per_minute": 100_000})
    specs = node_specs(1, tokens=1000, tpot=0.01)
    async with nodes_and_gateway(tmp_path, specs, extra=extra, decision_log=str(decisions)) as (_, gateway):
        body = {"model": MODEL, "messages": HI, "stream": True, "max_tokens": 1000}
        received = 0
        async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
            headers = {"authorization": "Bearer key-a"}
            async with http.stream("POST", gateway.url + "/v1/chat/completions", json=body, headers=headers) as answer:
                async for text in answer.aiter_text():
                    received += text.count("\n\n")
                    if received >= 5:
                        break
        [record] = await records_for(gateway, decisions, 1)
    used = record.admission.tokens_used
    assert used is not None and used >= received
    assert used < record.admission.tokens_reserved  # the rest of the reservation went back


async def test_a_generation_without_max_tokens_gets_one_its_remaining_tokens_allow(tmp_path):
    """A token-counted tenant's generation that names no bound gets `max_tokens`: the default,
    or what its remaining tokens leave after the prompt's estimate; so its reservation bounds
    what the node generates. A body that names one is left as it is."""
    decisions = tmp_path / "decisions.jsonl"
    extra = tenants_toml({"name": "team-a", "api_keys": ["key-a"], "tokens_per_minute": 300})
    extra += "[admission]\nqueue = false\ndefault_max_tokens = 100\n"
    async with nodes_and_gateway(
        tmp_path, node_specs(1, tokens=120), extra=extra, decision_log=str(decisions)
    ) as ([node], gateway):
        async with sdk(gateway, "key-a") as a:
            await a.chat.completions.create(model=MODEL, messages=HI)  # the default: 100 made
            await a.chat.completions.create(model=MODEL, messages=HI, max_tokens=150)  # 120 made
            await a.chat.completions.create(model=MODEL, messages=HI)  # less than 100 left
        records = await records_for(gateway, decisions, 3)
    sent = [json.loads(request.body) for request in node.requests if request.method == "POST"]
    assert [body["max_tokens"] for body in sent[:2]] == [100, 150]
    assert 1 <= sent[2]["max_tokens"] < 100
    # The two alike bodies' reservations are each its bound and the same prompt estimate.
    assert records[0].admission.tokens_reserved - 100 == records[2].admission.tokens_reserved - sent[2]["max_tokens"]


async def test_an_unlimited_tenants_stream_is_left_alone(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1, tokens=3)) as ([node], gateway):
        body = {"model": MODEL, "messages": HI, "stream": True}
        response = await gateway.http.post(gateway.url + "/v1/chat/completions", json=body)
        sent = json.loads(node.requests[-1].body)
    assert "stream_options" not in sent
    assert "x-ratelimit-limit-requests" not in response.headers


async def test_requests_in_flight(tmp_path):
    decisions = tmp_path / "decisions.jsonl"
    extra = tenants_toml({"name": "team-a", "api_keys": ["key-a"], "max_in_flight": 1})
    specs = node_specs(1, tokens=100, tpot=0.02)
    async with nodes_and_gateway(tmp_path, specs, extra=extra, decision_log=str(decisions)) as (_, gateway):
        async with sdk(gateway, "key-a") as a:
            stream = await a.chat.completions.create(model=MODEL, messages=HI, stream=True)
            first = await anext(aiter(stream))
            with pytest.raises(openai.RateLimitError) as refused:
                await a.chat.completions.create(model=MODEL, messages=HI)
            async for _ in stream:
                pass
            after = await a.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
        records = await records_for(gateway, decisions, 3)
    assert first.choices and after.choices
    assert "in flight" in refused.value.message
    headers = refused.value.response.headers  # the limit that refused, not only the others
    assert (headers["x-ratelimit-limit-in-flight"], headers["x-ratelimit-remaining-in-flight"]) == ("1", "0")
    refusal = next(record.admission for record in records if record.status == 429)
    assert (refusal.refused_by, refusal.limit, refusal.remaining) == ("in_flight", 1, 0)


async def test_priority_follows_the_objective_header_down_never_up(tmp_path):
    decisions = tmp_path / "decisions.jsonl"
    extra = tenants_toml({"name": "team-a", "api_keys": ["key-a"], "priority": 5})
    extra += "[admission]\nobjectives = { batch = 1, critical = 9 }\n"
    async with nodes_and_gateway(
        tmp_path, node_specs(1), extra=extra, decision_log=str(decisions)
    ) as (_, gateway):
        for objective in ("batch", "critical", "unknown"):
            headers = {
                "authorization": "Bearer key-a",
                "x-gateway-inference-objective": objective,
                "x-gateway-inference-fairness-id": f"user-{objective}",
            }
            response = await gateway.http.post(
                gateway.url + "/v1/chat/completions", json={"model": MODEL, "messages": HI}, headers=headers
            )
            assert response.status_code == 200
        records = await records_for(gateway, decisions, 3)
    assert [(record.admission.priority, record.admission.fairness_id) for record in records] == [
        (1, "user-batch"),
        (5, "user-critical"),
        (5, "user-unknown"),
    ]


async def test_without_keys_every_request_is_the_default_tenant_whose_limits_apply(tmp_path):
    decisions = tmp_path / "decisions.jsonl"
    extra = tenants_toml({"name": "default", "requests_per_minute": 1})
    async with nodes_and_gateway(
        tmp_path, node_specs(1), extra=extra, decision_log=str(decisions)
    ) as (_, gateway):
        body = {"model": MODEL, "messages": HI}
        statuses = [
            (await gateway.http.post(gateway.url + "/v1/chat/completions", json=body)).status_code for _ in range(2)
        ]
        records = await records_for(gateway, decisions, 2)
    assert statuses == [200, 429]
    assert {record.admission.tenant for record in records} == {"default"}


async def test_gateway_keys_are_a_tenant_without_limits(tmp_path):
    decisions = tmp_path / "decisions.jsonl"
    extra = tenants_toml({"name": "team-a", "api_keys": ["key-a"], "requests_per_minute": 1})
    async with nodes_and_gateway(
        tmp_path, node_specs(1), extra=extra, api_keys=["old-key"], decision_log=str(decisions)
    ) as (_, gateway):
        body = {"model": MODEL, "messages": HI}
        for key, expected in (("old-key", 200), ("old-key", 200), ("key-a", 200), ("key-a", 429), ("nope", 401)):
            response = await gateway.http.post(
                gateway.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
            )
            assert response.status_code == expected, key
        records = await records_for(gateway, decisions, 4)
    assert [record.admission.tenant for record in records] == ["gateway", "gateway", "team-a", "team-a"]


async def test_a_reload_changes_limits_without_resetting_what_was_used(tmp_path):
    extra = tenants_toml({"name": "team-a", "api_keys": ["key-a"], "requests_per_minute": 2})
    async with nodes_and_gateway(tmp_path, node_specs(1), extra=extra) as (nodes, gateway):
        async with sdk(gateway, "key-a") as a:
            await a.chat.completions.create(model=MODEL, messages=HI)
            await a.chat.completions.create(model=MODEL, messages=HI)
            with pytest.raises(openai.RateLimitError):
                await a.chat.completions.create(model=MODEL, messages=HI)
            text = gateway.config_path.read_text().replace("requests_per_minute = 2", "requests_per_minute = 3")
            gateway.config_path.write_text(text)
            assert await gateway.control_plane.reload()
            raw = await a.chat.completions.with_raw_response.create(model=MODEL, messages=HI)
            with pytest.raises(openai.RateLimitError) as refused:
                await a.chat.completions.create(model=MODEL, messages=HI)
    # Two of three used before the reload: one more, then refused (a reset would allow three).
    assert raw.headers["x-ratelimit-limit-requests"] == "3"
    assert raw.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.value.response.headers["x-ratelimit-limit-requests"] == "3"


async def test_limits_hold_for_the_host_across_two_workers(tmp_path):
    """Two workers lease the leader's quota in blocks: together they admit the limit (and what
    refilled meanwhile), not the limit each."""
    decisions = tmp_path / "decisions.jsonl"
    limit = 20
    extra = tenants_toml({"name": "team-a", "api_keys": ["key-a"], "requests_per_minute": limit})
    async with nodes_and_gateway(
        tmp_path, node_specs(1), extra=extra, workers=2, decision_log=str(decisions)
    ) as (_, gateway):
        statuses: list[int] = []
        started = trio.current_time()

        async def client() -> None:
            # A new connection per request, so that the kernel hands them to both workers.
            for _ in range(10):
                async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
                    response = await http.post(
                        gateway.url + "/v1/chat/completions",
                        json={"model": MODEL, "messages": HI},
                        headers={"authorization": "Bearer key-a"},
                    )
                statuses.append(response.status_code)

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(client)
        elapsed = trio.current_time() - started
        records = await records_for(gateway, decisions, 40)
    admitted = statuses.count(200)
    refilled = math.ceil(elapsed * limit / 60)
    assert statuses.count(429) == 40 - admitted
    assert limit - 2 <= admitted <= limit + refilled  # each worker may end holding a lease's block (one)
    assert {record.worker for record in records if record.status == 200} == {1, 2}


async def test_explain_and_whatif_tell_who_was_limited(tmp_path, capsys):
    """`explain --request-id` prints a refused request's admission; `whatif --tenants` replays
    the records under other limits (open-loop)."""
    decisions = tmp_path / "decisions.jsonl"
    extra = tenants_toml(
        {"name": "team-a", "api_keys": ["key-a"], "requests_per_minute": 2, "priority": 2},
        {"name": "team-b", "api_keys": ["key-b"]},
    )
    async with nodes_and_gateway(tmp_path, node_specs(1), extra=extra, decision_log=str(decisions)) as (_, gateway):
        for index, key in enumerate(["key-a", "key-a", "key-a", "key-b", "key-b", "key-b"]):
            await gateway.http.post(
                gateway.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": HI},
                headers={"authorization": f"Bearer {key}", "x-request-id": f"r{index}"},
            )
        await records_for(gateway, decisions, 6)

    assert main(["explain", "--request-id", "r2", "--decisions", str(decisions)]) == 0
    out = capsys.readouterr().out
    lines = {line.split("  ")[0]: line.split("  ", 1)[1].strip() for line in out.splitlines() if "  " in line}
    assert lines["tenant"] == "team-a" and lines["priority"] == "2"
    assert lines["admission"].startswith("refused by requests: limit 2, 0 left, whole again in")
    assert lines["status"] == "429"

    other = tmp_path / "other.toml"
    other.write_text(
        tenants_toml(
            {"name": "team-a", "requests_per_minute": 5},
            {"name": "team-b", "max_in_flight": 1, "requests_per_minute": 1},
        )
    )
    assert main(["whatif", "--tenants", str(other), "--decisions", str(decisions), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["note"].startswith("open-loop")
    by_tenant = {outcome["tenant"]: outcome for outcome in report["tenants"]}
    assert by_tenant["team-a"] | {"refused": by_tenant["team-a"]["refused"]} == {
        "tenant": "team-a", "requests": 3, "admitted": 3, "refused": {}, "recorded_refused": 1,
        "newly_refused": 0, "newly_admitted": 1, "tokens_estimated": 3,
    }  # fmt: skip
    assert (by_tenant["team-b"]["admitted"], by_tenant["team-b"]["refused"]) == (1, {"requests": 2})
    assert by_tenant["team-b"]["newly_refused"] == 2

    assert main(["whatif", "--tenants", str(other), "--decisions", str(decisions)]) == 0
    text = capsys.readouterr().out
    assert "2 by requests" in text and "open-loop" in text


@pytest.mark.parametrize(
    ("tables", "key", "message"),
    [
        (
            [{"name": "a", "api_keys": ["k"]}, {"name": "b", "api_keys": ["k"]}],
            "tenants[1].api_keys",
            'a key of tenant "b" is also a key of "a"',
        ),
        ([{"name": "a"}], "tenants[0].api_keys", 'tenant "a" has no keys'),
        ([{"name": "a", "api_keys": ["k"]}, {"name": "a", "api_keys": ["j"]}], "tenants[1].name", "is also tenants[0]"),
        (
            [{"name": "a", "api_keys": ["k"], "requests_per_minute": 0}],
            "tenants[0].requests_per_minute",
            "greater than zero",
        ),
        ([{"api_keys": ["k"]}], "tenants[0].name", "must have a name"),
    ],
)
def test_bad_tenants_are_refused_naming_the_key(tmp_path, tables, key, message):
    path = tmp_path / "gateway.toml"
    path.write_text('[[nodes]]\nip = "10.0.0.1"\n' + tenants_toml(*tables))
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert refused.value.key == key and message in refused.value.message


def test_a_gateway_key_in_a_tenant_is_refused(tmp_path):
    path = tmp_path / "gateway.toml"
    gateway_keys = '[gateway]\napi_keys = ["k"]\n[[nodes]]\nip = "10.0.0.1"\n'
    path.write_text(gateway_keys + tenants_toml({"name": "a", "api_keys": ["k"]}))
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert refused.value.message.endswith("is also a key of [gateway]: a key belongs to one tenant")


CHUNKS = [
    b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":" there"}}],"usage":null}\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9}}\n\n',
    b"data: [DONE]\n\n",
]


@given(st.lists(st.integers(min_value=0, max_value=sum(map(len, CHUNKS))), max_size=12), st.booleans())
def test_the_usage_tap_reads_usage_however_the_stream_is_cut(cuts, strip):
    """Pieces cut anywhere: the tap reads the usage, and the client gets every byte but the
    usage event (all of them when it asked for usage)."""
    body = b"".join(CHUNKS)
    points = sorted({0, len(body), *cuts})
    tap = UsageTap(strip=strip)
    out = b"".join(tap.feed(body[start:end]) for start, end in zip(points, points[1:])) + tap.finish()
    assert tap.tokens == 9
    assert out == (body.replace(CHUNKS[2], b"") if strip else body)


def test_check_config_shows_tenants_toml(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(
        '[[nodes]]\nip = "10.0.0.1"\n'
        + tenants_toml({"name": "a", "api_keys": ["k"], "priority": 2, "requests_per_minute": 10, "max_in_flight": 3})
        + "[admission]\nobjectives = { batch = 1 }\n"
    )
    summary = describe_config(load_config(path))
    assert "  a  priority 2  1 keys  10 requests/min, 3 in flight" in summary.splitlines()
    assert "objectives (x-gateway-inference-objective): batch = 1" in summary


async def test_a_client_that_leaves_while_its_worker_waits_for_a_lease_gets_a_record(tmp_path):
    """The leader is stopped (SIGSTOP) while a worker asks it for a lease: the client gives up,
    and once the leader runs again the request's record says the client left before any
    attempt, and the request was not counted as admitted (it took nothing).

    The client sends its request and its end (a half-close) at once, and the leader stays
    stopped until the worker has closed that connection, having seen its client leave: a
    condition, not a duration (the worker had only the 0.3 s between the client's timeout and
    the leader's return). Its one bound is its own: it must see the client leave within the
    lease wait (`LEASE_WAIT_SECONDS`), after which it would admit the request as owed. The other
    waits are for conditions, bounded only against a hang."""
    port, metrics_port = free_port(), free_port()
    decisions = tmp_path / "decisions.jsonl"
    # One request a minute, a lease of one: once the first is served, no worker holds any.
    extra = tenants_toml({"name": "team-a", "api_keys": ["key-a"], "requests_per_minute": 1})
    body = {"model": MODEL, "messages": HI}
    async with serve_nodes(node_specs(1)) as nodes:
        config = write_config(tmp_path, nodes, workers=2, decision_log=str(decisions), extra=extra)
        text = config.read_text().replace('listen = "127.0.0.1:0"', f'listen = "127.0.0.1:{port}"', 1)
        text = text.replace('metrics_listen = "127.0.0.1:0"', f'metrics_listen = "127.0.0.1:{metrics_port}"')
        config.write_text(text)
        async with serve_process(config) as gateway, httpx.AsyncClient(trust_env=False, timeout=60) as http:
            await gateway.wait_for_log("api server listening")
            gateway_url = f"http://127.0.0.1:{port}"
            ready: set[str] = set()
            with trio.fail_after(60):
                while len(ready) < 2:  # both workers route (no request of the tenant is spent on a 503)
                    response = await http.get(gateway_url + "/ready", headers={"connection": "close"})
                    if response.status_code == 200:
                        ready.add(response.headers["x-interlock-worker"])
            url = gateway_url + "/v1/chat/completions"
            headers = {"authorization": "Bearer key-a"}
            assert (await http.post(url, json=body, headers=headers)).status_code == 200
            gateway.process.send_signal(signal.SIGSTOP)
            try:
                sent = msgspec.json.encode(body)
                request = (
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer key-a\r\n"
                    b"X-Request-Id: left\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(sent), sent)
                )
                async with await trio.open_tcp_stream("127.0.0.1", port) as client:
                    await client.send_all(request)
                    await client.send_eof()  # the client leaves
                    with trio.fail_after(60):
                        closed = await client.receive_some()
                assert closed == b""  # the worker closed the connection, unanswered
            finally:
                gateway.process.send_signal(signal.SIGCONT)
            with trio.fail_after(60):
                while not [record for record in decision_records(decisions) if record.request_id == "left"]:
                    await trio.sleep(0.05)
            metrics = (await http.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
    [left] = [record for record in decision_records(decisions) if record.request_id == "left"]
    assert left.status is None and left.attempts == ()
    assert left.admission.tenant == "team-a" and left.admission.refused_by == ""
    assert 'interlock_admission_requests_total{priority="0",tenant="team-a"} 1.0' in metrics

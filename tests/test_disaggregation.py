"""Prefill/decode disaggregation (vLLM's NixlConnector protocol) through the real gateway: a
model whose nodes have the roles `prefill` and `decode` is served in two legs, the prefill with
`max_tokens: 1` and a request for a remote decode, the decode with the client's request plus the
prefill node's `kv_transfer_params`; each leg retried on its own nodes, both in the record."""

from __future__ import annotations

import httpx
import msgspec
import pytest

from events.decisions import AttemptOutcome
from fixtures.node import NodeSpec, serve_nodes, token_texts
from journal.segments import list_segments

from harness import (
    MODEL,
    decision_records,
    error_message,
    nodes_and_gateway,
    running_gateway,
    sse_events,
    tenants_toml,
)
from raw_http import raw_node
from test_openai_sdk import sdk_client

REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
HI = [{"role": "user", "content": "hi"}]


def specs(prefill: int = 1, decode: int = 1) -> list[NodeSpec]:
    """p1, p2, … (role prefill) on 127.0.0.2, …, then d1, d2, … (role decode)."""
    names = [("p", "prefill", i) for i in range(1, prefill + 1)] + [("d", "decode", i) for i in range(1, decode + 1)]
    return [
        NodeSpec(name=f"{letter}{i}", host=f"127.0.0.{index + 2}", models=[MODEL], role=role)
        for index, (letter, role, i) in enumerate(names)
    ]


def roles(nodes) -> dict[str, dict[str, str]]:
    return {node.name: {"role": node.spec.role} for node in nodes}


def chats(node) -> list:
    return [request for request in node.requests if request.method == "POST" and request.path == "/v1/chat/completions"]


async def disaggregated(tmp_path, node_specs, **config):
    """Nodes and a gateway whose [[nodes]] have the specs' roles (and a decision log)."""
    by_name = {spec.name: {"role": spec.role} for spec in node_specs}
    return nodes_and_gateway(
        tmp_path, node_specs, node_settings=by_name, decision_log=str(tmp_path / "decisions.jsonl"), **config
    )


async def records(gateway, tmp_path, count: int):
    path = tmp_path / "decisions.jsonl"
    await gateway.wait_for(lambda: len(decision_records(path)) == count)
    return decision_records(path)


def legs(record) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    return (
        [(attempt.node, attempt.outcome) for attempt in record.prefill_attempts],
        [(attempt.node, attempt.outcome) for attempt in record.attempts],
    )


async def test_a_request_is_prefilled_on_one_node_and_decoded_on_the_other(tmp_path):
    body = {"model": MODEL, "messages": HI, "max_completion_tokens": 50, "temperature": 0.5}
    async with await disaggregated(tmp_path, specs()) as ([p1, d1], gateway):
        await gateway.discovered()
        response = await gateway.http.post(gateway.url + "/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        [record] = await records(gateway, tmp_path, 1)
        metric = await gateway.metric('interlock_disaggregated_attempts_total{leg="prefill",outcome="completed"}')
    assert metric == 1
    assert response.headers["x-interlock-node"] == "d1"
    assert response.json()["choices"][0]["message"]["content"] == "".join(token_texts("d1", 8))
    [prefill] = chats(p1)
    assert prefill.json() == {**body, "stream": False, "max_tokens": 1, "max_completion_tokens": 1,
                              "kv_transfer_params": REMOTE_DECODE}  # fmt: skip
    [decode] = chats(d1)
    assert decode.json() == {**body, "kv_transfer_params": p1._kv_transfer_params()}
    assert legs(record) == ([(p1.host, AttemptOutcome.COMPLETED)], [(d1.host, AttemptOutcome.COMPLETED)])
    assert record.status == 200


async def test_a_streamed_request_streams_the_decode_legs_answer(tmp_path):
    async with await disaggregated(tmp_path, specs()) as ([p1, d1], gateway):
        await gateway.discovered()
        async with sdk_client(gateway) as client:
            stream = await client.chat.completions.create(
                model=MODEL, messages=HI, stream=True, stream_options={"include_usage": True}
            )
            chunks = [chunk async for chunk in stream]
    deltas = [chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices]
    assert "".join(deltas) == "".join(token_texts("d1", 8))
    assert chunks[-1].usage is not None
    [prefill] = chats(p1)
    assert prefill.json()["stream"] is False and "stream_options" not in prefill.json()
    [decode] = chats(d1)
    assert decode.json()["stream"] is True and decode.json()["stream_options"] == {"include_usage": True}
    assert decode.json()["kv_transfer_params"]["remote_host"] == p1.host


async def test_a_prefill_answer_without_kv_transfer_params_is_retried_on_the_next_prefill_node(tmp_path):
    async with await disaggregated(tmp_path, specs(prefill=2)) as ([p1, p2, d1], gateway):
        p1.behaviour.kv_transfer_params = False
        await gateway.discovered()
        for _ in range(2):
            response = await gateway.http.post(gateway.url + "/v1/chat/completions", json={"model": MODEL, "messages": HI})
            assert response.status_code == 200 and response.headers["x-interlock-node"] == "d1"
        found = await records(gateway, tmp_path, 2)
    retried = [record for record in found if record.prefill_attempts[0].node == p1.host]
    assert retried, "round robin starts a leg on p1 once in two requests"
    [attempt, then] = retried[0].prefill_attempts
    assert (attempt.outcome, attempt.status, attempt.error) == (
        AttemptOutcome.RETRIED, 200, "prefill answer without kv_transfer_params"
    )
    assert (then.node, then.outcome) == (p2.host, AttemptOutcome.COMPLETED)
    assert all(request.json()["kv_transfer_params"]["remote_host"] == p2.host for request in chats(d1))


async def test_when_no_prefill_node_gives_kv_transfer_params_the_error_says_so(tmp_path):
    async with await disaggregated(tmp_path, specs()) as ([p1, d1], gateway):
        p1.behaviour.kv_transfer_params = False
        await gateway.discovered()
        response = await gateway.http.post(gateway.url + "/v1/chat/completions", json={"model": MODEL, "messages": HI})
    assert response.status_code == 502
    assert error_message(response) == "prefill answer without kv_transfer_params"
    assert response.json()["error"]["code"] == "prefill_without_kv_transfer_params"
    assert not chats(d1)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_node_that_fails_before_answering_is_replaced_with_the_same_kv_transfer_params(
    tmp_path, stream
):
    async with await disaggregated(tmp_path, specs(decode=2)) as ([p1, d1, d2], gateway):
        await gateway.discovered()
        d1.behaviour.refuse = True  # round robin's first pick of the decode leg
        body = {"model": MODEL, "messages": HI, "stream": stream}
        response = await gateway.http.post(gateway.url + "/v1/chat/completions", json=body)
        assert response.status_code == 200 and response.headers["x-interlock-node"] == "d2"
        [record] = await records(gateway, tmp_path, 1)
    if stream:
        assert sse_events(response.text)[-1] == "[DONE]"
    assert legs(record) == (
        [(p1.host, AttemptOutcome.COMPLETED)],
        [(d1.host, AttemptOutcome.RETRIED), (d2.host, AttemptOutcome.COMPLETED)],
    )
    [prefill] = chats(p1)  # one prefill: the decode retry reuses its KV blocks
    [decode] = chats(d2)
    assert decode.json()["kv_transfer_params"] == p1._kv_transfer_params()


async def test_a_decode_node_refuses_a_request_that_was_not_prefilled(tmp_path):
    async with nodes_and_gateway(tmp_path, specs(prefill=0)) as ([d1], _):
        async with httpx.AsyncClient(trust_env=False) as http:
            response = await http.post(d1.url + "/v1/chat/completions", json={"model": MODEL, "messages": HI})
    assert response.status_code == 400 and "kv_transfer_params" in response.json()["message"]


async def test_other_endpoints_of_a_disaggregated_model_go_whole_to_one_node(tmp_path):
    async with await disaggregated(tmp_path, specs()) as ([p1, d1], gateway):
        await gateway.discovered()
        response = await gateway.http.post(gateway.url + "/tokenize", json={"model": MODEL, "prompt": "a b"})
        assert response.status_code == 200 and response.json()["count"] == 2
        [record] = await records(gateway, tmp_path, 1)
    assert record.prefill_attempts == () and len(record.attempts) == 1


def test_prefill_and_decode_bodies_keep_every_other_member_as_sent():
    from dataplane.disaggregation import decode_body, prefill_body

    sent = b'{"model":"m","temperature":0.70,"stream":true,"stream_options":{"include_usage":true}}'
    assert prefill_body(sent) == (
        b'{"model":"m","temperature":0.70,"stream":false,"max_tokens":1,"kv_transfer_params":'
        + msgspec.json.encode(REMOTE_DECODE) + b"}"
    )
    assert decode_body(sent, msgspec.Raw(b'{"a":1}')) == sent[:-1] + b',"kv_transfer_params":{"a":1}}'


async def test_round_robin_takes_turns_within_each_leg(tmp_path):
    async with await disaggregated(tmp_path, specs(prefill=1, decode=2)) as ([p1, d1, d2], gateway):
        await gateway.discovered()
        for _ in range(4):
            response = await gateway.http.post(gateway.url + "/v1/chat/completions", json={"model": MODEL, "messages": HI})
            assert response.status_code == 200
    assert (len(chats(p1)), len(chats(d1)), len(chats(d2))) == (4, 2, 2)


async def test_explain_shows_both_legs(tmp_path):
    from interlock.explain_request import render_request

    async with await disaggregated(tmp_path, specs(prefill=2)) as ([p1, p2, d1], gateway):
        p1.behaviour.kv_transfer_params = False
        await gateway.discovered()
        response = await gateway.http.post(
            gateway.url + "/v1/chat/completions", json={"model": MODEL, "messages": HI}, headers={"x-request-id": "pd"}
        )
        assert response.status_code == 200
        [record] = await records(gateway, tmp_path, 1)
    text = render_request(record)
    prefill_heading, decode_heading = text.index("PREFILL"), text.index("DECODE")
    assert prefill_heading < text.index("prefill answer without kv_transfer_params") < decode_heading
    assert text.index(p2.host) < decode_heading < text.rindex(d1.host)


async def test_verify_and_whatif_make_each_legs_pick_again(tmp_path):
    """Both legs' first picks are in the record, each made again from its own leg's candidates
    (a whole request's would be made from every candidate, and differ); an edited prefill pick
    is named as the prefill leg's."""
    from events.decisions import read_decisions_with_gaps
    from interlock.verify import verify
    from interlock.whatif import RECORDED, what_if

    events = tmp_path / "events.jsonl"
    async with await disaggregated(
        tmp_path, specs(prefill=2, decode=2), event_log=str(events), routing={"policy": "least_load"}
    ) as ([p1, p2, d1, d2], gateway):
        p1.behaviour.kv_transfer_params = False  # a prefill retried on p2
        await gateway.discovered()
        for number in range(4):
            body = {"model": MODEL, "messages": HI, "stream": number % 2 == 1}
            response = await gateway.http.post(gateway.url + "/v1/chat/completions", json=body)
            assert response.status_code == 200
        found = await records(gateway, tmp_path, 4)
    assert all(record.prefill_pick is not None and record.candidates for record in found)
    assert {record.prefill_pick.candidates[0].node for record in found} <= {p1.host, p2.host}
    assert {record.candidates[0].node for record in found} <= {d1.host, d2.host}
    decisions = tmp_path / "decisions.jsonl"
    report = verify([events], read_decisions_with_gaps([decisions]))
    assert (report.verified, report.divergent, report.incomplete) == (4, 0, 0), report.divergences
    whatif = what_if([events], [decision for decision, _ in read_decisions_with_gaps([decisions])], policy=RECORDED)
    assert (whatif.routed_again, whatif.changed) == (8, 0)  # two picks a request, each as recorded

    [segment] = list_segments(decisions)
    lines = segment.read_text().splitlines()
    record = msgspec.json.decode(lines[0])
    first, second = record["prefill_pick"]["candidates"][:2]
    record["prefill_pick"]["candidates"][:2] = [second, first]
    lines[0] = msgspec.json.encode(record).decode()
    edited = tmp_path / "edited.jsonl"
    edited.write_text("\n".join(lines) + "\n")
    report = verify([events], read_decisions_with_gaps([edited]))
    assert report.divergent == 1
    assert {divergence.field for divergence in report.divergences} == {
        "prefill.candidates", "prefill.pick", "prefill.attempts[0].node"  # not sent to the (edited) pick
    }  # fmt: skip

    record = msgspec.json.decode(lines[1])
    record["prefill_attempts"][-1]["node"] = d1.host  # a prefill sent to a decode node
    lines[1] = msgspec.json.encode(record).decode()
    edited.write_text("\n".join(lines) + "\n")
    report = verify([events], read_decisions_with_gaps([edited]))
    assert report.divergent == 2
    leg = len(record["prefill_attempts"]) - 1
    assert (record["request_id"], f"prefill.attempts[{leg}].node") in {
        (divergence.request_id, divergence.field) for divergence in report.divergences
    }



async def test_a_prefill_answer_that_breaks_its_parser_is_a_failed_leg_and_the_tenant_gets_its_place_back(tmp_path):
    # p1 answers every prefill with kv_transfer_params nested 400,000 deep (under the answer's
    # 1 MiB cap): deeper than msgspec decodes. That is a failure of p1's attempt, retried
    # on p2 like any prefill failure; the request is answered, recorded, and gives its tenant's
    # one in-flight place back, so the tenant's next request is not refused.
    depth = 400_000
    nested = b'{"kv_transfer_params":' + b"[" * depth + b"]" * depth + b"}"
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(nested),
        nested,
    )
    tenant = {"name": "team", "api_keys": ["key-team"], "max_in_flight": 1}
    decisions = tmp_path / "decisions.jsonl"
    async with (
        raw_node(answer, models=[MODEL], host="127.0.0.2", name="p1") as p1,
        serve_nodes(specs(prefill=2)[1:]) as sims,
    ):
        p2, d1 = sims
        settings = {"p1": {"role": "prefill"}, "p2": {"role": "prefill"}, "d1": {"role": "decode"}}
        async with running_gateway(
            tmp_path, [p1, p2, d1], node_settings=settings, extra=tenants_toml(tenant), decision_log=str(decisions)
        ) as gateway:
            await gateway.discovered()
            headers = {"Authorization": "Bearer key-team"}
            for number in range(3):
                response = await gateway.http.post(
                    gateway.url + "/v1/chat/completions",
                    json={"model": MODEL, "messages": HI},
                    headers=headers | {"X-Request-Id": f"r{number}"},
                )
                assert response.status_code == 200, response.text
                assert response.headers["x-interlock-node"] == "d1"
            assert p1.completions  # round robin tried it
            for node in (p1, p2, d1):
                assert not await gateway.metric(f'interlock_node_requests_in_flight{{node="{node.host}"}}')
            found = await records(gateway, tmp_path, 3)
    broken = [record for record in found if record.prefill_attempts[0].node == p1.host]
    assert broken
    for record in broken:
        first, then = record.prefill_attempts
        assert (first.outcome, then.node, then.outcome) == (AttemptOutcome.RETRIED, p2.host, AttemptOutcome.COMPLETED)
        assert first.error == "prefill answer nested too deep to decode"
        assert record.status == 200 and record.admission.tenant == "team"

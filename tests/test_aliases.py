"""Aliases (`[[models.available]] name = "chat", target = "…"`): a request naming the alias is
routed to the nodes that list its target, forwarded with the body's `model` rewritten and every
other byte kept; `/v1/models` lists the alias; its decision record names both."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from controlplane.infrastructure.config import ConfigError, load_config
from events.decisions import Decision
from fixtures.node import NodeSpec, read_form

from harness import MODEL, config_text, decision_records, nodes_and_gateway
from test_openai_sdk import sdk_client

TARGET = "Qwen/Qwen2.5-7B-Instruct"


def specs() -> list[NodeSpec]:
    """n1 serves the target; n2 serves only the test model."""
    return [
        NodeSpec(name="n1", host="127.0.0.2", models=[TARGET]),
        NodeSpec(name="n2", host="127.0.0.3", models=[MODEL]),
    ]


def posts(node, path: str) -> list:
    return [request for request in node.requests if request.method == "POST" and request.path == path]


async def test_an_alias_goes_to_the_targets_node_with_only_its_model_rewritten(tmp_path):
    sent = b'{"messages": [{"role": "user", "content": "hi"}],  "model": "chat", "temperature": 0.70, "n": 1e0}'
    decisions = tmp_path / "decisions.jsonl"
    config = {"models": ((MODEL, ""), (TARGET, "")), "aliases": {"chat": TARGET}, "decision_log": str(decisions)}
    async with nodes_and_gateway(tmp_path, specs(), **config) as ([n1, n2], gateway):
        await gateway.discovered()
        for _ in range(2):
            response = await gateway.http.post(
                gateway.url + "/v1/chat/completions", content=sent, headers={"x-request-id": "aliased"}
            )
            assert response.status_code == 200, response.text
            assert response.headers["x-interlock-node"] == "n1"
        listed = (await gateway.http.get(gateway.url + "/v1/models")).json()
        await gateway.wait_for(lambda: len(decision_records(decisions)) == 2)
    received = posts(n1, "/v1/chat/completions")[0].body
    members = _members(received)
    assert members.pop("model") == b'"' + TARGET.encode() + b'"'
    original = _members(sent)
    original.pop("model")
    assert members == original  # each member's exact bytes: `0.70` and `1e0` stay as sent
    assert not posts(n2, "/v1/chat/completions")
    assert [model["id"] for model in listed["data"]] == [MODEL, TARGET, "chat"]
    records = decision_records(decisions)
    assert [(record.model, record.alias) for record in records] == [(TARGET, "chat")] * 2


def _members(body: bytes) -> dict[str, bytes]:
    """A JSON object's members, each as its exact bytes."""
    return {name: bytes(raw) for name, raw in msgspec.json.decode(body, type=dict[str, msgspec.Raw]).items()}


async def test_the_sdk_can_use_an_alias_and_a_form_gets_its_model_field_rewritten(tmp_path):
    config = {"models": ((MODEL, ""), (TARGET, "")), "aliases": {"chat": TARGET, "ears": TARGET}}
    async with nodes_and_gateway(tmp_path, specs(), **config) as ([n1, _], gateway):
        await gateway.discovered()
        async with sdk_client(gateway) as client:
            completion = await client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}])
            transcription = await client.audio.transcriptions.create(model="ears", file=("a.wav", b"RIFF\x00", "audio/wav"))
    assert completion.model == TARGET and completion.choices[0].message.content.startswith("Hello from n1.")
    assert transcription.text == "Heard 5 bytes on n1."
    [form] = posts(n1, "/v1/audio/transcriptions")
    assert read_form(form.header("content-type").encode(), form.body)["model"] == TARGET


async def test_the_default_model_may_be_an_alias(tmp_path):
    config = {"models": ((MODEL, ""), (TARGET, "")), "aliases": {"chat": TARGET}, "default": "chat"}
    async with nodes_and_gateway(tmp_path, specs(), **config) as ([n1, _], gateway):
        await gateway.discovered()
        response = await gateway.http.post(gateway.url + "/v1/completions", json={"prompt": "x"})
    assert response.status_code == 200 and response.headers["x-interlock-node"] == "n1"
    assert posts(n1, "/v1/completions")[0].json() == {"prompt": "x", "model": TARGET}


def test_records_from_before_aliases_load():
    old = msgspec.json.encode(
        {"request_id": "r", "at": 1.0, "path": "/v1/completions", "model": "m", "stream": False, "seq": 3,
         "ring": "", "ring_pool": [], "excluded": [], "attempts": [], "status": 200, "duration": 0.1}  # fmt: skip
    )
    assert msgspec.json.decode(old, type=Decision).alias == ""


@pytest.mark.parametrize(
    "entry, key, message",
    [
        ('name = "chat"\ntarget = "chat"', "models.available[1].target", 'model "chat" is an alias of itself'),
        ('name = "chat"\ntarget = "other"\n[[models.available]]\nname = "other"\ntarget = "m"',
         "models.available[1].target", 'alias "chat" targets "other", which is an alias itself'),  # fmt: skip
        ('name = "chat"\ntarget = "m"\nring = "r"', "models.available[1].ring", 'set ring on the target'),
        ('name = "chat"\ntarget = "m"\npolicy = "least_load"', "models.available[1].policy", "set policy on"),
    ],
)
def test_an_alias_that_cannot_be_routed_is_refused_naming_its_key(tmp_path: Path, entry, key, message):
    path = tmp_path / "gateway.toml"
    path.write_text(
        '[[nodes]]\nip = "10.0.0.1"\n[[nodes]]\nip = "10.0.0.2"\nring = "r"\n'
        f'[[models.available]]\nname = "m"\n[[models.available]]\n{entry}\n'
    )
    with pytest.raises(ConfigError) as caught:
        load_config(str(path))
    assert caught.value.key == key and message in str(caught.value)


def test_config_text_writes_aliases():
    assert 'target = "t"' in config_text([], aliases={"a": "t"})

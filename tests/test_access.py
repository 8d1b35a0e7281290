"""Access: client API keys on the API listener, upstream keys for nodes started with vLLM's
`--api-key`, and what /health shows. Through the real server (hypercorn, in front of simulated
nodes) and the real CLI; the secrets are checked absent from every log, record and metric."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import trio

from controlplane.infrastructure.config import ConfigError, load_config
from controlplane.effects.replay import replay
from events.decisions import read_decisions
from events.log import read_events
from fixtures.node import NodeSpec, serve_nodes
from interlock.describe import describe_config

from harness import (
    MODEL,
    PROJECT_ROOT,
    chat,
    completions_to,
    config_text,
    free_port,
    node_processes,
    node_specs,
    nodes_and_gateway,
    running_gateway,
)

CHAT = "/v1/chat/completions"
CLIENT_KEY = "sk-client-0123456789"
OTHER_CLIENT_KEY = "sk-client-rotated-42"
UPSTREAM_KEY = "vllm-upstream-secret-7"
NODE_KEY = "vllm-node-own-secret-9"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def written(folder: Path, log: str) -> str:
    """The text of every segment of the log `folder/<log>.jsonl`."""
    return "".join(path.read_text() for path in sorted(folder.glob(f"{log}.*.jsonl")))


def assert_no_secret(text: str, *secrets: str) -> None:
    for secret in secrets:
        assert secret not in text


# --- the loader -------------------------------------------------------------------------------

NODE = '[[nodes]]\nip = "10.0.0.1"\n'


def write(tmp_path: Path, gateway: str, nodes: str = NODE) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(f"[gateway]\n{gateway}\n{nodes}")
    return path


def test_inline_keys_are_kept_as_digests_only(tmp_path):
    hashes_file = tmp_path / "hashes"
    hashes_file.write_text(f"# ops team\n{digest('from-file').upper()}\n\n{digest(CLIENT_KEY)}  # again\n")
    path = write(
        tmp_path,
        f'API_Keys = ["{CLIENT_KEY}"]\napi_key_hashes = ["{digest("inline-hash")}"]\napi_key_file = "{hashes_file}"',
    )
    config = load_config(path, warn=lambda unknown: pytest.fail(str(unknown)))
    assert config.gateway.api_key_hashes == (digest(CLIENT_KEY), digest("inline-hash"), digest("from-file"))
    assert_no_secret(msgspec.json.encode(config).decode(), CLIENT_KEY)
    assert "client API keys: 3 accepted; a request without one gets 401; /health stays open" in describe_config(config)


def test_check_config_counts_the_tenants_keys_as_required_client_keys(tmp_path):
    path = write(tmp_path, "")
    path.write_text(path.read_text() + f'[[tenants]]\nname = "team-a"\napi_keys = ["{CLIENT_KEY}", "other"]\n')
    described = describe_config(load_config(path))
    assert "client API keys: 2 accepted (2 of them tenants'); a request without one gets 401; /health stays open" in described
    assert "every client is served" not in described


@pytest.mark.parametrize(
    ("gateway", "key", "message"),
    [
        ('api_keys = "one"', "gateway.api_keys", "api_keys must be an array of strings"),
        ('api_keys = ["a", ""]', "gateway.api_keys[1]", "an API key must not be empty"),
        ('api_key_hashes = ["abc"]', "gateway.api_key_hashes[0]", "not a SHA-256 hex digest"),
        ('api_key_file = "/nonexistent/hashes"', "gateway.api_key_file", "reading api_key_file: [Errno 2]"),
        ('upstream_api_key_file = "/nonexistent/key"', "gateway.upstream_api_key_file", "reading key file"),
        ("health_hides_errors = 1", "gateway.health_hides_errors", "Expected `bool`, got `int`"),
    ],
)
def test_bad_access_settings_name_file_and_key(tmp_path, gateway, key, message):
    path = write(tmp_path, gateway)
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert raised.value.path == str(path)
    assert raised.value.key == key
    assert message in raised.value.message


@pytest.mark.parametrize("key", ["api_key_file", "upstream_api_key_file"])
def test_a_key_file_that_is_a_fifo_is_refused_at_once(tmp_path, key):
    """Opened to be read, a FIFO without a writer would wait for ever: check-config hung."""
    fifo = tmp_path / "keys.fifo"
    os.mkfifo(fifo)
    path = write(tmp_path, f'{key} = "{fifo}"')
    command = [sys.executable, "-m", "interlock.cli", "check-config", str(path)]
    checked = subprocess.run(command, capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=60, check=False)
    assert checked.returncode != 0
    assert f"gateway.{key}" in checked.stderr and f"reading {fifo}: not a regular file" in checked.stderr


def test_key_files_are_checked_with_line_and_without_echoing_the_key(tmp_path):
    hashes_file = tmp_path / "hashes"
    hashes_file.write_text(f"{digest('a')}\n{CLIENT_KEY}\n")
    with pytest.raises(ConfigError) as raised:
        load_config(write(tmp_path, f'api_key_file = "{hashes_file}"'))
    assert f"{hashes_file}:2: not a SHA-256 hex digest" in str(raised.value)
    assert_no_secret(str(raised.value), CLIENT_KEY)

    key_file = tmp_path / "node-key"
    key_file.write_text("two words\n")
    with pytest.raises(ConfigError) as raised:
        load_config(write(tmp_path, "", NODE + f'api_key_file = "{key_file}"\n'))
    assert raised.value.key == "nodes[0].api_key_file"
    assert "printable ASCII without spaces" in raised.value.message
    key_file.write_text("  \n")
    with pytest.raises(ConfigError, match="is empty"):
        load_config(write(tmp_path, "", NODE + f'api_key_file = "{key_file}"\n'))


# --- client keys, through the real server ---------------------------------------------------


async def test_client_keys_guard_every_route_but_an_open_health(tmp_path):
    decisions = tmp_path / "decisions.jsonl"
    events = tmp_path / "events.jsonl"
    async with nodes_and_gateway(
        tmp_path, node_specs(1), api_keys=[CLIENT_KEY], decision_log=str(decisions), event_log=str(events)
    ) as (nodes, gateway):
        await gateway.discovered()
        http = gateway.http
        wrong = ({}, bearer("sk-wrong"), {"Authorization": CLIENT_KEY}, {"Authorization": f"Basic {CLIENT_KEY}"})
        for headers in wrong:
            for response in (
                await http.post(gateway.url + CHAT, json=chat(), headers=headers),
                await http.post(gateway.url + CHAT, json=chat(stream=True), headers=headers),
                await http.get(gateway.url + "/v1/models", headers=headers),
                await http.get(gateway.url + f"/v1/models/{MODEL}", headers=headers),
                await http.get(gateway.url + "/nowhere", headers=headers),
            ):
                assert response.status_code == 401
                error = response.json()["error"]
                assert error["type"] == "invalid_request_error"
                assert error["code"] == "invalid_api_key"
                assert response.headers["www-authenticate"] == "Bearer"
        assert (await http.get(gateway.url + "/health")).status_code == 200
        assert completions_to(nodes[0]) == []

        answer = await http.post(gateway.url + CHAT, json=chat(), headers=bearer(CLIENT_KEY))
        assert answer.status_code == 200
        await gateway.wait_for(lambda: answer.headers["x-request-id"] in written(tmp_path, "decisions"))
        lowercase = await http.post(gateway.url + CHAT, json=chat(), headers={"Authorization": f"bearer {CLIENT_KEY}"})
        assert lowercase.status_code == 200
        assert (await http.get(gateway.url + "/v1/models", headers=bearer(CLIENT_KEY))).json()["data"][0]["id"] == MODEL
        assert (await http.get(gateway.url + f"/v1/models/{MODEL}", headers=bearer(CLIENT_KEY))).json()["id"] == MODEL
        assert [request.header("authorization") for request in completions_to(nodes[0])] == [None, None]
        metrics = await gateway.metrics()
    assert_no_secret("\n".join(gateway.log.lines()), CLIENT_KEY, "sk-wrong")
    assert_no_secret(metrics, CLIENT_KEY, "sk-wrong")
    assert_no_secret(written(tmp_path, "decisions"), CLIENT_KEY)
    recorded = written(tmp_path, "events")
    assert digest(CLIENT_KEY) in recorded
    assert_no_secret(recorded, CLIENT_KEY)
    assert replay([str(events)]).transitions  # the recorded config (digests only) replays


async def test_the_openai_sdk_sends_its_api_key_and_raises_authentication_error(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1), api_keys=[CLIENT_KEY]) as (nodes, gateway):
        await gateway.discovered()
        for key in (CLIENT_KEY, "sk-wrong"):
            async with openai.AsyncOpenAI(
                base_url=gateway.url + "/v1",
                api_key=key,
                max_retries=2,
                http_client=openai.DefaultAsyncHttpxClient(trust_env=False),
            ) as client:
                if key == CLIENT_KEY:
                    completion = await client.chat.completions.create(model=MODEL, messages=chat()["messages"])
                    assert completion.model == MODEL
                    assert [model.id async for model in client.models.list()] == [MODEL]
                else:
                    with pytest.raises(openai.AuthenticationError) as raised:
                        await client.chat.completions.create(model=MODEL, messages=chat()["messages"])
                    assert raised.value.code == "invalid_api_key"
        assert len(completions_to(nodes[0])) == 1


async def test_health_can_require_a_key_and_hide_error_texts(tmp_path):
    specs = node_specs(1, models="error")
    async with nodes_and_gateway(
        tmp_path, specs, api_keys=[CLIENT_KEY], health_requires_api_key=True, health_hides_errors=True
    ) as (_, gateway):
        await gateway.wait_for(lambda: gateway.node(specs[0].host).models.last_error)
        assert (await gateway.http.get(gateway.url + "/health")).status_code == 401
        health = (await gateway.http.get(gateway.url + "/health", headers=bearer(CLIENT_KEY))).json()
        assert health["details"][0]["models"]["last_error"] == "(hidden: gateway.health_hides_errors)"
        assert gateway.node(specs[0].host).models.last_error == "models endpoint returned status 500"


async def test_a_reload_replaces_the_accepted_keys(tmp_path):
    hashes = tmp_path / "hashes"
    hashes.write_text(digest(CLIENT_KEY) + "\n")
    async with nodes_and_gateway(tmp_path, node_specs(1), api_key_file=str(hashes)) as (_, gateway):
        await gateway.discovered()
        assert (await gateway.http.post(gateway.url + CHAT, json=chat(), headers=bearer(CLIENT_KEY))).status_code == 200
        hashes.write_text(digest(OTHER_CLIENT_KEY) + "\n")
        assert await gateway.control_plane.reload()
        assert (await gateway.http.post(gateway.url + CHAT, json=chat(), headers=bearer(CLIENT_KEY))).status_code == 401
        rotated = await gateway.http.post(gateway.url + CHAT, json=chat(), headers=bearer(OTHER_CLIENT_KEY))
        assert rotated.status_code == 200


# --- upstream keys ------------------------------------------------------------------------------


async def test_protected_nodes_are_discovered_and_routed_with_their_keys(tmp_path):
    cluster_key = tmp_path / "upstream-key"
    cluster_key.write_text(UPSTREAM_KEY + "\n")
    own_key = tmp_path / "node-key"
    own_key.write_text(NODE_KEY)
    specs = [
        NodeSpec(name="n1", host="127.0.0.2", models=[MODEL], api_key=UPSTREAM_KEY),
        NodeSpec(name="n2", host="127.0.0.3", models=[MODEL], api_key=NODE_KEY),
    ]
    events = tmp_path / "events.jsonl"
    async with serve_nodes(specs) as nodes:
        # Without the keys, the nodes refuse the model listing, as vLLM with --api-key does.
        async with running_gateway(tmp_path, nodes) as gateway:
            await gateway.wait_for(lambda: all(node.models.last_error for node in gateway.nodes()))
            assert {node.models.last_error for node in gateway.nodes()} == {"models endpoint returned status 401"}
        before = [len(node.requests) for node in nodes]

        keys = {"upstream_api_key_file": str(cluster_key), "node_settings": {"n2": {"api_key_file": str(own_key)}}}
        async with running_gateway(tmp_path, nodes, event_log=str(events), **keys) as gateway:
            await gateway.discovered()
            assert {node.models.names for node in gateway.nodes()} == {(MODEL,)}
            for _ in range(4):
                response = await gateway.http.post(gateway.url + CHAT, json=chat(), headers=bearer(CLIENT_KEY))
                assert response.status_code == 200
            stream = await gateway.http.post(gateway.url + CHAT, json=chat(stream=True), headers=bearer(CLIENT_KEY))
            assert stream.status_code == 200
            assert "[DONE]" in stream.text
            log = "\n".join(gateway.log.lines()) + await gateway.metrics()
    for node, key, first in zip(nodes, (UPSTREAM_KEY, NODE_KEY), before, strict=True):
        guarded = [request for request in list(node.requests)[first:] if request.path.startswith("/v1/")]
        assert {request.path for request in guarded} == {"/v1/models", CHAT}
        assert {request.header("authorization") for request in guarded} == {f"Bearer {key}"}
    recorded = written(tmp_path, "events")
    assert str(cluster_key) in recorded
    assert_no_secret(recorded + log, UPSTREAM_KEY, NODE_KEY)


async def test_a_reload_reads_a_rotated_upstream_key(tmp_path):
    key_file = tmp_path / "upstream-key"
    key_file.write_text(UPSTREAM_KEY)
    specs = [NodeSpec(name="n1", host="127.0.0.2", models=[MODEL], api_key=UPSTREAM_KEY)]
    async with nodes_and_gateway(tmp_path, specs, upstream_api_key_file=str(key_file)) as ([node], gateway):
        await gateway.discovered()
        assert (await gateway.http.post(gateway.url + CHAT, json=chat())).status_code == 200
        node.spec.api_key = NODE_KEY  # the node restarted with a new key
        assert (await gateway.http.post(gateway.url + CHAT, json=chat())).status_code == 401
        key_file.write_text(NODE_KEY)
        assert await gateway.control_plane.reload()
        assert (await gateway.http.post(gateway.url + CHAT, json=chat())).status_code == 200
        assert completions_to(node)[-1].header("authorization") == f"Bearer {NODE_KEY}"


async def test_upstream_keys_are_read_when_a_config_is_taken_up_never_on_a_request(tmp_path):
    """The gateway reads an upstream key file when it takes up a config (start, SIGHUP), not
    when a request first needs the key: removed after a reload, the file is not missed; a
    reload while it is missing is rejected (the key in force stays), and a rotated key is sent
    only once a reload has read it."""
    key_file = tmp_path / "upstream-key"
    key_file.write_text(UPSTREAM_KEY)
    specs = [NodeSpec(name="n1", host="127.0.0.2", models=[MODEL], api_key=UPSTREAM_KEY)]
    async with nodes_and_gateway(tmp_path, specs, upstream_api_key_file=str(key_file)) as ([node], gateway):
        await gateway.discovered()
        assert await gateway.control_plane.reload()
        key_file.unlink()  # before any request under the reloaded config
        assert (await gateway.http.post(gateway.url + CHAT, json=chat())).status_code == 200
        assert completions_to(node)[-1].header("authorization") == f"Bearer {UPSTREAM_KEY}"

        assert not await gateway.control_plane.reload()
        [rejected] = [line for line in gateway.log.lines() if "config reload failed" in line]
        assert "gateway.upstream_api_key_file" in rejected and str(key_file) in rejected
        assert (await gateway.http.post(gateway.url + CHAT, json=chat())).status_code == 200

        key_file.write_text(NODE_KEY)
        node.spec.api_key = NODE_KEY  # the node restarted with the rotated key
        assert (await gateway.http.post(gateway.url + CHAT, json=chat())).status_code == 401
        assert await gateway.control_plane.reload()
        assert (await gateway.http.post(gateway.url + CHAT, json=chat())).status_code == 200
        assert completions_to(node)[-1].header("authorization") == f"Bearer {NODE_KEY}"


# --- the real CLI, with workers -----------------------------------------------------------------


async def test_serve_with_workers_checks_client_keys_and_sends_upstream_keys(tmp_path):
    """`interlock serve --workers 2` in front of nodes started with `--api-key`: each worker gets
    the key digests and the upstream key file through the leader's events, and a SIGHUP that
    rotates the client keys reaches both; no key is in the output, the event log or the decisions."""
    hashes, upstream_key = tmp_path / "hashes", tmp_path / "upstream-key"
    hashes.write_text(digest(CLIENT_KEY) + "\n")
    upstream_key.write_text(UPSTREAM_KEY)
    events, decisions, output = tmp_path / "events.jsonl", tmp_path / "decisions.jsonl", tmp_path / "gateway.log"
    port = free_port()
    async with node_processes(2, "--api-key", UPSTREAM_KEY) as nodes:
        config = config_text(
            nodes,
            health_interval="0.2s",
            api_key_file=str(hashes),
            upstream_api_key_file=str(upstream_key),
            event_log=str(events),
            decision_log=str(decisions),
        ).replace('listen = "127.0.0.1:0"', f'listen = "127.0.0.1:{port}"', 1)
        (tmp_path / "gateway.toml").write_text(config)
        url = f"http://127.0.0.1:{port}"
        with output.open("wb") as log:
            gateway = await trio.lowlevel.open_process(
                [sys.executable, "-m", "interlock.cli", "serve", "--config", str(tmp_path / "gateway.toml"),
                 "--workers", "2"],
                cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
                await answered_by_every_worker(http, url, decisions, CLIENT_KEY)
                refused = await http.post(url + CHAT, json=chat())
                assert refused.status_code == 401
                assert refused.json()["error"]["code"] == "invalid_api_key"

                hashes.write_text(digest(OTHER_CLIENT_KEY) + "\n")
                gateway.send_signal(signal.SIGHUP)
                await answered_by_every_worker(http, url, decisions, OTHER_CLIENT_KEY)
                for _ in range(10):
                    headers = {**bearer(CLIENT_KEY), "Connection": "close"}
                    assert (await http.post(url + CHAT, json=chat(), headers=headers)).status_code == 401
                # Each worker took up the reloaded config (it answered the rotated client key) and
                # read the upstream key then: its requests do not read the file.
                upstream_key.unlink()
                for _ in range(10):
                    headers = {**bearer(OTHER_CLIENT_KEY), "Connection": "close"}
                    assert (await http.post(url + CHAT, json=chat(), headers=headers)).status_code == 200
        finally:
            gateway.send_signal(signal.SIGTERM)
            with trio.move_on_after(20):
                await gateway.wait()
            if gateway.returncode is None:
                gateway.kill()
                await gateway.wait()
    assert gateway.returncode == 0, output.read_text()
    everything = output.read_text() + written(tmp_path, "events") + written(tmp_path, "decisions")
    assert_no_secret(everything, CLIENT_KEY, OTHER_CLIENT_KEY, UPSTREAM_KEY)
    assert [event.config.gateway.api_key_hashes for event in read_events([events]) if hasattr(event, "config")] == [
        (digest(CLIENT_KEY),),
        (digest(OTHER_CLIENT_KEY),),
    ]
    replayed = await trio.run_process(
        [sys.executable, "-m", "interlock.cli", "replay", str(events)],
        cwd=PROJECT_ROOT,
        capture_stdout=True,
        check=False,
    )
    assert replayed.returncode == 0
    assert replayed.stdout


async def answered_by_every_worker(http: httpx.AsyncClient, url: str, decisions: Path, key: str) -> None:
    """Send requests with `key` on new connections until each of the two workers has answered
    one with 200 (recorded in the decision log); any other answer but a 401 or a 503 while the
    gateway starts or reloads fails."""
    answered: set[int] = set()
    with trio.fail_after(30):
        while answered != {1, 2}:
            request_id = os.urandom(8).hex()
            headers = {**bearer(key), "Connection": "close", "X-Request-Id": request_id}
            try:
                response = await http.post(url + CHAT, json=chat(), headers=headers)
            except httpx.ConnectError:
                await trio.sleep(0.1)
                continue
            assert response.status_code in (200, 401, 503), response.text
            if response.status_code != 200:
                await trio.sleep(0.05)
                continue
            while True:
                records = list(read_decisions(decisions)) if written(decisions.parent, "decisions") else []
                found = [record for record in records if record.request_id == request_id]
                if found:
                    answered.add(found[0].worker)
                    break
                await trio.sleep(0.05)


def test_a_log_recorded_before_the_access_keys_existed_replays_the_same(tmp_path):
    """The scenario with every access key taken out of its configs, as an older gateway wrote it."""
    scenario = PROJECT_ROOT / "fixtures" / "logs" / "scenario.jsonl"
    access_keys = (
        "api_key_hashes", "api_key_file", "health_requires_api_key", "health_hides_errors", "upstream_api_key_file"
    )  # fmt: skip
    older = tmp_path / "older.jsonl"
    lines = []
    for line in scenario.read_bytes().splitlines():
        event = msgspec.json.decode(line)
        if "config" in event:
            for key in access_keys:
                del event["config"]["gateway"][key]
            for node in event["config"]["nodes"]:
                del node["api_key_file"]
        lines.append(msgspec.json.encode(event))
    older.write_bytes(b"\n".join(lines) + b"\n")
    assert b"api_key" not in older.read_bytes()
    assert replay([older]).transitions == replay([scenario]).transitions

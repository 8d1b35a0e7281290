"""HTTPS on the API listener (`[gateway] tls_certificate`, `tls_key`): the OpenAI SDK through it
with the CA that signed the certificate, workers included; the metrics listener stays plain
HTTP. Nodes reached over HTTPS (`[[nodes]] scheme = "https"`, `ca_file`, `client_certificate`,
`client_key`): probes, discovery, completions and streams through a simulated node serving
HTTPS, and a node whose certificate is not trusted (or that wants a client certificate it does
not get) is unhealthy with the TLS failure as its error. Certificates are made in the test
(trustme). Config mistakes name the key and the file."""

from __future__ import annotations

import os
import ssl

import httpx
import openai
import pytest
import trustme

from controlplane.infrastructure.config import ConfigError, load_config
from controlplane.infrastructure.tlsfiles import MAX_TLS_FILE_BYTES
from events.state import Discovery
from fixtures.node import serve_nodes, token_texts

from harness import MODEL, chat, config_text, free_port, node_specs, running_gateway, sse_events, wait_until_ready
from test_cli_serve import interlock_serve

HI = [{"role": "user", "content": "hi"}]
QUICK_DEATH = {"health_interval": "50ms", "health_fail_threshold": 1}


def issued(tmp_path, authority: trustme.CA, name: str, host: str) -> tuple[str, str]:
    """A certificate for `host` signed by `authority`, and its key: two PEM paths named `name`."""
    issued_cert = authority.issue_cert(host)
    certificate, key = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
    issued_cert.private_key_pem.write_to_path(str(key))
    for index, blob in enumerate(issued_cert.cert_chain_pems):
        blob.write_to_path(str(certificate), append=index > 0)
    return str(certificate), str(key)


def ca_file(tmp_path, authority: trustme.CA, name: str) -> str:
    path = tmp_path / f"{name}.pem"
    authority.cert_pem.write_to_path(str(path))
    return str(path)


@pytest.fixture
def certificate_files(tmp_path):
    """A CA's PEM file, and a certificate for 127.0.0.1 it signed with its key: three paths."""
    authority = trustme.CA()
    return ca_file(tmp_path, authority, "ca"), *issued(tmp_path, authority, "gateway", "127.0.0.1")


@pytest.mark.parametrize("workers", [1, 2])
async def test_the_sdk_completes_through_the_https_listener_with_the_ca(tmp_path, certificate_files, workers):
    ca, certificate, key = certificate_files
    trusting = ssl.create_default_context(cafile=ca)
    async with serve_nodes(node_specs(1, tokens=4)) as nodes:
        config_path = tmp_path / "gateway.toml"
        config = config_text(nodes, tls_certificate=certificate, tls_key=key, workers=workers)
        config_path.write_text(config)
        api, metrics = free_port(), free_port()
        options = ("--config", str(config_path), "--listen", f"127.0.0.1:{api}", "--metrics-listen", f"127.0.0.1:{metrics}")
        async with interlock_serve(*options) as gateway:
            url = f"https://127.0.0.1:{api}"
            async with httpx.AsyncClient(verify=trusting, trust_env=False, timeout=60) as client:
                await wait_until_ready(client, url)
                with pytest.raises(httpx.TransportError):  # plain HTTP is not served on it
                    await client.get(f"http://127.0.0.1:{api}/health")
                assert (await client.get(f"http://127.0.0.1:{metrics}/metrics")).status_code == 200
            http_client = openai.DefaultAsyncHttpxClient(verify=trusting, trust_env=False)
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, http_client=http_client) as sdk:
                completion = await sdk.chat.completions.create(model=MODEL, messages=HI)
                stream = await sdk.chat.completions.create(model=MODEL, messages=HI, stream=True)
                deltas = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
            untrusting = openai.DefaultAsyncHttpxClient(trust_env=False)
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, http_client=untrusting) as sdk:
                with pytest.raises(openai.APIConnectionError):  # a client without the CA refuses it
                    await sdk.chat.completions.create(model=MODEL, messages=HI)
            code, _, errors = await gateway.stop()
    assert completion.choices[0].message.content == "".join(token_texts("n1", 4))
    assert "".join(deltas) == "".join(token_texts("n1", 4))
    assert (code, errors) == (0, "")


def test_tls_settings_that_cannot_serve_are_refused_naming_the_key_and_the_file(tmp_path, certificate_files):
    ca, certificate, key = certificate_files

    def refusal(**gateway: object) -> str:
        path = tmp_path / "gateway.toml"
        path.write_text(config_text([], models=(), **gateway))
        with pytest.raises(ConfigError) as raised:
            load_config(path)
        return str(raised.value)

    assert "gateway.tls_key: tls_certificate is set: tls_key must be set too" in refusal(tls_certificate=certificate)
    assert "gateway.tls_certificate: tls_key is set: tls_certificate must be set too" in refusal(tls_key=key)
    missing = str(tmp_path / "missing.pem")
    assert f"gateway.tls_certificate: reading {missing}: No such file or directory" in refusal(
        tls_certificate=missing, tls_key=key
    )
    assert f"gateway.tls_certificate: {ca} and {ca} are not a PEM certificate and its key" in refusal(
        tls_certificate=ca, tls_key=ca
    )
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)  # no writer ever: opening it to read would wait for ever
    assert f"gateway.tls_certificate: reading {fifo}: not a regular file" in refusal(tls_certificate=certificate, tls_key=str(fifo))
    large = tmp_path / "large.pem"
    large.write_bytes(b"#" * (MAX_TLS_FILE_BYTES + 1))
    assert (
        f"gateway.tls_certificate: reading {large}: {MAX_TLS_FILE_BYTES + 1} bytes, more than the"
        f" {MAX_TLS_FILE_BYTES} a TLS file may hold"
    ) in refusal(tls_certificate=str(large), tls_key=key)


async def test_a_node_reached_over_https_is_probed_discovered_and_proxied(tmp_path):
    authority = trustme.CA()
    specs = node_specs(1, tokens=4)
    specs[0].certificate, specs[0].key = issued(tmp_path, authority, "node", specs[0].host)
    https = {"scheme": "https", "ca_file": ca_file(tmp_path, authority, "ca")}
    async with serve_nodes(specs) as nodes, running_gateway(tmp_path, nodes, node_settings={"n1": https}) as gateway:
        await gateway.discovered()
        node = gateway.node("127.0.0.2")
        completion = await gateway.http.post(gateway.url + "/v1/chat/completions", json=chat())
        stream = await gateway.http.post(gateway.url + "/v1/chat/completions", json=chat(stream=True))
    assert node.models.state == Discovery.KNOWN and node.models.names == (MODEL,)
    assert node.status == "healthy" and gateway.logged("node health changed") == []
    assert completion.status_code == 200
    assert completion.json()["choices"][0]["message"]["content"] == "".join(token_texts("n1", 4))
    assert stream.status_code == 200 and sse_events(stream.text)[-1] == "[DONE]"
    assert [request.path for request in nodes[0].requests].count("/v1/chat/completions") == 2


async def test_a_node_whose_certificate_the_ca_does_not_sign_is_unhealthy_naming_the_tls_failure(tmp_path):
    specs = node_specs(1)
    specs[0].certificate, specs[0].key = issued(tmp_path, trustme.CA(), "node", specs[0].host)
    https = {"scheme": "https", "ca_file": ca_file(tmp_path, trustme.CA(), "other-ca")}
    async with (
        serve_nodes(specs) as nodes,
        running_gateway(tmp_path, nodes, node_settings={"n1": https}, **QUICK_DEATH) as gateway,
    ):
        await gateway.wait_for(lambda: gateway.node("127.0.0.2").status == "dead")
        [change] = gateway.logged("node health changed")
    assert change["error"].startswith(f'Get "https://127.0.0.2:{nodes[0].vllm_port}/health": dial tcp 127.0.0.2:')
    assert change["error"].endswith("tls: certificate verify failed: unable to get local issuer certificate")
    assert not any(request.path == "/health" for request in nodes[0].requests)


async def test_mutual_tls_sends_the_client_certificate_and_a_node_that_gets_none_is_unhealthy(tmp_path):
    authority, clients = trustme.CA(), trustme.CA()
    specs = node_specs(2)
    for spec in specs:
        spec.certificate, spec.key = issued(tmp_path, authority, spec.name, spec.host)
        spec.client_ca = ca_file(tmp_path, clients, "client-ca")
    client_certificate, client_key = issued(tmp_path, clients, "gateway-client", "gateway.example")
    https = {"scheme": "https", "ca_file": ca_file(tmp_path, authority, "ca")}
    settings = {"n1": https | {"client_certificate": client_certificate, "client_key": client_key}, "n2": https}
    async with (
        serve_nodes(specs) as nodes,
        running_gateway(tmp_path, nodes, node_settings=settings, **QUICK_DEATH) as gateway,
    ):
        await gateway.wait_for(lambda: gateway.node("127.0.0.3").status == "dead")
        [change] = gateway.logged("node health changed")
        completion = await gateway.http.post(gateway.url + "/v1/chat/completions", json=chat())
    assert completion.status_code == 200 and completion.headers["x-served-by"] == "n1"
    assert change["node"] == "127.0.0.3" and gateway.node("127.0.0.2").status == "healthy"
    # The simulated node drops the connection without a TLS alert when the handshake fails.
    assert change["error"] == (
        f'Get "https://127.0.0.3:{nodes[1].vllm_port}/health": '
        "the server closed the connection before the response head was complete"
    )
    assert not any(request.path == "/health" for request in nodes[1].requests)


def test_node_tls_settings_that_cannot_connect_are_refused_naming_the_key_and_the_file(tmp_path):
    authority = trustme.CA()
    ca = ca_file(tmp_path, authority, "ca")
    certificate, key = issued(tmp_path, authority, "client", "gateway.example")

    def refusal(**settings: object) -> str:
        path = tmp_path / "gateway.toml"
        text = config_text([], models=()) + "[[nodes]]\nip = \"10.0.0.1\"\n"
        text += "".join(f"{name} = {value!r}\n".replace("'", '"') for name, value in settings.items())
        path.write_text(text)
        with pytest.raises(ConfigError) as raised:
            load_config(path)
        return str(raised.value)

    assert 'nodes[0].scheme: scheme must be "http" or "https" (got "tls")' in refusal(scheme="tls")
    assert 'nodes[0].ca_file: ca_file is set: scheme must be "https"' in refusal(ca_file=ca)
    missing = str(tmp_path / "missing.pem")
    assert f"nodes[0].ca_file: reading {missing}: No such file or directory" in refusal(scheme="https", ca_file=missing)
    assert f"nodes[0].ca_file: {key} holds no PEM CA certificate" in refusal(scheme="https", ca_file=key)
    assert "nodes[0].client_key: client_certificate is set: client_key must be set too" in refusal(
        scheme="https", client_certificate=certificate
    )
    assert f"nodes[0].client_certificate: {ca} and {ca} are not a PEM certificate and its key" in refusal(
        scheme="https", client_certificate=ca, client_key=ca
    )

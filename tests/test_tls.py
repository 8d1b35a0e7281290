"""HTTPS on the API listener (`[gateway] tls_certificate`, `tls_key`): the OpenAI SDK through it
with the CA that signed the certificate, workers included; the metrics listener stays plain
HTTP. Certificates are made in the test (trustme). Config mistakes name the key and the file."""

from __future__ import annotations

import ssl

import httpx
import openai
import pytest
import trustme

from controlplane.config import ConfigError, load_config
from fixtures.node import serve_nodes, token_texts

from harness import MODEL, config_text, free_port, node_specs, wait_until_ready
from test_cli_serve import interlock_serve

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def certificate_files(tmp_path):
    """A CA's PEM file, and a certificate for 127.0.0.1 it signed with its key: three paths."""
    authority = trustme.CA()
    server = authority.issue_cert("127.0.0.1")
    ca, certificate, key = tmp_path / "ca.pem", tmp_path / "gateway.pem", tmp_path / "gateway.key"
    authority.cert_pem.write_to_path(str(ca))
    server.private_key_pem.write_to_path(str(key))
    for index, blob in enumerate(server.cert_chain_pems):
        blob.write_to_path(str(certificate), append=index > 0)
    return str(ca), str(certificate), str(key)


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
            async with httpx.AsyncClient(verify=trusting, trust_env=False, timeout=5) as client:
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

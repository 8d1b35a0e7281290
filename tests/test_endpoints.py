"""vLLM's model-addressed endpoints through the gateway: each routed by the `model` its body names
(a JSON member, or a multipart form field) to the node that lists it, answered as the node
answers, through the real server, with the OpenAI SDK where it has the call."""

from __future__ import annotations

import pytest

from fixtures.node import NodeSpec, read_form

from harness import MODEL, error_message, nodes_and_gateway
from test_openai_sdk import sdk_client

EMBED = "intfloat/e5-small"
WHISPER = "openai/whisper-small"
RERANK = "BAAI/bge-reranker-base"


def two_nodes() -> list[NodeSpec]:
    """n1 serves the chat model and the embedding model; n2 the chat model, whisper and the reranker."""
    return [
        NodeSpec(name="n1", host="127.0.0.2", models=[MODEL, EMBED]),
        NodeSpec(name="n2", host="127.0.0.3", models=[MODEL, WHISPER, RERANK]),
    ]


MODELS = ((MODEL, ""), (EMBED, ""), (WHISPER, ""), (RERANK, ""))


def posts(node, path: str) -> list:
    return [request for request in node.requests if request.method == "POST" and request.path == path]


async def test_sdk_embeddings_reach_the_node_that_lists_the_model(tmp_path):
    async with nodes_and_gateway(tmp_path, two_nodes(), models=MODELS) as ([n1, n2], gateway):
        await gateway.discovered()
        async with sdk_client(gateway) as client:
            for _ in range(3):
                embeddings = await client.embeddings.create(model=EMBED, input=["a", "b"])
                assert [item.index for item in embeddings.data] == [0, 1]
                assert len(embeddings.data[0].embedding) == 8
    assert len(posts(n1, "/v1/embeddings")) == 3 and not posts(n2, "/v1/embeddings")
    assert posts(n1, "/v1/embeddings")[0].json() == {"model": EMBED, "input": ["a", "b"], "encoding_format": "base64"}


async def test_sdk_responses_are_routed_and_answered(tmp_path):
    async with nodes_and_gateway(tmp_path, two_nodes(), models=MODELS) as ([n1, n2], gateway):
        await gateway.discovered()
        async with sdk_client(gateway) as client:
            response = await client.responses.create(model=MODEL, input="hi")
    assert response.output_text.startswith("Hello from n")
    assert len(posts(n1, "/v1/responses")) + len(posts(n2, "/v1/responses")) == 1


async def test_sdk_streamed_responses_arrive_as_events(tmp_path):
    async with nodes_and_gateway(tmp_path, two_nodes(), models=MODELS) as (nodes, gateway):
        await gateway.discovered()
        async with sdk_client(gateway) as client:
            stream = await client.responses.create(model=MODEL, input="hi", stream=True)
            events = [event async for event in stream]
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text.startswith("Hello from n") and text == events[-1].response.output_text
    assert [event.sequence_number for event in events] == list(range(len(events)))


async def test_sdk_transcription_goes_as_sent_to_the_node_with_whisper(tmp_path):
    audio = bytes(range(256)) * 40  # not text: every byte must arrive as it was
    async with nodes_and_gateway(tmp_path, two_nodes(), models=MODELS) as ([n1, n2], gateway):
        await gateway.discovered()
        async with sdk_client(gateway) as client:
            transcription = await client.audio.transcriptions.create(
                model=WHISPER, file=("clip.wav", audio, "audio/wav")
            )
    assert transcription.text == f"Heard {len(audio)} bytes on n2."
    [received] = posts(n2, "/v1/audio/transcriptions")
    assert read_form(received.header("content-type").encode(), received.body)["file"] == audio
    assert not posts(n1, "/v1/audio/transcriptions")


async def test_a_form_body_is_forwarded_byte_for_byte(tmp_path):
    body = (
        b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
        b"Content-Type: audio/wav\r\n\r\n\x00\r\n--Xy\xff\r\n"
        b"--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n" + WHISPER.encode() + b"\r\n"
        b"--XyZ\r\nContent-Disposition: form-data; name=\"language\"\r\n\r\nen\r\n--XyZ--\r\n"
    )
    headers = {"content-type": 'multipart/form-data; boundary="XyZ"'}
    async with nodes_and_gateway(tmp_path, two_nodes(), models=MODELS) as ([_, n2], gateway):
        await gateway.discovered()
        response = await gateway.http.post(gateway.url + "/v1/audio/transcriptions", content=body, headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["x-interlock-node"] == "n2"
    assert posts(n2, "/v1/audio/transcriptions")[0].body == body


async def test_a_form_without_a_model_gets_the_default_one(tmp_path):
    body = b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\r\n--b--\r\n"
    headers = {"content-type": "multipart/form-data; boundary=b"}
    async with nodes_and_gateway(tmp_path, two_nodes(), models=MODELS, default=WHISPER) as ([_, n2], gateway):
        await gateway.discovered()
        response = await gateway.http.post(gateway.url + "/v1/audio/translations", content=body, headers=headers)
    assert response.status_code == 200, response.text
    [received] = posts(n2, "/v1/audio/translations")
    assert received.body.endswith(body)
    assert read_form(received.header("content-type").encode(), received.body) == {"model": WHISPER, "file": b"RIFF"}


@pytest.mark.parametrize(
    "content_type, body",
    [
        ("multipart/form-data; boundary=b", b"not a form"),
        ("application/json", b'{"model": "x"}'),
        ("multipart/form-data; boundary=b", b"--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nx"),
    ],
)
async def test_a_malformed_form_is_a_400(tmp_path, content_type, body):
    async with nodes_and_gateway(tmp_path, two_nodes(), models=MODELS) as ([n1, n2], gateway):
        response = await gateway.http.post(
            gateway.url + "/v1/audio/transcriptions", content=body, headers={"content-type": content_type}
        )
    assert response.status_code == 400
    assert error_message(response) == "invalid request body"
    assert not posts(n1, "/v1/audio/transcriptions") + posts(n2, "/v1/audio/transcriptions")


@pytest.mark.parametrize(
    "path, body, expected",
    [
        ("/v1/rerank", {"query": "q", "documents": ["d1", "d2"]}, lambda a: len(a["results"]) == 2),
        ("/rerank", {"query": "q", "documents": ["d1"]}, lambda a: a["results"][0]["document"] == {"text": "d1"}),
        ("/v2/rerank", {"query": "q", "documents": ["d1"]}, lambda a: "relevance_score" in a["results"][0]),
        ("/v1/score", {"text_1": "q", "text_2": ["a", "b"]}, lambda a: [d["object"] for d in a["data"]] == ["score"] * 2),
        ("/score", {"text_1": "q", "text_2": "a"}, lambda a: a["data"][0]["index"] == 0),
        ("/pooling", {"input": "x"}, lambda a: a["data"][0]["object"] == "pooling"),
        ("/classify", {"input": ["x"]}, lambda a: a["data"][0]["label"] == "positive"),
        ("/tokenize", {"prompt": "hello big world"}, lambda a: a["tokens"] == [5, 3, 5] and a["count"] == 3),
        ("/detokenize", {"tokens": [1, 2]}, lambda a: a["prompt"] == "x xx"),
    ],
)
async def test_each_endpoint_is_routed_by_its_model(tmp_path, path, body, expected):
    async with nodes_and_gateway(tmp_path, two_nodes(), models=MODELS) as ([n1, n2], gateway):
        await gateway.discovered()
        response = await gateway.http.post(gateway.url + path, json={"model": RERANK, **body})
        assert response.status_code == 200, response.text
        assert expected(response.json())
        assert response.headers["x-interlock-node"] == "n2"
        assert len(posts(n2, path)) == 1 and not posts(n1, path)
        assert await gateway.metric(f'gateway_requests_total{{model="{RERANK}",status="200"}}') == 1
        assert await gateway.metric(f'interlock_requests_total{{path="{path}",status="200"}}') == 1


async def test_an_unserved_model_on_an_endpoint_is_vllms_404(tmp_path):
    async with nodes_and_gateway(tmp_path, two_nodes(), models=MODELS) as (_, gateway):
        await gateway.discovered()
        response = await gateway.http.post(gateway.url + "/v1/embeddings", json={"model": "nope", "input": "x"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


async def test_other_methods_are_405_and_unknown_paths_a_json_404(tmp_path):
    async with nodes_and_gateway(tmp_path, two_nodes(), models=MODELS) as (_, gateway):
        wrong_method = await gateway.http.get(gateway.url + "/v1/embeddings")
        unknown = await gateway.http.post(gateway.url + "/v1/embeddingz", json={"model": EMBED})
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"
    assert unknown.status_code == 404 and unknown.json()["error"]["message"] == "404 page not found"

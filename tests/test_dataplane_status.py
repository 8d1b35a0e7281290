"""`GET /health`, `GET /v1/models`, method and path errors, and the `/metrics` listener, checked
after scripted sequences on simulated nodes (plinth §4.1, §4.2, §5)."""

from __future__ import annotations

from harness import MODEL, chat, error_message, node_specs, nodes_and_gateway

CHAT = "/v1/chat/completions"


async def test_health_reports_node_health_and_model_discovery(tmp_path):
    specs = node_specs(3)
    specs[1].behaviour.health = "fail"
    specs[1].behaviour.models = "empty"
    specs[2].behaviour.models = "error"
    async with nodes_and_gateway(tmp_path, specs, health_interval="50ms", health_fail_threshold=2) as (nodes, gateway):
        n1, n2, n3 = (node.host for node in nodes)
        await gateway.wait_for(
            lambda: gateway.node(n2).status == "dead"
            and gateway.node(n2).models.state == "known_empty"
            and gateway.node(n3).models.state == "expired"
            and gateway.node(n1).models.state == "known"
        )
        response = await gateway.http.get(gateway.url + "/health")

    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    # Go's encoder sorts the top-level keys.
    assert response.text.startswith('{"details":[{"ip":"127.0.0.2","name":"n1","status":"healthy","models":{"state"')
    health = response.json()
    assert list(health) == ["details", "healthy", "models_ok", "nodes", "status"]
    assert {key: health[key] for key in ("status", "nodes", "healthy", "models_ok")} == {
        "status": "degraded",
        "nodes": 3,
        "healthy": 2,
        "models_ok": 2,
    }
    first, second, third = health["details"]
    assert first["models"]["names"] == [MODEL] and first["models"]["state"] == "known"
    assert isinstance(first["models"]["age_seconds"], float) and 0 <= first["models"]["age_seconds"] < 5
    assert first["models"]["fails"] == 0 and first["models"]["last_error"] == ""
    assert second == second | {"ip": n2, "name": "n2", "status": "dead"}
    assert second["models"] == second["models"] | {"state": "known_empty", "names": None, "fails": 0, "last_error": ""}
    assert third["status"] == "healthy"
    assert third["models"] == third["models"] | {"state": "expired", "names": None, "age_seconds": None}
    assert third["models"]["fails"] >= 2 and third["models"]["last_error"]
    assert list(third["models"]) == ["state", "names", "age_seconds", "fails", "last_error"]


async def test_health_status_is_ok_only_when_every_node_is_healthy_and_error_when_none_is(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(2), health_interval="50ms", health_fail_threshold=1) as (nodes, gateway):
        health = (await gateway.http.get(gateway.url + "/health")).json()
        assert (health["status"], health["healthy"], health["nodes"]) == ("ok", 2, 2)
        for node in nodes:
            node.behaviour.health = "fail"
        await gateway.wait_for(lambda: all(node.status == "dead" for node in gateway.nodes()))
        health = (await gateway.http.get(gateway.url + "/health")).json()
        assert (health["status"], health["healthy"]) == ("error", 0)


async def test_models_lists_the_configured_models_then_those_a_request_could_be_routed_to(tmp_path):
    specs = node_specs(2, serving=(MODEL, "other"))
    specs[1].models = [MODEL, "second-only"]
    async with nodes_and_gateway(tmp_path, specs, models=[("zeta", ""), ("alpha", "")]) as (nodes, gateway):
        await gateway.discovered()
        response = await gateway.http.get(gateway.url + "/v1/models")
        assert response.headers["content-type"] == "application/json"
        vllm = {"root": MODEL, "max_model_len": 32768}  # vLLM's fields, as the node lists them
        assert response.json() == {
            "object": "list",
            "data": [
                {"id": "zeta", "object": "model", "created": 0, "owned_by": "cluster"},
                {"id": "alpha", "object": "model", "created": 0, "owned_by": "cluster"},
                {"id": MODEL, "object": "model", "created": 0, "owned_by": "cluster"} | vllm,
                {"id": "other", "object": "model", "created": 0, "owned_by": "cluster", "root": "other", "max_model_len": 32768},
                {"id": "second-only", "object": "model", "created": 0, "owned_by": "cluster", "root": "second-only", "max_model_len": 32768},
            ],
        }
        retrieved = await gateway.http.get(gateway.url + "/v1/models/second-only")
        assert retrieved.status_code == 200 and retrieved.json()["id"] == "second-only"
        # A model whose only node cannot be routed to is no longer served, nor retrievable: the
        # listing agrees with routing (and a configured model stays listed).
        nodes[1].behaviour.refuse = True
        assert (await gateway.http.post(gateway.url + CHAT, json=chat("second-only"))).status_code == 503
        await gateway.wait_for(lambda: gateway.node(nodes[1].host).is_offline(gateway.control_plane.view.now()))
        listed = [card["id"] for card in (await gateway.http.get(gateway.url + "/v1/models")).json()["data"]]
        assert listed == ["zeta", "alpha", MODEL, "other"]
        gone = await gateway.http.get(gateway.url + "/v1/models/second-only")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


async def test_models_with_no_configured_models_lists_what_the_nodes_serve_and_data_is_always_a_list(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1), models=[], health_interval="50ms") as (nodes, gateway):
        await gateway.discovered()
        listing = (await gateway.http.get(gateway.url + "/v1/models")).json()
        assert [card["id"] for card in listing["data"]] == [MODEL]
        assert (await gateway.http.post(gateway.url + CHAT, json=chat())).status_code == 200
        assert (await gateway.http.get(gateway.url + f"/v1/models/{MODEL}")).json() == listing["data"][0]
        nodes[0].behaviour.models = "empty"
        await gateway.wait_for(lambda: not gateway.node(nodes[0].host).models.names)
        assert (await gateway.http.get(gateway.url + "/v1/models")).content == b'{"object":"list","data":[]}'


async def test_routes_match_method_and_path_exactly(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1)) as (nodes, gateway):
        head = await gateway.http.head(gateway.url + "/health")
        assert head.status_code == 200 and head.content == b""
        assert (await gateway.http.head(gateway.url + "/v1/models")).status_code == 200

        response = await gateway.http.post(gateway.url + "/health")
        assert response.status_code == 405
        assert response.headers["allow"] == "GET, HEAD"
        assert error_message(response) == "Method Not Allowed"
        response = await gateway.http.get(gateway.url + CHAT)
        assert response.status_code == 405 and response.headers["allow"] == "POST"
        response = await gateway.http.request("OPTIONS", gateway.url + "/v1/completions")
        assert response.status_code == 405

        for path in ("/", "/v1/chat/completions/", "/v1/images/generations", "/metrics"):
            response = await gateway.http.get(gateway.url + path)
            assert response.status_code == 404, path
            assert error_message(response) == "404 page not found"
        # An unread body on an unknown route closes the connection.
        response = await gateway.http.post(gateway.url + "/v1/images/generations", content=b"x" * 1000)
        assert response.status_code == 404 and response.headers["connection"] == "close"


async def test_metrics_after_a_scripted_sequence(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(2), models=[(MODEL, ""), ("elsewhere", "")]) as (nodes, gateway):
        await gateway.discovered()
        assert (await gateway.http.post(gateway.url + CHAT, json=chat())).status_code == 200
        assert (await gateway.http.post(gateway.url + CHAT, json=chat("elsewhere"))).status_code == 503
        nodes[1].behaviour.refuse = True  # the balancer's next pick: retried on nodes[0]
        assert (await gateway.http.post(gateway.url + CHAT, json=chat(stream=True))).status_code == 200
        assert (await gateway.http.post(gateway.url + CHAT, content=b"not json")).status_code == 400
        text = await gateway.metrics()
        not_found = await gateway.http.get(gateway.metrics_url + "/")
        assert not_found.status_code == 404

    samples = {
        line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert {name: value for name, value in samples.items() if name.startswith("gateway_requests_total")} == {
        'gateway_requests_total{model="test-model",status="200"}': 2,
        'gateway_requests_total{model="elsewhere",status="503"}': 1,
    }
    assert {name: value for name, value in samples.items() if name.startswith("gateway_proxy_attempts_total")} == {
        'gateway_proxy_attempts_total{model="test-model",status="200"}': 2,
        'gateway_proxy_attempts_total{model="test-model",status="502"}': 1,
    }
    assert samples['gateway_model_filter_exclusions_total{model="elsewhere",reason="missing"}'] == 2
    assert samples["gateway_request_duration_seconds_count"] == 3
    buckets = [name for name in samples if name.startswith("gateway_request_duration_seconds_bucket")]
    assert [name.split('"')[1] for name in buckets] == [
        "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0", "2.5", "5.0", "10.0", "+Inf"
    ]  # fmt: skip
    assert samples['gateway_request_duration_seconds_bucket{le="+Inf"}'] == 3
    help_texts = {
        "gateway_request_duration_seconds": ("histogram", "Request duration in seconds"),
        "gateway_requests_total": ("counter", "Total requests by model and status"),
        "gateway_proxy_attempts_total": ("counter", "Proxy attempts by model and observed status"),
        "gateway_response_passthrough_total": (
            "counter",
            "Responses committed early and passed through to the client",
        ),
        "gateway_response_client_write_failures_total": (
            "counter",
            "Committed responses whose write to the client failed",
        ),
        "gateway_model_filter_exclusions_total": ("counter", "Nodes dropped from the candidate pool by the model filter"),
    }
    for name, (kind, help_text) in help_texts.items():
        assert f"# HELP {name} {help_text}\n" in text
        assert f"# TYPE {name} {kind}\n" in text
    # The control plane's series are on the same registry.
    assert samples["cluster_nodes_healthy"] >= 1
    assert samples['gateway_model_discovery_total{node="127.0.0.2",result="success"}'] >= 1

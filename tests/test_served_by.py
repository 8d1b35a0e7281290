"""`X-Interlock-Node`: the gateway names the node that served each proxied response (its
configured name, else its IP), whatever the node itself says. Real gateways, real sockets,
simulated nodes."""

from __future__ import annotations

from dataclasses import dataclass

from fixtures.node import serve_nodes

from harness import chat, node_specs, nodes_and_gateway, running_gateway

CHAT = "/v1/chat/completions"


async def test_each_answer_names_the_node_that_served_it_streams_and_retries_included(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(2)) as (nodes, gateway):
        await gateway.discovered()
        served = set()
        for _ in range(4):
            response = await gateway.http.post(gateway.url + CHAT, json=chat())
            assert response.headers["x-interlock-node"] == response.headers["x-served-by"]
            served.add(response.headers["x-interlock-node"])
        assert served == {"n1", "n2"}
        async with gateway.http.stream("POST", gateway.url + CHAT, json=chat(stream=True)) as stream:
            assert stream.headers["x-interlock-node"] == stream.headers["x-served-by"]
        nodes[0].behaviour.refuse = True  # the next request to n1 is retried on n2
        for _ in range(2):
            response = await gateway.http.post(gateway.url + CHAT, json=chat())
            assert response.headers.get_list("x-interlock-node") == ["n2"]
        # Errors the gateway answers itself name no node.
        assert "x-interlock-node" not in (await gateway.http.post(gateway.url + CHAT, content=b"{")).headers


async def test_an_unnamed_node_is_named_by_its_ip(tmp_path):
    async with serve_nodes(node_specs(1)) as nodes:
        unnamed = NodeAddress(nodes[0].host, nodes[0].vllm_port, nodes[0].metrics_port, name="")
        async with running_gateway(tmp_path, [unnamed]) as gateway:
            await gateway.discovered()
            response = await gateway.http.post(gateway.url + CHAT, json=chat())
    assert response.status_code == 200
    assert response.headers["x-interlock-node"] == nodes[0].host


async def test_behind_another_gateway_the_client_sees_the_outer_gateways_node_once(tmp_path):
    inner_dir, outer_dir = tmp_path / "inner", tmp_path / "outer"
    inner_dir.mkdir()
    outer_dir.mkdir()
    async with nodes_and_gateway(inner_dir, node_specs(1)) as (_, inner):
        await inner.discovered()
        host, port = inner.url.removeprefix("http://").split(":")
        metrics_port = int(inner.metrics_url.rsplit(":", 1)[1])
        as_node = NodeAddress(host, int(port), metrics_port, name="inner-gateway")
        async with running_gateway(outer_dir, [as_node]) as outer:
            await outer.discovered()
            response = await outer.http.post(outer.url + CHAT, json=chat())
    assert response.status_code == 200 and response.headers["x-served-by"] == "n1"
    assert response.headers.get_list("x-interlock-node") == ["inner-gateway"]


@dataclass
class NodeAddress:
    """What `config_text` needs of a node."""

    host: str
    vllm_port: int
    metrics_port: int
    name: str

"""`GET /ready`: what a load balancer in front asks (200: send me requests; 503: send them
elsewhere), unlike `/health`, which stays plinth's (200 even when every node is dead).

Which models count as routable is checked on states the reducer builds from events (the same
`SnapshotView` the data plane reads); the answers through the real server, alone and with
workers."""

from __future__ import annotations

import httpx
import pytest

from controlplane.effects.follower import Follower
from controlplane.rules.reducer import INITIAL_STATE
from dataplane.app import NOTHING_ROUTABLE
from dataplane.views import ConfigView, SnapshotView
from events.config import ModelEntry, NodeConfig
from events.types import Checkpoint, HealthProbed, ModelsListed, UpstreamFailed

from builders import T0, apply, make_config, node_ip, run_started
from harness import MODEL, node_specs, nodes_and_gateway

# Nodes 1 and 2 are ring-less, node 3 is in ring "r"; model "a" is routed to the ring-less
# nodes, model "b" to ring "r".
RING_CONFIG = make_config(
    [
        NodeConfig(ip=node_ip(1), name="node-1"),
        NodeConfig(ip=node_ip(2), name="node-2"),
        NodeConfig(ip=node_ip(3), name="node-3", ring="r"),
    ],
    threshold=4,
    models=[ModelEntry(name="a"), ModelEntry(name="b", ring="r")],
)


def routable(events, config=RING_CONFIG, *, now: float = T0 + 1) -> tuple[str, ...]:
    state, _, _ = apply([run_started(config), *events])
    return SnapshotView(state, ConfigView(state.config, {})).routable_models(now)


def listed(index: int, *models: str) -> ModelsListed:
    return ModelsListed(at=T0, node=node_ip(index), models=models)


def failed_probes(index: int, count: int) -> list[HealthProbed]:
    return [HealthProbed(at=T0, node=node_ip(index), ok=False, error="refused")] * count


LISTINGS = [listed(1, "a"), listed(2, "a"), listed(3, "b")]


def test_a_model_is_routable_through_a_healthy_node_of_its_ring_pool_that_serves_it():
    assert routable([]) == ("a", "b")  # nodes not yet listed may serve any model, as requests see
    assert routable(LISTINGS) == ("a", "b")
    assert routable([listed(1, "b"), listed(2, "b"), listed(3, "a", "b")]) == ("b",)  # "a" only in ring "r"
    assert routable([*LISTINGS, *failed_probes(3, 4)]) == ("a",)  # node 3 dead
    assert routable([listed(1, "a"), listed(2, "a"), listed(3, "c")]) == ("a",)  # node 3 lists no "b"


def test_degraded_nodes_make_a_model_routable_when_no_healthy_node_serves_it():
    events = [*LISTINGS, *failed_probes(1, 2), *failed_probes(2, 2)]
    state, _, _ = apply([run_started(RING_CONFIG), *events])
    assert {state.nodes[node_ip(i)].status for i in (1, 2)} == {"degraded"}
    assert routable(events) == ("a", "b")
    assert routable([*events, *failed_probes(1, 2), *failed_probes(2, 2)]) == ("b",)


def test_an_offline_mark_makes_a_model_unroutable_until_it_ends_on_the_same_snapshot():
    marks = [UpstreamFailed(at=T0, node=node_ip(i), error="connection refused") for i in (1, 2)]
    state, _, _ = apply([run_started(RING_CONFIG), *LISTINGS, *marks])
    view = SnapshotView(state, ConfigView(state.config, {}))
    until = state.nodes[node_ip(1)].offline_until
    assert view.routable_models(T0) == ("b",)
    assert view.routable_models(until - 0.001) == ("b",)
    assert view.routable_models(until) == ("a", "b")


def test_without_configured_models_the_models_the_nodes_list_count():
    config = make_config(2)
    assert routable([], config) == ()
    assert routable([listed(1, "y", "x"), listed(2, "x")], config) == ("x", "y")
    assert routable([listed(1, "y", "x"), listed(2, "x"), *failed_probes(1, 3)], config) == ("x",)


def test_a_follower_is_current_from_its_first_checkpoint_until_marked_stale():
    follower = Follower(report=lambda event: None)
    assert follower.view.stale_reason() == "no checkpoint from the leader yet"
    state, _, _ = apply([run_started(RING_CONFIG)], INITIAL_STATE)
    follower.apply(Checkpoint.of(state))
    assert follower.view.stale_reason() == ""
    follower.mark_stale("the leader's event stream ended")
    assert follower.view.stale_reason() == "the leader's event stream ended"
    follower.mark_stale("")
    assert follower.view.stale_reason() == ""


# --- through the server ----------------------------------------------------------------------------


async def test_ready_names_the_routable_models_and_is_503_while_health_stays_200_when_every_node_is_dead(tmp_path):
    models = [(MODEL, ""), ("unserved", "")]
    config = {"models": models, "health_interval": "50ms", "health_fail_threshold": 1}
    async with nodes_and_gateway(tmp_path, node_specs(2), **config) as (nodes, gateway):
        await gateway.discovered()
        ready = await gateway.http.get(gateway.url + "/ready")
        assert ready.status_code == 200
        assert ready.headers["content-type"] == "application/json"
        assert ready.json() == {"ready": True, "models": [MODEL]}
        assert int(ready.headers["x-interlock-seq"]) >= 1 and ready.headers["x-interlock-worker"] == "0"

        for node in nodes:
            node.behaviour.health = "fail"
        await gateway.wait_for(lambda: all(node.status == "dead" for node in gateway.nodes()))
        ready = await gateway.http.get(gateway.url + "/ready")
        assert ready.status_code == 503
        assert ready.json() == {"ready": False, "reason": NOTHING_ROUTABLE}
        assert (await gateway.http.get(gateway.url + "/health")).status_code == 200

        nodes[1].behaviour.health = "ok"
        await gateway.wait_for(lambda: gateway.node(nodes[1].host).status == "healthy")
        assert (await gateway.http.get(gateway.url + "/ready")).status_code == 200


@pytest.mark.parametrize("health_requires_api_key", [False, True])
async def test_ready_needs_a_client_key_exactly_when_health_does(tmp_path, health_requires_api_key):
    config = {"api_keys": ["sk-client-1"], "health_requires_api_key": health_requires_api_key}
    async with nodes_and_gateway(tmp_path, node_specs(1), **config) as (_, gateway):
        for path in ("/health", "/ready"):
            status = (await gateway.http.get(gateway.url + path)).status_code
            assert status == (401 if health_requires_api_key else 200), path
        keyed = await gateway.http.get(gateway.url + "/ready", headers={"Authorization": "Bearer sk-client-1"})
        assert keyed.status_code == 200


async def ready_by_worker(url: str, workers: set[int], status: int) -> None:
    """A `/ready` answer with `status` from each of `workers`, on new connections (the kernel
    hands each to whichever worker accepts it first)."""
    answered: set[int] = set()
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        for _ in range(300):
            response = await http.get(url + "/ready", headers={"Connection": "close"})
            if response.status_code == status:
                answered.add(int(response.headers["x-interlock-worker"]))
            if workers <= answered:
                return
    raise AssertionError(f"only workers {sorted(answered)} of {sorted(workers)} answered {status}")


async def test_every_worker_answers_ready_from_the_state_it_follows(tmp_path):
    config = {"workers": 2, "health_interval": "50ms", "health_fail_threshold": 1}
    async with nodes_and_gateway(tmp_path, node_specs(2), **config) as (nodes, gateway):
        await ready_by_worker(gateway.url, {1, 2}, 200)
        for node in nodes:
            node.behaviour.health = "fail"
        await gateway.wait_for(lambda: all(node.status == "dead" for node in gateway.nodes()))
        await ready_by_worker(gateway.url, {1, 2}, 503)

"""Routing decisions (plinth §3, §4.3 steps 4-6): ring pool, model filter, balancer pool, plan_route."""

from __future__ import annotations

import msgspec
import pytest

from controlplane.rules.routing import EXCLUDED_DEAD, EXCLUDED_OFFLINE, NOT_IN_RING, filter_by_model, is_unknown_model, pick_pool, plan_route, ring_pool
from events.config import ModelEntry, NodeConfig
from events.state import Discovery, Health, ModelDiscovery, NodeState
from events.types import HealthProbed, ModelsListed, UpstreamFailed

from builders import T0, apply, make_config, run_started

# Standalone .1 .2 .5 .6 .7 .8 .9, ring "a" .3 .4; every standalone node but .1 is excluded for
# "plain" in its own way once `cluster()` has run.
CONFIG = make_config(
    [
        NodeConfig(ip=f"10.0.0.{i}", name=f"node-{i}", ring="a" if i in (3, 4) else "")
        for i in (1, 2, 3, 4, 5, 6, 7, 8, 9)
    ],
    threshold=2,
    models=[ModelEntry(name="plain"), ModelEntry(name="big", ring="a")],
)
STANDALONE = ("10.0.0.1", "10.0.0.2", "10.0.0.5", "10.0.0.6", "10.0.0.7", "10.0.0.8", "10.0.0.9")
RING_A = ("10.0.0.3", "10.0.0.4")
OFFLINE_AT = T0 + 10


def served(ip: str, *models: str) -> list[ModelsListed]:
    return [ModelsListed(at=T0, node=ip, models=models)]


def failed_probes(ip: str, count: int) -> list[HealthProbed]:
    return [HealthProbed(at=T0, node=ip, ok=False, status=503)] * count


def cluster():
    events = [
        run_started(CONFIG),
        *served("10.0.0.1", "plain"),
        *served("10.0.0.2", "other"),  # missing
        *served("10.0.0.5") * 2,  # empty
        *[ModelsListed(at=T0, node="10.0.0.6", error="refused")] * 2,  # expired
        *served("10.0.0.7", "plain"),
        *failed_probes("10.0.0.7", 2),  # dead
        *served("10.0.0.8", "plain"),
        UpstreamFailed(at=OFFLINE_AT, node="10.0.0.8", error="refused"),  # offline until T0 + 20
        *served("10.0.0.9", "plain", "big"),
        *failed_probes("10.0.0.9", 1),  # degraded
    ]
    state, _, _ = apply(events)
    return state


def ips(nodes) -> list[str]:
    return [node.ip for node in nodes]


# --- ring_pool ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "pool"),
    [
        ("big", RING_A),
        ("plain", STANDALONE),  # a ring-less model
        ("ad-hoc", STANDALONE),  # not configured
        ("", STANDALONE),
    ],
)
def test_ring_pool(model, pool):
    assert ips(ring_pool(cluster(), model)) == list(pool)


def test_ring_pool_ignores_health():
    state = cluster()
    assert state.nodes["10.0.0.7"].status == Health.DEAD
    assert "10.0.0.7" in ips(ring_pool(state, "plain"))


# --- filter_by_model -----------------------------------------------------------------------------


def node(ip: str, state: str = Discovery.UNTRIED, names=None, status: str = Health.HEALTHY) -> NodeState:
    return NodeState(ip=ip, status=status, models=ModelDiscovery(state=state, names=names))


def test_filter_by_model_keeps_allowed_nodes_and_names_the_reason_for_the_rest():
    pool = [
        node("10.0.0.1"),
        node("10.0.0.2", Discovery.KNOWN, ("plain",)),
        node("10.0.0.3", Discovery.KNOWN, ("other",)),
        node("10.0.0.4", Discovery.DEGRADED, ("plain",)),
        node("10.0.0.5", Discovery.KNOWN_EMPTY),
        node("10.0.0.6", Discovery.EXPIRED, ("plain",)),
        node("10.0.0.7", Discovery.KNOWN, ("plain",), status=Health.DEAD),
    ]
    kept, dropped = filter_by_model(pool, "plain")
    assert ips(kept) == ["10.0.0.1", "10.0.0.2", "10.0.0.4", "10.0.0.7"]
    assert [(n.ip, reason) for n, reason in dropped] == [
        ("10.0.0.3", "missing"),
        ("10.0.0.5", "empty"),
        ("10.0.0.6", "expired"),
    ]


def test_filter_by_model_is_the_identity_while_untried():
    pool = [node("10.0.0.1"), node("10.0.0.2", status=Health.DEAD)]
    assert filter_by_model(pool, "anything") == (pool, [])


# --- is_unknown_model ----------------------------------------------------------------------------


def test_a_model_is_unknown_unless_configured_listed_last_by_a_node_of_its_pool_or_a_node_is_untried():
    state = cluster()  # configures "plain" and "big"
    pool = [
        node("10.0.0.1", Discovery.KNOWN, ("listed",)),
        node("10.0.0.2", Discovery.EXPIRED, ("listed-last",)),
        node("10.0.0.3", Discovery.KNOWN_EMPTY),
        node("10.0.0.4", Discovery.KNOWN, ("dead-but-listed",), status=Health.DEAD),
    ]
    assert is_unknown_model(state, pool, "nowhere")
    assert is_unknown_model(state, [], "nowhere")  # an empty pool serves nothing
    for model in ("listed", "listed-last", "dead-but-listed", "plain", "big"):
        assert not is_unknown_model(state, pool, model), model
    assert not is_unknown_model(state, [*pool, node("10.0.0.5")], "nowhere")  # 10.0.0.5 is untried


# --- pick_pool -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("statuses", "picked"),
    [
        ([Health.DEGRADED, Health.HEALTHY, Health.DEAD, Health.HEALTHY], [1, 3]),  # healthy preferred, order kept
        ([Health.DEGRADED, Health.DEAD, Health.DEGRADED], [0, 2]),  # degraded fallback
        ([Health.DEAD, Health.DEAD], []),  # dead never
        ([], []),
    ],
)
def test_pick_pool_prefers_healthy_nodes(statuses, picked):
    candidates = [node(f"10.0.0.{i}", status=status) for i, status in enumerate(statuses)]
    assert pick_pool(candidates, 0.0) == [candidates[i] for i in picked]


def test_pick_pool_leaves_out_the_tried_and_names_the_dead_and_offline():
    offline = msgspec.structs.replace(node("10.0.0.2"), offline_until=20.0)
    candidates = [node("10.0.0.0"), node("10.0.0.1", status=Health.DEAD), offline, node("10.0.0.3", status=Health.DEGRADED)]
    passed: list[tuple[str, str]] = []
    pool = pick_pool(candidates, 10.0, tried={"10.0.0.0"}, passed_over=lambda ip, why: passed.append((ip, why)))
    assert pool == [candidates[3]]  # the only healthy one was tried: the degraded one is left
    assert passed == [("10.0.0.1", EXCLUDED_DEAD), ("10.0.0.2", EXCLUDED_OFFLINE)]
    assert pick_pool(candidates, 30.0, tried={"10.0.0.0"}) == [offline]  # its offline mark has ended


# --- plan_route ----------------------------------------------------------------------------------


def reasons(plan) -> dict[str, str]:
    return {verdict.ip: verdict.reason for verdict in plan.verdicts}


def test_plan_route_names_every_exclusion_reason():
    plan = plan_route(cluster(), "plain", OFFLINE_AT + 1)
    assert plan.ring == ""
    assert plan.ring_pool == STANDALONE
    assert plan.candidates == ("10.0.0.1", "10.0.0.7", "10.0.0.8", "10.0.0.9")
    assert plan.pick_pool == ("10.0.0.1",)
    assert reasons(plan) == {
        "10.0.0.1": "",
        "10.0.0.2": "missing",
        "10.0.0.3": NOT_IN_RING,
        "10.0.0.4": NOT_IN_RING,
        "10.0.0.5": "empty",
        "10.0.0.6": "expired",
        "10.0.0.7": "dead",
        "10.0.0.8": "offline",
        "10.0.0.9": "degraded (healthy nodes preferred)",
    }
    assert [v.ip for v in plan.verdicts if v.kept] == ["10.0.0.1"]
    by_ip = {v.ip: v for v in plan.verdicts}
    assert (by_ip["10.0.0.6"].model_state, by_ip["10.0.0.7"].status) == (Discovery.EXPIRED, Health.DEAD)
    assert (by_ip["10.0.0.3"].name, by_ip["10.0.0.3"].ring) == ("node-3", "a")


def test_plan_route_falls_back_to_degraded_when_no_healthy_node_is_reachable():
    state, _, _ = apply([UpstreamFailed(at=OFFLINE_AT, node="10.0.0.1", error="refused")], cluster())
    plan = plan_route(state, "plain", OFFLINE_AT + 1)
    assert plan.pick_pool == ("10.0.0.9",)
    assert reasons(plan)["10.0.0.1"] == "offline"
    assert reasons(plan)["10.0.0.9"] == ""


def test_plan_route_offline_ends_when_the_skip_expires():
    state = cluster()
    until = state.nodes["10.0.0.8"].offline_until
    assert reasons(plan_route(state, "plain", until - 0.001))["10.0.0.8"] == "offline"
    plan = plan_route(state, "plain", until)
    assert plan.pick_pool == ("10.0.0.1", "10.0.0.8")
    assert reasons(plan)["10.0.0.8"] == ""


def test_plan_route_for_a_ring_model():
    plan = plan_route(cluster(), "big", T0)
    assert (plan.ring, plan.ring_pool, plan.candidates, plan.pick_pool) == ("a", RING_A, RING_A, RING_A)
    assert {ip for ip, reason in reasons(plan).items() if reason == NOT_IN_RING} == set(STANDALONE)


def test_plan_route_for_a_model_no_node_serves():
    plan = plan_route(cluster(), "ad-hoc", T0)
    assert plan.ring_pool == STANDALONE
    assert (plan.candidates, plan.pick_pool) == ((), ())
    assert {ip: reason for ip, reason in reasons(plan).items() if ip in STANDALONE} == {
        "10.0.0.1": "missing",
        "10.0.0.2": "missing",
        "10.0.0.5": "empty",
        "10.0.0.6": "expired",
        "10.0.0.7": "missing",
        "10.0.0.8": "missing",
        "10.0.0.9": "missing",
    }


def test_plan_route_never_picks_dead_nodes():
    state, _, _ = apply(failed_probes("10.0.0.1", 2) + failed_probes("10.0.0.9", 1), cluster())
    plan = plan_route(state, "plain", OFFLINE_AT + 1)
    assert plan.candidates == ("10.0.0.1", "10.0.0.7", "10.0.0.8", "10.0.0.9")
    assert plan.pick_pool == ()
    assert [reasons(plan)[ip] for ip in plan.candidates] == ["dead", "dead", "offline", "dead"]

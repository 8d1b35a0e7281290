"""The reducer and the state it derives: health (plinth §2.2), reload (§2.3, §7), model discovery
(§8), the offline skip-set (§4.3) and immutability (follow-up #38)."""

from __future__ import annotations

import json

import msgspec
import pytest

from controlplane.rules.discovery import configured_models_missing, next_discovery
from controlplane.rules.health import compute_status
from controlplane.rules.reducer import INITIAL_STATE, OFFLINE_SECONDS, reduce
from controlplane.rules.transitions import HEALTH, MODELS, NOTHING, Recheck, StartProbing, StopProbing, Transition
from events.config import ModelEntry, NodeConfig
from events.state import Discovery, Health, ModelDiscovery, NodeState
from events.types import (
    ConfigReloaded,
    GpuSample,
    GpuScraped,
    HealthProbed,
    LoadScraped,
    ModelsListed,
    ModelsUnchanged,
    ProbeCrashed,
    ReloadRejected,
    UpstreamFailed,
    UpstreamRecovered,
    listing_digest,
)

from builders import T0, apply, encode_state, make_config, messages, node_ip, run_started

NODE = node_ip(1)


def fields(transition: Transition) -> dict[str, str]:
    return dict(transition.fields)


def started(config=None):
    """The state right after a RunStarted of `config` (three standalone nodes by default)."""
    state, _, _ = apply([run_started(config or make_config())])
    return state


def probe(ok: bool, at: float = T0, node: str = NODE, error: str = "") -> HealthProbed:
    """A health probe answered 200 (ok) or 503 (with `error`, a transport error)."""
    return HealthProbed(at=at, node=node, ok=ok, status=200 if ok else 503, error=error)


def listing(models, at: float = T0, node: str = NODE) -> ModelsListed:
    """A successful `GET /v1/models` with these ids, or (models=None) a failed one."""
    if models is None:
        return ModelsListed(at=at, node=node, error="connection refused")
    return ModelsListed(at=at, node=node, models=tuple(models))


def reload(config, at: float = T0) -> ConfigReloaded:
    return ConfigReloaded(at=at, config_path="gateway.toml", config=config)


# --- compute_status (§2.2) -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failures", "threshold", "status"),
    [
        (0, 3, Health.HEALTHY),
        (1, 3, Health.DEGRADED),
        (2, 3, Health.DEGRADED),
        (3, 3, Health.DEAD),
        (4, 3, Health.DEAD),
        (1, 1, Health.DEAD),
        (1, 2, Health.DEGRADED),
        (0, 0, Health.DEAD),
        (1, 0, Health.DEAD),
        (0, 5, Health.HEALTHY),
        (1, 5, Health.HEALTHY),
        (2, 5, Health.DEGRADED),
        (3, 5, Health.DEGRADED),
        (4, 5, Health.DEGRADED),
        (5, 5, Health.DEAD),
    ],
)
def test_compute_status_pinned_cases(failures, threshold, status):
    assert compute_status(failures, threshold) == status


# --- next_discovery (§8.2) ---------------------------------------------------------------------

EARLIER, NOW = 10.0, 20.0
LIST = ("m1", "m2")
REORDERED = ("m2", "m1")  # the same ids in another order: a different list (compared in order)
EMPTY = ()
ERROR = None  # a failed fetch (its error text is "boom")


def record(state=Discovery.UNTRIED, names=None, fetched_at=None, fails=0, empties=0, last_error="") -> ModelDiscovery:
    return ModelDiscovery(
        state=state, names=names, fetched_at=fetched_at, fails=fails, empties=empties, last_error=last_error,
        digest=listing_digest(names, (), ()) if names else "",
    )  # fmt: skip


def outcome(before: ModelDiscovery, names, threshold: int = 3) -> tuple[ModelDiscovery, bool]:
    return next_discovery(before, names, "boom" if names is None else "", threshold, NOW)


KNOWN_RECORD = record(Discovery.KNOWN, LIST, EARLIER)
KNOWN_EMPTY_RECORD = record(Discovery.KNOWN_EMPTY, None, EARLIER, empties=2)
DEGRADED_RECORD = record(Discovery.DEGRADED, LIST, EARLIER, fails=1, last_error="old")
EXPIRED_RECORD = record(Discovery.EXPIRED, LIST, EARLIER, fails=3, last_error="old")

# (before, fetch outcome, N, after, list changed). An untried or known_empty record has no list,
# so "same list again" and "different list" only apply to known, degraded and expired.
APPLY_RESULT_CASES = [
    # untried
    pytest.param(record(), ERROR, 3, record(fails=1, last_error="boom"), False, id="untried-error-below-N"),
    pytest.param(
        record(fails=2, last_error="old"), ERROR, 3, record(Discovery.EXPIRED, fails=3, last_error="boom"), False,
        id="untried-error-reaching-N",
    ),
    pytest.param(record(), LIST, 3, record(Discovery.KNOWN, LIST, NOW), True, id="untried-non-empty-success"),
    pytest.param(
        record(fails=2, last_error="old"), LIST, 3, record(Discovery.KNOWN, LIST, NOW), True, id="untried-success-after-errors"
    ),
    pytest.param(record(), EMPTY, 3, record(fetched_at=NOW, empties=1), False, id="untried-first-empty"),
    pytest.param(
        record(fetched_at=EARLIER, empties=1), EMPTY, 3, record(Discovery.KNOWN_EMPTY, None, NOW, empties=2), False,
        id="untried-second-empty",
    ),
    # known
    pytest.param(
        KNOWN_RECORD, ERROR, 3, record(Discovery.DEGRADED, LIST, EARLIER, fails=1, last_error="boom"), False,
        id="known-error-below-N",
    ),
    pytest.param(
        KNOWN_RECORD, ERROR, 1, record(Discovery.EXPIRED, LIST, EARLIER, fails=1, last_error="boom"), False,
        id="known-error-reaching-N",
    ),
    pytest.param(
        KNOWN_RECORD, ERROR, 0, record(Discovery.DEGRADED, LIST, EARLIER, fails=1, last_error="boom"), False,
        id="known-error-N-zero-never-expires",
    ),
    pytest.param(KNOWN_RECORD, ("m3",), 3, record(Discovery.KNOWN, ("m3",), NOW), True, id="known-non-empty-success"),
    pytest.param(KNOWN_RECORD, LIST, 3, record(Discovery.KNOWN, LIST, NOW), False, id="known-same-list-again"),
    pytest.param(KNOWN_RECORD, REORDERED, 3, record(Discovery.KNOWN, REORDERED, NOW), True, id="known-different-list"),
    pytest.param(KNOWN_RECORD, ("m1",), 3, record(Discovery.KNOWN, ("m1",), NOW), True, id="known-shorter-list"),
    pytest.param(KNOWN_RECORD, EMPTY, 3, record(Discovery.KNOWN, LIST, NOW, empties=1), False, id="known-first-empty"),
    pytest.param(
        record(Discovery.KNOWN, LIST, EARLIER, empties=1), EMPTY, 3, record(Discovery.KNOWN_EMPTY, None, NOW, empties=2), True,
        id="known-second-empty",
    ),
    # known_empty
    pytest.param(
        KNOWN_EMPTY_RECORD, ERROR, 3, record(Discovery.KNOWN_EMPTY, None, EARLIER, fails=1, last_error="boom"), False,
        id="known_empty-error-below-N",
    ),
    pytest.param(
        record(Discovery.KNOWN_EMPTY, None, EARLIER, fails=2, last_error="old"), ERROR, 3,
        record(Discovery.EXPIRED, None, EARLIER, fails=3, last_error="boom"), False,
        id="known_empty-error-reaching-N",
    ),
    pytest.param(KNOWN_EMPTY_RECORD, LIST, 3, record(Discovery.KNOWN, LIST, NOW), True, id="known_empty-non-empty-success"),
    pytest.param(
        record(Discovery.KNOWN_EMPTY, None, EARLIER, fails=1, last_error="old"), EMPTY, 3,
        record(Discovery.KNOWN_EMPTY, None, NOW, empties=1), False,
        id="known_empty-first-empty",
    ),
    pytest.param(
        KNOWN_EMPTY_RECORD, EMPTY, 3, record(Discovery.KNOWN_EMPTY, None, NOW, empties=3), False, id="known_empty-second-empty"
    ),
    # degraded
    pytest.param(
        DEGRADED_RECORD, ERROR, 3, record(Discovery.DEGRADED, LIST, EARLIER, fails=2, last_error="boom"), False,
        id="degraded-error-below-N",
    ),
    pytest.param(
        record(Discovery.DEGRADED, LIST, EARLIER, fails=2, last_error="old"), ERROR, 3,
        record(Discovery.EXPIRED, LIST, EARLIER, fails=3, last_error="boom"), False,
        id="degraded-error-reaching-N",
    ),
    pytest.param(DEGRADED_RECORD, LIST, 3, record(Discovery.KNOWN, LIST, NOW), False, id="degraded-same-list-again"),
    pytest.param(DEGRADED_RECORD, REORDERED, 3, record(Discovery.KNOWN, REORDERED, NOW), True, id="degraded-different-list"),
    pytest.param(
        DEGRADED_RECORD, EMPTY, 3, record(Discovery.DEGRADED, LIST, NOW, empties=1), False, id="degraded-first-empty"
    ),
    pytest.param(
        record(Discovery.DEGRADED, LIST, EARLIER, empties=1), EMPTY, 3, record(Discovery.KNOWN_EMPTY, None, NOW, empties=2),
        True,
        id="degraded-second-empty",
    ),
    # expired (below N only after a reload raised the threshold)
    pytest.param(
        EXPIRED_RECORD, ERROR, 5, record(Discovery.EXPIRED, LIST, EARLIER, fails=4, last_error="boom"), False,
        id="expired-error-below-N",
    ),
    pytest.param(
        EXPIRED_RECORD, ERROR, 3, record(Discovery.EXPIRED, LIST, EARLIER, fails=4, last_error="boom"), False,
        id="expired-error-reaching-N",
    ),
    pytest.param(
        record(Discovery.EXPIRED, None, None, fails=3), LIST, 3, record(Discovery.KNOWN, LIST, NOW), True, id="expired-non-empty-success"
    ),
    pytest.param(EXPIRED_RECORD, LIST, 3, record(Discovery.KNOWN, LIST, NOW), False, id="expired-same-list-again"),
    pytest.param(EXPIRED_RECORD, REORDERED, 3, record(Discovery.KNOWN, REORDERED, NOW), True, id="expired-different-list"),
    pytest.param(EXPIRED_RECORD, EMPTY, 3, record(Discovery.EXPIRED, LIST, NOW, empties=1), False, id="expired-first-empty"),
    pytest.param(
        record(Discovery.EXPIRED, LIST, EARLIER, empties=1), EMPTY, 3, record(Discovery.KNOWN_EMPTY, None, NOW, empties=2), True,
        id="expired-second-empty",
    ),
]


@pytest.mark.parametrize(("before", "names", "threshold", "after", "changed"), APPLY_RESULT_CASES)
def test_next_discovery_transition(before, names, threshold, after, changed):
    assert outcome(before, names, threshold) == (after, changed)


def walk(outcomes, start: ModelDiscovery = ModelDiscovery(), threshold: int = 3) -> list[ModelDiscovery]:
    """The record after each fetch outcome in turn."""
    records, current = [], start
    for names in outcomes:
        current, _ = outcome(current, names, threshold)
        records.append(current)
    return records


def test_untried_stays_untried_through_failures_until_n_then_expires():
    assert [r.state for r in walk([ERROR] * 4)] == [Discovery.UNTRIED, Discovery.UNTRIED, Discovery.EXPIRED, Discovery.EXPIRED]


def test_one_empty_while_untried_stays_untried_but_sets_fetched_at():
    (after,) = walk([EMPTY])
    assert (after.state, after.names, after.fetched_at) == (Discovery.UNTRIED, None, NOW)
    assert after.allows("anything")


def test_one_empty_after_known_keeps_the_old_list():
    _, after = walk([LIST, EMPTY])
    assert (after.state, after.names) == (Discovery.KNOWN, LIST)
    assert after.allows("m1") and not after.allows("m3")


def test_known_empty_ignores_failures_until_n_then_expires():
    records = walk([EMPTY, EMPTY, ERROR, ERROR, ERROR])
    assert [r.state for r in records] == [Discovery.UNTRIED, Discovery.KNOWN_EMPTY, Discovery.KNOWN_EMPTY, Discovery.KNOWN_EMPTY, Discovery.EXPIRED]


def test_expired_plus_one_empty_success_stays_expired_with_fails_reset():
    *_, expired, after = walk([LIST, ERROR, ERROR, ERROR, EMPTY])
    assert (expired.state, expired.fails) == (Discovery.EXPIRED, 3)
    assert (after.state, after.fails, after.names, after.last_error) == (Discovery.EXPIRED, 0, LIST, "")
    assert not after.allows("m1")


@pytest.mark.parametrize("start", [KNOWN_RECORD, DEGRADED_RECORD], ids=["known", "degraded"])
def test_known_or_degraded_failing_at_n_expires_keeping_names(start):
    records = walk([ERROR] * 3, start=start)
    expired = next(r for r in records if r.state == Discovery.EXPIRED)
    assert expired.fails == 3 and expired.names == LIST and expired.fetched_at == EARLIER


def test_degraded_success_is_known():
    (after,) = walk([LIST], start=DEGRADED_RECORD)
    assert after == record(Discovery.KNOWN, LIST, NOW)


# allows / exclusion_reason / age / settled per state (§8.1)

NEVER_FETCHED = record()
FETCHED_EMPTY_ONCE = record(fetched_at=EARLIER, empties=1)


@pytest.mark.parametrize(
    ("discovery", "model", "allowed", "reason"),
    [
        (NEVER_FETCHED, "anything", True, ""),
        (FETCHED_EMPTY_ONCE, "anything", True, ""),
        (KNOWN_RECORD, "m1", True, ""),
        (KNOWN_RECORD, "M1", False, "missing"),  # exact, case-sensitive
        (KNOWN_RECORD, "m3", False, "missing"),
        (DEGRADED_RECORD, "m2", True, ""),
        (DEGRADED_RECORD, "m3", False, "missing"),
        (KNOWN_EMPTY_RECORD, "m1", False, "empty"),
        (EXPIRED_RECORD, "m1", False, "expired"),  # even though the names are kept
        (record(Discovery.EXPIRED, fails=3), "m1", False, "expired"),
    ],
)
def test_allows_and_exclusion_reason(discovery, model, allowed, reason):
    assert discovery.allows(model) is allowed
    assert discovery.exclusion_reason(model) == reason


@pytest.mark.parametrize(
    ("discovery", "age", "settled"),
    [
        (NEVER_FETCHED, None, False),
        (FETCHED_EMPTY_ONCE, 15.0, False),
        (KNOWN_RECORD, 15.0, True),
        (KNOWN_EMPTY_RECORD, 15.0, True),
        (DEGRADED_RECORD, 15.0, False),
        (EXPIRED_RECORD, 15.0, False),
        (record(Discovery.EXPIRED, fails=3), None, False),
    ],
)
def test_age_and_settled(discovery, age, settled):
    # plinth's age() is 0 when never fetched and /health shows null; Interlock returns None.
    assert discovery.age(EARLIER + 15.0) == age
    assert discovery.settled() is settled


# --- model discovery through reduce: the transition logs (§8.4-§8.6) ---------------------------

DISCOVERY_LEVELS = {
    "models discovered": "info",
    "model discovery recovered": "info",
    "node reports no models": "warn",
    "model discovery failed": "warn",
    "model discovery expired": "error",
    "node model list changed": "info",
    "configured model not served by node": "warn",
}
DISCOVERED = "models discovered"
RECOVERED = "model discovery recovered"
NO_MODELS = "node reports no models"
FAILED = "model discovery failed"
EXPIRED_MSG = "model discovery expired"
CHANGED = "node model list changed"
NOT_SERVED = "configured model not served by node"

ONE_NODE_TWO_MODELS = make_config(1, models=[ModelEntry(name="m1"), ModelEntry(name="m2")])


@pytest.mark.parametrize(
    ("setup", "last", "expected"),
    [
        pytest.param([], LIST, [DISCOVERED, CHANGED], id="untried-to-known"),
        pytest.param([], ERROR, [], id="untried-error"),
        pytest.param([ERROR, ERROR], ERROR, [EXPIRED_MSG], id="untried-to-expired"),
        pytest.param([], EMPTY, [], id="untried-first-empty"),
        pytest.param([EMPTY], EMPTY, [NO_MODELS], id="untried-to-known_empty"),
        pytest.param([LIST], LIST, [], id="known-same-list"),
        pytest.param([LIST], REORDERED, [CHANGED], id="known-different-list"),
        pytest.param([LIST], ERROR, [FAILED], id="known-to-degraded"),
        pytest.param([LIST], EMPTY, [], id="known-first-empty"),
        pytest.param([LIST, EMPTY], EMPTY, [NO_MODELS, CHANGED, NOT_SERVED, NOT_SERVED], id="known-to-known_empty"),
        pytest.param([LIST, ERROR], ERROR, [], id="degraded-error"),
        pytest.param([LIST, ERROR], LIST, [RECOVERED], id="degraded-to-known-same-list"),
        pytest.param([LIST, ERROR], REORDERED, [RECOVERED, CHANGED], id="degraded-to-known-different-list"),
        pytest.param([LIST, ERROR, ERROR], ERROR, [EXPIRED_MSG], id="degraded-to-expired"),
        pytest.param([LIST, ERROR], EMPTY, [], id="degraded-first-empty"),
        pytest.param(
            [LIST, ERROR, EMPTY], EMPTY, [NO_MODELS, CHANGED, NOT_SERVED, NOT_SERVED], id="degraded-to-known_empty"
        ),
        pytest.param([EMPTY, EMPTY], EMPTY, [], id="known_empty-empty-again"),
        pytest.param([EMPTY, EMPTY], ERROR, [], id="known_empty-error"),
        pytest.param([EMPTY, EMPTY, ERROR, ERROR], ERROR, [EXPIRED_MSG], id="known_empty-to-expired"),
        pytest.param([EMPTY, EMPTY], LIST, [RECOVERED, CHANGED], id="known_empty-to-known"),
        pytest.param([ERROR] * 3, ERROR, [], id="expired-error"),
        pytest.param([ERROR] * 3, EMPTY, [], id="expired-first-empty"),
        pytest.param([ERROR] * 3 + [EMPTY], EMPTY, [NO_MODELS], id="expired-without-list-to-known_empty"),
        pytest.param(
            [LIST] + [ERROR] * 3 + [EMPTY], EMPTY, [NO_MODELS, CHANGED, NOT_SERVED, NOT_SERVED],
            id="expired-with-list-to-known_empty",
        ),
        pytest.param([ERROR] * 3, LIST, [RECOVERED, CHANGED], id="expired-without-list-to-known"),
        pytest.param([LIST] + [ERROR] * 3, LIST, [RECOVERED], id="expired-to-known-same-list"),
    ],
)
def test_discovery_transition_logs(setup, last, expected):
    state, _, _ = apply([listing(names, at=T0 + i) for i, names in enumerate(setup)], started(ONE_NODE_TWO_MODELS))
    _, transitions, _ = apply([listing(last, at=T0 + 100)], state)
    assert messages(transitions) == expected
    for transition in transitions:
        assert (transition.kind, transition.node, transition.level) == (MODELS, NODE, DISCOVERY_LEVELS[transition.msg])
        assert fields(transition)["node"] == NODE


def test_discovery_logs_once_per_transition_over_a_long_walk():
    """Each outcome repeated: only the first of a run of identical outcomes may log."""
    walk_events = [LIST] * 3 + [ERROR] * 2 + [LIST] * 2 + [EMPTY] * 4 + [REORDERED] * 3 + [ERROR] * 5
    _, transitions, _ = apply([listing(n, at=T0 + i) for i, n in enumerate(walk_events)], started(ONE_NODE_TWO_MODELS))
    assert messages(transitions) == [
        DISCOVERED, CHANGED,
        FAILED,
        RECOVERED,
        NO_MODELS, CHANGED, NOT_SERVED, NOT_SERVED,
        RECOVERED, CHANGED,
        FAILED,
        EXPIRED_MSG,
    ]  # fmt: skip


def test_discovery_failure_and_expiry_carry_the_error_text():
    state, transitions, _ = apply(
        [listing(LIST), ModelsListed(at=T0, node=NODE, error="models endpoint returned status 500")],
        started(ONE_NODE_TWO_MODELS),
    )
    assert fields(transitions[-1]) == {"node": NODE, "error": "models endpoint returned status 500"}
    _, transitions, _ = apply([ModelsListed(at=T0, node=NODE, error="timed out")] * 2, state)
    assert (transitions[-1].msg, fields(transitions[-1])["error"]) == (EXPIRED_MSG, "timed out")


def test_listing_never_touches_health():
    state, _, _ = apply([listing(ERROR, at=T0 + i) for i in range(5)], started())
    node = state.nodes[NODE]
    assert (node.status, node.consecutive_failures, node.last_check) == (Health.HEALTHY, 0, None)
    assert node.models.state == Discovery.EXPIRED


# a listing the state holds, recorded by its digest (issue 37)


@pytest.mark.parametrize(
    "setup",
    [
        pytest.param([LIST], id="known"),
        pytest.param([LIST, ERROR], id="degraded"),
        pytest.param([LIST, ERROR, ERROR, ERROR], id="expired"),
        pytest.param([LIST, EMPTY], id="one-empty"),
    ],
)
def test_an_unchanged_listing_by_its_digest_is_applied_as_the_list_again(setup):
    state, _, _ = apply([listing(names, at=T0 + index) for index, names in enumerate(setup)], started())
    again = listing(LIST, at=T0 + 10)
    assert again.digest() == state.nodes[NODE].models.digest == listing_digest(LIST, (), ())
    by_list, by_list_transitions, by_list_effects = apply([again], state)
    by_digest, by_digest_transitions, by_digest_effects = apply(
        [ModelsUnchanged(at=T0 + 10, node=NODE, digest=again.digest())], state
    )
    assert by_digest.nodes[NODE] == by_list.nodes[NODE]
    assert [t.log_line() for t in by_digest_transitions] == [t.log_line() for t in by_list_transitions]
    assert by_digest_effects == by_list_effects


def test_an_unchanged_listing_of_another_list_is_ignored_with_a_warning():
    state, _, _ = apply([listing(LIST)], started())
    after, transitions, _ = apply([ModelsUnchanged(at=T0 + 1, node=NODE, digest=listing_digest(REORDERED, (), ()))], state)
    assert after.nodes[NODE] == state.nodes[NODE]
    [warning] = transitions
    assert (warning.level, warning.msg) == ("warn", "unchanged model listing of another list ignored")


# configured model not served by node (§8.5)

RING_NODES = [
    NodeConfig(ip=node_ip(1), name="standalone"),
    NodeConfig(ip=node_ip(2), name="ring-a-node", ring="a"),
    NodeConfig(ip=node_ip(3), name="ring-b-node", ring="b"),
]
RING_MODELS = [
    ModelEntry(name="plain"),
    ModelEntry(name="big-a", ring="a"),
    ModelEntry(name="big-b", ring="b"),
    ModelEntry(name=""),  # a nameless entry is never checked
]


def not_served(transitions) -> list[str]:
    warned = [t for t in transitions if t.msg == NOT_SERVED]
    for transition in warned:
        assert transition.level == "warn"
    return [fields(t)["model"] for t in warned]


@pytest.mark.parametrize(
    ("default", "node", "served", "expected"),
    [
        pytest.param("", 1, ["x"], ["plain"], id="ring-less-model-on-ring-less-node"),
        pytest.param("", 2, ["x"], ["big-a"], id="ring-model-on-its-ring"),
        pytest.param("", 3, ["x"], ["big-b"], id="other-ring"),
        pytest.param("", 2, ["big-a", "x"], [], id="served"),
        pytest.param("big-a", 2, ["x"], ["big-a"], id="available-default-once-via-its-ring"),
        pytest.param("big-a", 3, ["x"], ["big-b"], id="available-default-not-checked-off-its-ring"),
        pytest.param("plain", 2, ["x"], ["big-a"], id="available-ring-less-default-not-checked-on-ring-node"),
        pytest.param("extra", 1, ["x"], ["plain", "extra"], id="unlisted-default-on-ring-less-node"),
        pytest.param("extra", 3, ["x"], ["big-b", "extra"], id="unlisted-default-regardless-of-ring"),
        pytest.param("extra", 3, ["extra"], ["big-b"], id="unlisted-default-served"),
    ],
)
def test_configured_model_not_served_rules(default, node, served, expected):
    config = make_config(RING_NODES, models=RING_MODELS, default=default)
    _, transitions, _ = apply([listing(served, node=node_ip(node))], started(config))
    assert not_served(transitions) == expected
    assert all(fields(t)["node"] == node_ip(node) for t in transitions)
    assert configured_models_missing(config.nodes[node - 1].ring, tuple(served), config) == expected


def test_configured_model_warnings_once_per_list_change():
    config = make_config(RING_NODES, models=RING_MODELS, default="extra")
    state = started(config)
    per_event = []
    for names in [["x"], ["x"], ERROR, ["x"], ["y"], EMPTY, EMPTY, EMPTY]:
        state, transitions, _ = apply([listing(names)], state)
        per_event.append(not_served(transitions))
    assert per_event == [["plain", "extra"], [], [], [], ["plain", "extra"], [], ["plain", "extra"], []]


# full log lines


def test_discovery_log_lines_are_plinth_json():
    state = started(ONE_NODE_TWO_MODELS)  # seq 1; the listings are seq 2 and 3
    _, transitions, _ = apply([listing(["m1"], at=T0 + 1.7), listing(ERROR, at=T0 + 3)], state)
    lines = [json.loads(t.log_line()) for t in transitions]
    assert lines == [
        {"timestamp": "2026-01-02T03:04:06Z", "level": "info", "msg": DISCOVERED, "node": NODE, "models": "m1", "seq": "2"},
        {"timestamp": "2026-01-02T03:04:06Z", "level": "info", "msg": CHANGED, "node": NODE, "models": "m1", "seq": "2"},
        {"timestamp": "2026-01-02T03:04:06Z", "level": "warn", "msg": NOT_SERVED, "node": NODE, "model": "m2", "seq": "2"},
        {
            "timestamp": "2026-01-02T03:04:08Z", "level": "warn", "msg": FAILED, "node": NODE,
            "error": "connection refused", "seq": "3",
        },
    ]  # fmt: skip
    # Exact bytes: keys sorted, compact, every value a string.
    assert transitions[2].log_line() == (
        '{"level":"warn","model":"m2","msg":"configured model not served by node",'
        '"node":"10.0.0.1","seq":"2","timestamp":"2026-01-02T03:04:06Z"}'
    )


def test_expiry_and_health_log_lines_are_plinth_json():
    state = started(make_config(1, threshold=1))
    _, transitions, _ = apply([listing(ERROR, at=T0 + 60), probe(False, at=T0 + 61, error="dial tcp: refused")], state)
    assert [t.log_line() for t in transitions] == [
        '{"error":"connection refused","level":"error","msg":"model discovery expired",'
        '"node":"10.0.0.1","seq":"2","timestamp":"2026-01-02T03:05:05Z"}',
        '{"error":"dial tcp: refused","failures":"1","from":"healthy","level":"error","msg":"node health changed",'
        '"node":"10.0.0.1","seq":"3","timestamp":"2026-01-02T03:05:06Z","to":"dead"}',
    ]


# --- health through reduce (§2.2, §2.3) -----------------------------------------------------


def test_health_failures_count_up_and_log_once_per_status_change():
    state = started()
    observed = []
    for i, ok in enumerate([False, False, False, False, True, True]):
        state, transitions, _ = apply([probe(ok, at=T0 + i)], state)
        node = state.nodes[NODE]
        observed.append((node.consecutive_failures, node.status, [(t.level, fields(t)) for t in transitions]))
    change = {"node": NODE, "error": "health endpoint returned status 503"}
    assert observed == [
        (1, Health.DEGRADED, [("warn", {**change, "from": Health.HEALTHY, "to": Health.DEGRADED, "failures": "1"})]),
        (2, Health.DEGRADED, []),
        (3, Health.DEAD, [("error", {**change, "from": Health.DEGRADED, "to": Health.DEAD, "failures": "3"})]),
        (4, Health.DEAD, []),
        (0, Health.HEALTHY, [("info", {"node": NODE, "from": Health.DEAD, "to": Health.HEALTHY, "failures": "0"})]),
        (0, Health.HEALTHY, []),
    ]


@pytest.mark.parametrize("threshold", [1, 2, 3, 5])
def test_health_status_follows_compute_status(threshold):
    state = started(make_config(2, threshold=threshold))
    changes = 0
    for failures in range(1, threshold + 2):
        before = state.nodes[NODE].status
        state, transitions, _ = apply([probe(False, at=T0 + failures)], state)
        node = state.nodes[NODE]
        assert (node.consecutive_failures, node.status) == (failures, compute_status(failures, threshold))
        assert messages(transitions) == (["node health changed"] if node.status != before else [])
        assert all(t.kind == HEALTH for t in transitions)
        changes += len(transitions)
    assert changes == len({compute_status(f, threshold) for f in range(0, threshold + 2)}) - 1
    assert state.nodes[node_ip(2)] == NodeState.fresh(make_config(2).nodes[1])


def test_probe_error_text_prefers_the_transport_error():
    _, transitions, _ = apply([HealthProbed(at=T0, node=NODE, ok=False, error="connection refused")], started())
    assert fields(transitions[0])["error"] == "connection refused"


def test_last_check_is_the_probe_time_ok_or_not():
    state, _, _ = apply([probe(True, at=T0 + 3)], started())
    assert state.nodes[NODE].last_check == T0 + 3
    state, _, _ = apply([probe(False, at=T0 + 6.5)], state)
    assert state.nodes[NODE].last_check == T0 + 6.5


def test_probe_crash_logs_and_leaves_the_node_alone():
    state, _, _ = apply([probe(False, at=T0 + 3)], started())
    after, transitions, effects = apply([ProbeCrashed(at=T0 + 6, node=NODE, error="boom")], state)
    assert after.nodes == state.nodes
    assert after.nodes[NODE].last_check == T0 + 3
    assert effects == []
    assert [(t.kind, t.level, t.msg, fields(t)) for t in transitions] == [
        (HEALTH, "error", "health check panicked", {"node": NODE, "panic": "boom"})
    ]


GPU_A = GpuSample(uuid="GPU-a", memory_used=1, memory_total=2, utilization=3, temperature=40)
GPU_B = GpuSample(uuid="GPU-b")


def test_gpu_scrape_replaces_gpus_only_when_it_found_some():
    state, transitions, _ = apply([GpuScraped(at=T0, node=NODE, gpus=(GPU_A, GPU_B))], started())
    assert state.nodes[NODE].gpus == (GPU_A, GPU_B)
    assert transitions == []
    state, _, _ = apply([GpuScraped(at=T0 + 3, node=NODE, gpus=(), error="status 500")], state)
    assert state.nodes[NODE].gpus == (GPU_A, GPU_B)
    state, _, _ = apply([GpuScraped(at=T0 + 6, node=NODE, gpus=(GPU_B,))], state)
    assert state.nodes[NODE].gpus == (GPU_B,)
    assert (state.nodes[NODE].last_check, state.nodes[NODE].status) == (None, Health.HEALTHY)


# --- load (the load-aware policies' scrape of vLLM /metrics) -------------------------------------


def load_scrape(running: float | None, waiting: float | None = 0.0, at: float = T0, error: str = "") -> LoadScraped:
    return LoadScraped(at=at, node=NODE, running=running, waiting=waiting, kv_cache_usage=0.5, error=error)


def test_a_load_scrape_sets_the_nodes_load_and_a_failed_one_makes_it_unknown_without_touching_health():
    state, transitions, _ = apply([load_scrape(3.0, 2.0)], started())
    load = state.nodes[NODE].load
    assert (load.known, load.running, load.waiting, load.kv_cache_usage, load.scraped_at) == (True, 3.0, 2.0, 0.5, T0)
    assert load.queued == 5.0 and transitions == []
    state, transitions, _ = apply([load_scrape(None, error="status 404", at=T0 + 2)] * 2, state)
    load = state.nodes[NODE].load
    assert (load.known, load.fails, load.last_error, load.running, load.scraped_at) == (False, 2, "status 404", 3.0, T0)
    assert [(t.kind, t.level, t.msg, fields(t)) for t in transitions] == [
        ("load", "warn", "node load unknown", {"node": NODE, "error": "status 404"})
    ]  # once per streak of failures
    assert state.nodes[NODE].status == Health.HEALTHY
    state, transitions, _ = apply([load_scrape(1.0, at=T0 + 4)], state)
    assert state.nodes[NODE].load.known and state.nodes[NODE].load.fails == 0
    assert [(t.msg, fields(t)) for t in transitions] == [("node load known again", {"node": NODE})]


def test_a_scrape_without_the_gauges_is_a_failed_one():
    state, transitions, _ = apply([load_scrape(None, None)], started())
    assert not state.nodes[NODE].load.known
    assert [fields(t)["error"] for t in transitions] == ["load metrics missing"]


def token_scrape(token_seconds: float | None, tokens: float | None, at: float) -> LoadScraped:
    return LoadScraped(at=at, node=NODE, running=1.0, waiting=0.0, token_seconds=token_seconds, tokens=tokens)


def test_a_nodes_time_between_tokens_is_the_mean_over_the_last_interval_that_counted_tokens():
    def speeds(*scrapes: LoadScraped) -> list[float | None]:
        state, seen = started(), []
        for scrape in scrapes:
            state, _, _ = apply([scrape], state)
            seen.append(state.nodes[NODE].load.seconds_per_token)
        return seen

    assert speeds(
        token_scrape(10.0, 100, T0),  # counters since the node started: no interval yet
        token_scrape(12.0, 200, T0 + 1),  # 2 s over 100 tokens
        token_scrape(12.0, 200, T0 + 2),  # idle: no tokens, the last mean stays
        token_scrape(18.0, 300, T0 + 3),
        LoadScraped(at=T0 + 4, node=NODE, error="status 500"),  # a failed scrape keeps it
        token_scrape(19.0, 310, T0 + 5),  # counted from the last scrape that had the counters
        token_scrape(0.5, 10, T0 + 6),  # the counters went back: the node restarted
        token_scrape(0.9, 20, T0 + 7),
        token_scrape(None, None, T0 + 8),  # the node no longer exports the histogram
        token_scrape(5.0, 100, T0 + 9),
    ) == [None, 0.02, 0.02, 0.06, 0.06, 0.1, 0.1, pytest.approx(0.04), None, None]


# --- run start and reload (§2.3 NewMonitorWithState, §7) ---------------------------------------


def test_run_started_builds_fresh_nodes_and_starts_probing():
    config = make_config([NodeConfig(ip="10.0.0.2", name="b"), NodeConfig(ip="10.0.0.10", name="c", ring="r")])
    state, transitions, effects = apply([run_started(config)])
    assert (state.seq, state.at, state.version, state.config_path, state.config) == (
        1, T0, "test", "gateway.toml", config,
    )  # fmt: skip
    assert list(state.nodes) == ["10.0.0.10", "10.0.0.2"]  # plain string order
    assert state.nodes["10.0.0.10"] == NodeState(ip="10.0.0.10", name="c", ring="r")
    assert set(effects) == {StartProbing("10.0.0.2"), StartProbing("10.0.0.10")}
    assert messages(transitions) == ["starting gateway", "config loaded"]


def reload_setup():
    """Three nodes with health, discovery, GPUs and the skip-set all away from their defaults."""
    state = started()
    state, _, _ = apply(
        [
            probe(False, at=T0 + 1),
            probe(False, at=T0 + 2),
            listing(LIST, at=T0 + 3),
            listing(ERROR, at=T0 + 4),
            GpuScraped(at=T0 + 5, node=NODE, gpus=(GPU_A,)),
            UpstreamFailed(at=T0 + 6, node=NODE, error="refused"),
            listing(ERROR, at=T0 + 7, node=node_ip(2)),
            probe(True, at=T0 + 8, node=node_ip(3)),
        ],
        state,
    )
    return state


def test_reload_carries_health_discovery_and_offline_for_kept_ips():
    before = reload_setup()
    old = before.nodes[NODE]
    assert (old.status, old.consecutive_failures, old.models.state, old.gpus) == (Health.DEGRADED, 2, Discovery.DEGRADED, (GPU_A,))
    new_config = make_config(
        [
            NodeConfig(ip=node_ip(1), name="renamed", ring="a"),
            NodeConfig(ip=node_ip(2), name="node-2"),
            NodeConfig(ip=node_ip(4), name="new"),
        ],
        models=[ModelEntry(name="big", ring="a")],
    )
    after, transitions, effects = apply([ConfigReloaded(at=T0 + 9, config_path="new.toml", config=new_config)], before)

    assert after.nodes[NODE] == NodeState(
        ip=NODE,
        name="renamed",
        ring="a",
        status=Health.DEGRADED,
        consecutive_failures=2,
        models=old.models,  # every field: state, names, fetched_at, fails, empties, last_error
        offline_until=T0 + 6 + OFFLINE_SECONDS,
    )  # GPUs and last_check are not carried
    assert after.nodes[node_ip(2)].models == before.nodes[node_ip(2)].models
    assert after.nodes[node_ip(4)] == NodeState(ip=node_ip(4), name="new")
    assert list(after.nodes) == [node_ip(1), node_ip(2), node_ip(4)]
    assert set(effects) == {StartProbing(node_ip(4)), StopProbing(node_ip(3))}
    assert (after.config, after.config_path, after.version) == (new_config, "new.toml", "test")
    assert [(t.level, t.msg, fields(t)) for t in transitions] == [
        ("info", "config reloaded", {"nodes": "3", "models": "1"})
    ]


def test_reload_warns_about_settings_that_need_a_restart():
    before = started()
    changed = make_config(
        listen=":8001", metrics_listen="127.0.0.1:9191", event_log="var/events.jsonl", event_log_max_bytes=1024
    )
    _, transitions, effects = apply([reload(changed)], before)
    assert [(t.level, t.msg, fields(t)) for t in transitions] == [
        ("warn", "gateway.listen changed; requires restart", {"old": ":8000", "new": ":8001"}),
        ("warn", "gateway.metrics_listen changed; requires restart", {"old": ":9090", "new": "127.0.0.1:9191"}),
        ("warn", "gateway.event_log changed; requires restart", {"old": "", "new": "var/events.jsonl"}),
        ("warn", "gateway.event_log_max_bytes changed; requires restart", {"old": "67108864", "new": "1024"}),
        ("info", "config reloaded", {"nodes": "3", "models": "0"}),
    ]
    assert effects == []


def test_reload_of_the_same_config_changes_only_gpus_and_last_check():
    before = reload_setup()
    after, transitions, effects = apply([reload(before.config, at=T0 + 9)], before)
    for ip, node in before.nodes.items():
        assert after.nodes[ip] == msgspec.structs.replace(node, gpus=(), last_check=None)
    assert messages(transitions) == ["config reloaded"] and effects == []


def test_reload_rejected_logs_and_changes_nothing():
    before = reload_setup()
    after, transitions, effects = apply(
        [ReloadRejected(at=T0 + 9, config_path="gateway.toml", error="nodes: at least one node must be configured")],
        before,
    )
    assert after == msgspec.structs.replace(before, seq=before.seq + 1, at=T0 + 9)
    assert effects == []
    assert [t.log_line() for t in transitions] == [
        '{"error":"nodes: at least one node must be configured","level":"error",'
        '"msg":"config reload failed; keeping current config","seq":"10","timestamp":"2026-01-02T03:04:14Z"}'
    ]


# --- the offline skip-set (§4.3) ---------------------------------------------------------------


def test_upstream_failure_marks_offline_once_with_one_recheck():
    state = started()
    state, transitions, effects = apply([UpstreamFailed(at=T0, node=NODE, error="connection refused")], state)
    assert state.nodes[NODE].offline_until == T0 + OFFLINE_SECONDS == T0 + 10
    assert effects == [Recheck(NODE)]
    assert [(t.kind, t.msg, fields(t)) for t in transitions] == [
        ("offline", "node marked offline", {"node": NODE, "error": "connection refused", "seconds": "10"})
    ]

    again, transitions, effects = apply([UpstreamFailed(at=T0 + 9.9, node=NODE, error="refused again")], state)
    assert again == msgspec.structs.replace(state, seq=state.seq + 1, at=T0 + 9.9)
    assert (transitions, effects) == ([], [])

    expired, _, effects = apply([UpstreamFailed(at=T0 + 10, node=NODE, error="still refused")], state)
    assert expired.nodes[NODE].offline_until == T0 + 20
    assert effects == [Recheck(NODE)]


def test_upstream_recovery_clears_offline():
    state, _, _ = apply([UpstreamFailed(at=T0, node=NODE, error="refused")], started())
    recovered, transitions, effects = apply([UpstreamRecovered(at=T0 + 1, node=NODE)], state)
    assert recovered.nodes[NODE].offline_until is None
    assert messages(transitions) == ["node back online"] and effects == []
    # Once cleared, the next failure marks the node again at once.
    _, _, effects = apply([UpstreamFailed(at=T0 + 2, node=NODE, error="refused")], recovered)
    assert effects == [Recheck(NODE)]


def test_upstream_recovery_of_an_online_node_changes_nothing():
    state = started()
    after, transitions, effects = apply([UpstreamRecovered(at=T0 + 1, node=NODE)], state)
    assert after.nodes == state.nodes and (transitions, effects) == ([], [])


def test_is_offline_boundaries():
    node = NodeState(ip=NODE, offline_until=100.0)
    assert node.is_offline(90.0) and node.is_offline(99.999)
    assert not node.is_offline(100.0) and not node.is_offline(100.5)
    assert not NodeState(ip=NODE).is_offline(0.0)


# --- unknown nodes -------------------------------------------------------------------------------

UNKNOWN = "10.9.9.9"


@pytest.mark.parametrize(
    "event",
    [
        probe(True, node=UNKNOWN),
        probe(False, node=UNKNOWN),
        ProbeCrashed(at=T0, node=UNKNOWN, error="boom"),
        GpuScraped(at=T0, node=UNKNOWN, gpus=(GPU_A,)),
        listing(LIST, node=UNKNOWN),
        listing(ERROR, node=UNKNOWN),
        UpstreamFailed(at=T0, node=UNKNOWN, error="refused"),
        UpstreamRecovered(at=T0, node=UNKNOWN),
    ],
    ids=lambda event: type(event).__name__,
)
@pytest.mark.parametrize("before", [INITIAL_STATE, reload_setup()], ids=["no-run", "running"])
def test_events_for_unknown_nodes_change_nothing_but_seq(before, event):
    numbered = msgspec.structs.replace(event, at=T0 + 50, seq=before.seq + 1)
    after, step = reduce(before, numbered)
    assert after == msgspec.structs.replace(before, seq=before.seq + 1, at=T0 + 50)
    assert step == NOTHING


# --- immutability (follow-up #38) ----------------------------------------------------------------


def test_states_cannot_be_mutated_by_a_reader():
    state = reload_setup()
    node = state.nodes[NODE]
    with pytest.raises(AttributeError):
        state.seq = 99
    with pytest.raises(TypeError):
        state.nodes[NODE] = NodeState(ip=NODE)  # type: ignore[index]
    with pytest.raises(TypeError):
        del state.nodes[NODE]  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        node.status = Health.DEAD
    with pytest.raises(AttributeError):
        node.models.state = Discovery.KNOWN
    with pytest.raises(TypeError):
        node.models.names[0] = "other"  # type: ignore[index]
    with pytest.raises(TypeError):
        node.gpus[0] = GPU_B  # type: ignore[index]
    with pytest.raises(AttributeError):
        node.gpus[0].uuid = "GPU-other"
    with pytest.raises(AttributeError):
        state.config.gateway.health_fail_threshold = 1
    with pytest.raises(TypeError):
        state.config.nodes[0] = NodeConfig(ip="1.2.3.4")  # type: ignore[index]


def test_a_held_state_is_unaffected_by_later_events():
    config = make_config()
    start = run_started(config)
    held = reload_setup()
    held_bytes = encode_state(held)
    later, _, _ = apply(
        [
            probe(False, at=T0 + 20),
            GpuScraped(at=T0 + 21, node=NODE, gpus=(GPU_B,)),
            listing(["m9"], at=T0 + 22),
            UpstreamRecovered(at=T0 + 23, node=NODE),
            reload(make_config(2), at=T0 + 24),
        ],
        held,
    )
    assert encode_state(held) == held_bytes
    assert encode_state(later) != held_bytes
    # The event's config cannot be changed afterwards: the state shares it, frozen.
    state, _, _ = apply([start])
    with pytest.raises(AttributeError):
        start.config.gateway.listen = ":1"
    assert state.config == config

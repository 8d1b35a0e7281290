"""The live control plane over real sockets: simulated nodes, real config files and event logs.

Timing tests run under `fast_clock` (a MockClock ten times faster than real time), so a 1 s
health interval passes in 0.1 s. Assertions about timing are loose: they count what happened,
never how fast.
"""

from __future__ import annotations

import os
import resource
import signal

import pytest
import trio

from controlplane.infrastructure.config import ConfigError
from controlplane.infrastructure.logs import JsonLog
from controlplane.effects.probes import MAX_BODY_BYTES, MISSING_DATA, ProbeError, parse_gpu_metrics, parse_model_list
from controlplane.effects.replay import replay
from controlplane.effects.control_plane import ControlPlane, open_control_plane
from controlplane.effects.prober import next_tick
from events.log import list_segments, read_events
from events.state import Discovery, GpuSample, Health
from events.types import ModelsListed, ModelsUnchanged, RunStarted, RunStopped, UpstreamFailed
from fixtures.node import OVERSIZED_MODELS_BYTES, Behaviour, NodeSpec, SimulatedNode, serve_nodes

T0 = 1767323045.0
"""2026-01-02T03:04:05Z: what the control plane's clock reads at virtual time 0."""


def mock_now() -> float:
    """The control plane's clock in these tests: wall-clock-like, but following the trio clock."""
    return T0 + trio.current_time()


def specs(count: int, **behaviour: object) -> list[NodeSpec]:
    """`count` nodes, each on its own loopback address (a node's IP is its identity)."""
    return [
        NodeSpec(name=f"node-{index}", host=f"127.0.0.{index + 1}", behaviour=Behaviour(**behaviour))
        for index in range(1, count + 1)
    ]


def requests_to(node: SimulatedNode, path: str) -> int:
    return sum(1 for request in node.requests if request.listener == "vllm" and request.path == path)


async def eventually(predicate, timeout: float = 60.0) -> None:
    """Wait (in virtual seconds) until `predicate()` holds."""
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.05)


def control_plane_options(json_log: JsonLog) -> dict:
    return {"version": "test", "log": json_log, "now": mock_now}


def sample(control_plane: ControlPlane, name: str, **labels: str) -> float | None:
    return control_plane.registry.get_sample_value(name, labels)


# --- probing ---------------------------------------------------------------------------------


async def test_hung_model_listing_never_delays_health_checks(fast_clock, gateway_config, json_log):
    async with serve_nodes(specs(1, models="hang")) as nodes:
        node = nodes[0]
        path = gateway_config(nodes, health_interval="1s", probe_timeout="30s")
        last_checks = []
        async with open_control_plane(path, **control_plane_options(json_log)) as control_plane:
            control_plane.applier.add_listener(lambda event, state, step: last_checks.append(state.nodes[node.host].last_check))
            await eventually(lambda: len({at for at in last_checks if at is not None}) >= 4)
            state = control_plane.view.snapshot.nodes[node.host]
            assert state.status == Health.HEALTHY
            assert state.models.state == Discovery.UNTRIED
            # The hung listing is still in flight: later ticks skipped discovery, never queued it.
            assert requests_to(node, "/v1/models") == 1
            assert requests_to(node, "/health") >= 4


async def test_listing_failures_expire_the_model_list_but_never_touch_health(fast_clock, gateway_config, json_log):
    async with serve_nodes(specs(1, models="error")) as nodes:
        ip = nodes[0].host
        path = gateway_config(nodes, health_interval="1s", health_fail_threshold=3)
        async with open_control_plane(path, **control_plane_options(json_log)) as control_plane:
            await eventually(lambda: control_plane.view.snapshot.nodes[ip].models.state == Discovery.EXPIRED)
            state = control_plane.view.snapshot.nodes[ip]
            assert state.models.fails == 3
            assert state.models.last_error == "models endpoint returned status 500"
            assert (state.status, state.consecutive_failures) == (Health.HEALTHY, 0)
    assert json_log.messages(node=ip) == ["model discovery expired"]


async def test_two_empty_lists_make_known_empty(fast_clock, gateway_config, json_log):
    async with serve_nodes(specs(1, models="empty")) as nodes:
        ip = nodes[0].host
        path = gateway_config(nodes, health_interval="1s")
        async with open_control_plane(path, **control_plane_options(json_log)) as control_plane:
            await eventually(lambda: control_plane.view.snapshot.nodes[ip].models.state == Discovery.KNOWN_EMPTY)
            assert control_plane.view.snapshot.nodes[ip].models.names is None
            assert sample(control_plane, "gateway_model_discovery_total", node=ip, result="empty") == 2
    assert json_log.messages(node=ip) == ["node reports no models"]


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        ("error_body", MISSING_DATA),
        ("invalid_json", "parse model list: Expecting value: line 1 column 36 (char 35)"),
    ],
)
async def test_an_unusable_body_on_http_200_is_a_listing_error(fast_clock, gateway_config, json_log, fault, error):
    async with serve_nodes(specs(1, models=fault)) as nodes:
        ip = nodes[0].host
        path = gateway_config(nodes, health_interval="1s")
        async with open_control_plane(path, **control_plane_options(json_log)) as control_plane:
            await eventually(lambda: control_plane.view.snapshot.nodes[ip].models.fails >= 2)
            models = control_plane.view.snapshot.nodes[ip].models
            assert (models.state, models.empties, models.last_error) == (Discovery.UNTRIED, 0, error)
            assert sample(control_plane, "gateway_model_discovery_total", node=ip, result="error") >= 2
            assert sample(control_plane, "gateway_model_discovery_total", node=ip, result="empty") is None


async def test_an_oversized_model_list_is_cut_off_with_a_clear_error(fast_clock, gateway_config, json_log):
    peak_kib_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    async with serve_nodes(specs(1, models="oversized")) as nodes:
        node = nodes[0]
        path = gateway_config(nodes, health_interval="1s")
        async with open_control_plane(path, **control_plane_options(json_log)) as control_plane:
            await eventually(lambda: control_plane.view.snapshot.nodes[node.host].models.fails >= 2)
            models = control_plane.view.snapshot.nodes[node.host].models
            assert models.last_error == f"response body exceeds {MAX_BODY_BYTES} bytes"
            assert models.state == Discovery.UNTRIED
            listing = next(request for request in node.requests if request.path == "/v1/models")
            await eventually(listing.ended.is_set)
            assert listing.disconnected  # the connection was dropped, not read to the end
    peak_growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_kib_before) * 1024
    assert peak_growth < OVERSIZED_MODELS_BYTES / 4


async def test_a_failing_node_goes_degraded_then_dead_then_recovers_logging_each_change_once(
    fast_clock, gateway_config, json_log
):
    async with serve_nodes(specs(2)) as nodes:
        failing = nodes[0]
        path = gateway_config(nodes, health_interval="1s", health_fail_threshold=3)
        statuses = []
        async with open_control_plane(path, **control_plane_options(json_log)) as control_plane:
            control_plane.applier.add_listener(lambda event, state, step: statuses.append(state.nodes[failing.host].status))
            await eventually(lambda: control_plane.view.snapshot.nodes[failing.host].last_check is not None)
            failing.behaviour.health = "fail"
            await eventually(lambda: control_plane.view.snapshot.nodes[failing.host].status == Health.DEAD)
            await eventually(lambda: control_plane.view.snapshot.nodes[failing.host].consecutive_failures >= 5)
            failing.behaviour.health = "ok"
            await eventually(lambda: control_plane.view.snapshot.nodes[failing.host].status == Health.HEALTHY)
            checks_when_recovered = requests_to(failing, "/health")
            await eventually(lambda: requests_to(failing, "/health") >= checks_when_recovered + 2)
            assert control_plane.view.snapshot.nodes[nodes[1].host].status == Health.HEALTHY
    changes = [record for record in json_log.records() if record["msg"] == "node health changed"]
    assert [(r["node"], r["from"], r["to"], r["failures"], r["level"]) for r in changes] == [
        (failing.host, "healthy", "degraded", "1", "warn"),
        (failing.host, "degraded", "dead", "3", "error"),
        (failing.host, "dead", "healthy", "0", "info"),
    ]
    assert changes[0]["error"] == "health endpoint returned status 503"
    assert "error" not in changes[2]


async def test_an_upstream_failure_marks_the_node_offline_and_rechecks_its_health(
    fast_clock, gateway_config, json_log
):
    async with serve_nodes(specs(1)) as nodes:
        node = nodes[0]
        path = gateway_config(nodes, health_interval="1h")
        async with open_control_plane(path, **control_plane_options(json_log)) as control_plane:
            await eventually(lambda: control_plane.view.snapshot.nodes[node.host].models.state == Discovery.KNOWN)
            await eventually(lambda: control_plane.view.snapshot.nodes[node.host].last_check is not None)
            assert requests_to(node, "/health") == 1
            control_plane.view.observe(UpstreamFailed(at=control_plane.view.now(), node=node.host, error="connection refused"))
            await eventually(lambda: control_plane.view.snapshot.nodes[node.host].is_offline(control_plane.view.now()))
            await eventually(lambda: requests_to(node, "/health") == 2)
            assert requests_to(node, "/v1/models") == 1  # a recheck never runs discovery
    assert "node marked offline" in json_log.messages(node=node.host)


# --- reload and signals ----------------------------------------------------------------------


async def test_sighup_reloads_nodes_and_carries_the_state_of_kept_ones(fast_clock, gateway_config, json_log):
    async with serve_nodes(specs(3)) as nodes:
        removed, kept, added = nodes
        kept.behaviour.health = "fail"
        path = gateway_config([removed, kept], health_interval="1s", health_fail_threshold=2)
        async with open_control_plane(path, **control_plane_options(json_log)) as control_plane:
            async with trio.open_nursery() as nursery:
                await nursery.start(control_plane.lifecycle.serve_signals)
                await eventually(lambda: control_plane.view.snapshot.nodes[kept.host].status == Health.DEAD)
                await eventually(lambda: control_plane.view.snapshot.nodes[kept.host].models.state == Discovery.KNOWN)
                gateway_config([kept, added], health_interval="1s", health_fail_threshold=2)
                os.kill(os.getpid(), signal.SIGHUP)
                await eventually(lambda: added.host in control_plane.view.snapshot.nodes)
                snapshot = control_plane.view.snapshot
                assert list(snapshot.nodes) == [kept.host, added.host]
                assert snapshot.nodes[kept.host].status == Health.DEAD  # carried over
                assert snapshot.nodes[kept.host].models.state == Discovery.KNOWN
                assert sample(control_plane, "gateway_node_models_ok", node=removed.host) is None
                await eventually(lambda: control_plane.view.snapshot.nodes[added.host].models.state == Discovery.KNOWN)
                probes_of_removed = requests_to(removed, "/health")
                probes_of_added = requests_to(added, "/health")
                await eventually(lambda: requests_to(added, "/health") >= probes_of_added + 3)
                assert requests_to(removed, "/health") <= probes_of_removed + 1  # one may have been in flight
                nursery.cancel_scope.cancel()
    reloaded = [record for record in json_log.records() if record["msg"] == "config reloaded"]
    assert [(r["nodes"], r["models"]) for r in reloaded] == [("2", "0")]
    assert json_log.messages(node=kept.host).count("node health changed") == 2  # healthy→degraded→dead only


async def test_sighup_with_an_invalid_config_keeps_the_current_one(fast_clock, gateway_config, json_log):
    async with serve_nodes(specs(1)) as nodes:
        path = gateway_config(nodes, health_interval="1s")
        async with open_control_plane(path, **control_plane_options(json_log)) as control_plane:
            config_before = control_plane.view.snapshot.config
            async with trio.open_nursery() as nursery:
                await nursery.start(control_plane.lifecycle.serve_signals)
                path.write_text('[gateway]\nhealth_interval = "soon"\n')
                os.kill(os.getpid(), signal.SIGHUP)
                await eventually(lambda: "config reload failed; keeping current config" in json_log.messages())
                nursery.cancel_scope.cancel()
            assert control_plane.view.snapshot.config == config_before
            seq = control_plane.view.snapshot.seq
            await eventually(lambda: control_plane.view.snapshot.seq > seq + 3)  # still probing
    failure = next(r for r in json_log.records() if r["msg"] == "config reload failed; keeping current config")
    assert failure["level"] == "error"
    assert failure["error"].startswith(f"{path}: gateway.health_interval: parsing health_interval: time: invalid duration")


async def test_a_reload_during_a_reload_is_ignored(fast_clock, gateway_config, json_log):
    async with serve_nodes(specs(1)) as nodes:
        path = gateway_config(nodes, health_interval="1s")
        async with open_control_plane(path, **control_plane_options(json_log)) as control_plane:
            results = []

            async def reload() -> None:
                results.append(await control_plane.reload())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(reload)
                nursery.start_soon(reload)
    assert sorted(results) == [False, True]
    assert json_log.messages().count("config reload already in progress; ignoring SIGHUP") == 1
    assert json_log.messages().count("config reloaded") == 1


async def test_sigterm_stops_probing_and_flushes_the_event_log(fast_clock, gateway_config, json_log, tmp_path):
    event_log = tmp_path / "events.jsonl"
    async with serve_nodes(specs(1)) as nodes:
        node = nodes[0]
        path = gateway_config(nodes, health_interval="1s", event_log=str(event_log))
        control_plane = ControlPlane(path, **control_plane_options(json_log))
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                await nursery.start(control_plane.run)
                await nursery.start(control_plane.lifecycle.serve_signals)
                await eventually(lambda: requests_to(node, "/health") >= 2)
                os.kill(os.getpid(), signal.SIGTERM)
            # run() and serve_signals() have both returned.
        probes_after_stop = requests_to(node, "/health")
        await trio.sleep(3)
        assert requests_to(node, "/health") == probes_after_stop
    events = list(read_events([event_log]))
    assert isinstance(events[0], RunStarted) and isinstance(events[-1], RunStopped)
    assert [event.seq for event in events] == list(range(1, len(events) + 1))
    assert json_log.messages()[-2:] == ["shutting down", "gateway stopped"]


async def test_an_invalid_config_fails_the_start(tmp_path, json_log):
    path = tmp_path / "gateway.toml"
    path.write_text("[gateway]\nhealth_fail_threshold = -1\n")
    with pytest.raises(ConfigError) as caught:
        async with open_control_plane(path, **control_plane_options(json_log)):
            pass
    assert caught.value.key == "gateway.health_fail_threshold"
    assert json_log.lines() == []


async def test_a_new_run_continues_the_event_log_numbering(fast_clock, gateway_config, json_log, tmp_path):
    event_log = tmp_path / "events.jsonl"
    async with serve_nodes(specs(1)) as nodes:
        path = gateway_config(nodes, health_interval="1s", event_log=str(event_log))
        for _ in range(2):
            async with open_control_plane(path, **control_plane_options(json_log)) as control_plane:
                seq = control_plane.view.snapshot.seq
                await eventually(lambda: control_plane.view.snapshot.seq >= seq + 3)
    assert len(list_segments(event_log)) == 2
    events = list(read_events([event_log]))
    assert [event.seq for event in events] == list(range(1, len(events) + 1))
    assert [type(event) for event in events].count(RunStarted) == 2


# --- the event log and metrics ---------------------------------------------------------------


async def test_an_unwritable_event_log_is_reported_and_the_control_plane_keeps_working(
    fast_clock, gateway_config, json_log, tmp_path
):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    async with serve_nodes(specs(1)) as nodes:
        ip = nodes[0].host
        path = gateway_config(nodes, health_interval="1s", event_log=str(blocker / "events.jsonl"))
        async with open_control_plane(path, **control_plane_options(json_log)) as control_plane:
            await eventually(lambda: (sample(control_plane, "interlock_event_log_write_errors_total") or 0) >= 3)
            seq = control_plane.view.snapshot.seq
            await eventually(lambda: control_plane.view.snapshot.seq > seq + 3)
            assert control_plane.view.snapshot.nodes[ip].models.state == Discovery.KNOWN
            blocker.unlink()  # the writer creates the folder on its next attempt
            await eventually(lambda: "event log write recovered" in json_log.messages())
    failures = [record for record in json_log.records() if record["msg"] == "event log write failed"]
    assert len(failures) == 1  # once per streak of failures
    assert failures[0]["level"] == "error"
    assert "Not a directory" in failures[0]["error"] or "File exists" in failures[0]["error"]
    written = list(read_events([blocker / "events.jsonl"]))
    assert isinstance(written[-1], RunStopped)
    assert written[-1].seq == written[0].seq + len(written) - 1  # no gap after the recovery
    # Every event was either written or counted as dropped.
    assert sample(control_plane, "interlock_event_log_dropped_events_total") + len(written) == written[-1].seq


async def test_metrics_follow_the_applied_events(fast_clock, gateway_config, json_log, tmp_path):
    event_log = tmp_path / "events.jsonl"
    async with serve_nodes(specs(3)) as nodes:
        healthy, dead, empty = nodes
        dead.behaviour.health = "fail"
        empty.behaviour.models = "empty"
        path = gateway_config(nodes, health_interval="1s", health_fail_threshold=2, event_log=str(event_log))
        async with open_control_plane(path, **control_plane_options(json_log)) as control_plane:
            await eventually(
                lambda: control_plane.view.snapshot.nodes[dead.host].status == Health.DEAD
                and control_plane.view.snapshot.nodes[empty.host].models.state == Discovery.KNOWN_EMPTY
            )
            assert sample(control_plane, "cluster_nodes_healthy") == 2
            assert sample(control_plane, "cluster_nodes_degraded") == 0
            assert sample(control_plane, "cluster_nodes_dead") == 1
    events = list(read_events([event_log]))
    assert sample(control_plane, "interlock_snapshot_seq") == events[-1].seq
    for event_type in {type(event) for event in events}:
        tag = event_type.__struct_config__.tag
        expected = sum(1 for event in events if type(event) is event_type)
        assert sample(control_plane, "interlock_events_total", type=tag) == expected
    listings = [event for event in events if isinstance(event, ModelsListed | ModelsUnchanged)]
    for node in nodes:
        for result, matches in [
            ("success", lambda e: isinstance(e, ModelsUnchanged) or bool(e.models)),
            ("empty", lambda e: isinstance(e, ModelsListed) and e.models == ()),
            ("error", lambda e: isinstance(e, ModelsListed) and e.models is None),
        ]:
            expected = sum(1 for event in listings if event.node == node.host and matches(event))
            assert (sample(control_plane, "gateway_model_discovery_total", node=node.host, result=result) or 0) == expected
        assert sample(control_plane, "gateway_node_models_ok", node=node.host) == 1
    assert sample(control_plane, "health_check_panics_total") == 0
    assert sample(control_plane, "interlock_event_log_write_errors_total") == 0


# --- replay determinism ----------------------------------------------------------------------


async def test_replaying_the_recorded_log_reproduces_the_live_transition_log(
    fast_clock, gateway_config, json_log, tmp_path
):
    event_log = tmp_path / "events.jsonl"
    async with serve_nodes(specs(3)) as nodes:
        first, second, third = nodes
        options = {"health_interval": "1s", "health_fail_threshold": 2, "probe_timeout": "2s", "event_log": str(event_log)}
        path = gateway_config([first, second], models=[("test-model", "")], **options)
        async with open_control_plane(path, **control_plane_options(json_log)) as control_plane:
            snapshot = lambda: control_plane.view.snapshot  # noqa: E731
            await eventually(lambda: all(node.models.state == Discovery.KNOWN for node in snapshot().nodes.values()))
            first.behaviour.health = "fail"
            second.behaviour.models = "hang"
            await eventually(lambda: snapshot().nodes[first.host].status == Health.DEAD)
            await eventually(lambda: snapshot().nodes[second.host].models.state == Discovery.EXPIRED)
            second.behaviour.models = "empty"
            await eventually(lambda: snapshot().nodes[second.host].models.state == Discovery.KNOWN_EMPTY)
            second.behaviour.models = "error_body"
            first.behaviour.health = "ok"
            gateway_config([first, second, third], models=[("test-model", "")], **options)
            assert await control_plane.reload()
            control_plane.view.observe(UpstreamFailed(at=control_plane.view.now(), node=third.host, error="connection refused"))
            await eventually(lambda: snapshot().nodes[first.host].status == Health.HEALTHY)
            await eventually(lambda: snapshot().nodes[second.host].models.state == Discovery.EXPIRED)
            await eventually(lambda: snapshot().nodes[third.host].models.state == Discovery.KNOWN)
    live = [line for line in json_log.lines() if '"seq":' in line]
    replayed = [transition.log_line() for transition in replay([event_log]).transitions]
    assert replayed == live
    messages = json_log.messages()
    for expected in ["node marked offline", "config reloaded", "model discovery expired", "node reports no models"]:
        assert expected in messages


# --- pieces ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("last_tick", "now", "expected"),
    [
        (0.0, 0.2, 1.0),  # a quick round waits for the next tick
        (0.0, 1.5, 1.0),  # one tick overrun: it starts the next round at once
        (0.0, 3.5, 3.0),  # ticks 1 and 2 were dropped; tick 3 starts the next round
    ],
)
def test_next_tick_drops_overrun_ticks(last_tick, now, expected):
    assert next_tick(last_tick, 1.0, now) == expected


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"object":"list","data":[{"id":"a","object":"model"},{"id":"b"}]}', ("a", "b")),
        (b'{"data":[]}', ()),
        (b'{"data":[{"object":"model"}, null]}', ("", "")),
        (b'  {"data":[{"id":"a"}]} trailing garbage', ("a",)),
        (b'{"DATA":[{"ID":"a"}]}', ("a",)),  # Go matches keys case-insensitively
        (b'{"data":[{"id":"a\\ud800b\\ud83d\\ude00"}]}', ("a\ufffdb\U0001f600",)),  # a lone surrogate is replaced
    ],
)
def test_parse_model_list_reads_ids_in_order(body, expected):
    assert parse_model_list(body).ids == expected


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"{}", MISSING_DATA),
        (b"null", MISSING_DATA),
        (b'{"data":null}', MISSING_DATA),
        (b'{"error":{"message":"boom"}}', MISSING_DATA),
        (b"", "parse model list: EOF"),
        (b'{"data":"nope"}', "parse model list: data is a string, not an array"),
        (b'{"data":[{"id":1}]}', "parse model list: data[0].id is a number, not a string"),
        (b"[]", "parse model list: cannot decode an array into the model list object"),
        (b'{"data":[NaN]}', "parse model list: invalid character 'N' looking for beginning of value"),
    ],
)
def test_parse_model_list_errors(body, error):
    with pytest.raises(ProbeError) as caught:
        parse_model_list(body)
    assert str(caught.value) == error


def test_parse_gpu_metrics_follows_plinths_rules():
    body = b"""# HELP gpu_memory_used_bytes GPU memory used in bytes.
# TYPE gpu_memory_used_bytes gauge
gpu_memory_used_bytes{gpu="GPU-a"} 1.5e3
gpu_memory_total_bytes{gpu="GPU-a"} 8000.9
gpu_utilization_percent{gpu="GPU-a",host="x"} 42
gpu_temperature_celsius{gpu="GPU-a"} 61.7
gpu_fan_speed{gpu="GPU-b"} 10
gpu_utilization_percent{gpu="GPU-c"} not-a-number
gpu_utilization_percent{gpu=""} 5
gpu_utilization_percent{card="GPU-d"} 5
gpu_utilization_percent{gpu="GPU-e"} 5 1700000000
gpu_utilization_percent{gpu="GPU-f"} 1_000
gpu_utilization_percent{gpu="GPU-g"} \xd9\xa1\xd9\xa2

"""
    assert parse_gpu_metrics(body) == (
        GpuSample(uuid="GPU-a", memory_used=1500, memory_total=8000, utilization=42, temperature=61),
        GpuSample(uuid="GPU-b"),
    )
    assert parse_gpu_metrics(b"# nothing here\n") == ()

"""Replay, explain and audit through the `interlock` CLI, on the recorded scenario log.

The scenario (fixtures/scenarios.py) in short: 10.0.0.1 is offline at 27-33 s and from 117 s on,
10.0.0.2 goes known_empty at seq 100, 10.0.0.3 dies (degraded seq 161, dead seq 186), 10.0.0.4's
listing expires (seq 147), 10.0.0.5 is reloaded in at seq 98 and discovered at seq 111 (a LoRA
adapter's load onto it fails at seq 117, and is asked again at seq 261).
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from controlplane.effects.replay import audit, replay
from controlplane.rules.transitions import TransitionKind
from events.config import Config, ModelsConfig, NodeConfig
from events.log import decode_event, encode_event, read_events
from events.types import EVENT_TYPES, Checkpoint, HealthProbed, ModelsUnchanged, ProbeCrashed, RunStarted
from fixtures import scenarios
from interlock.cli import main
from interlock.render import parse_time

SCENARIO = scenarios.SCENARIO_PATH
START = scenarios.START
MODEL_7B = scenarios.MODEL_7B
MODEL_32B = scenarios.MODEL_32B
MODEL_8B = scenarios.MODEL_8B


def run_cli(capsys, *argv: object) -> tuple[int, str, str]:
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def parse_table(out: str, first_heading: str = "NODE") -> dict[str, dict[str, str]]:
    """The table after the heading line starting with `first_heading`, as {ip: {heading: cell}}."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first_heading + " "))
    headings = lines[start].split()
    starts = [lines[start].index(heading) for heading in headings]
    rows = {}
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        cells = [line[begin:end].strip() for begin, end in zip(starts, starts[1:] + [None])]
        rows[cells[0]] = dict(zip(headings, cells))
    return rows


def one_error_line(err: str) -> str:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# --- the recorded scenario -------------------------------------------------------------------


def test_regenerating_the_scenario_gives_the_committed_file():
    assert b"".join(scenarios.scenario_lines()) == SCENARIO.read_bytes()


def test_scenario_is_in_the_event_logs_wire_format():
    lines = SCENARIO.read_bytes().splitlines(keepends=True)
    events = [decode_event(line) for line in lines]
    assert [encode_event(event) for event in events] == lines
    assert [event.seq for event in events] == list(range(1, len(events) + 1))
    assert all(earlier.at < later.at for earlier, later in zip(events, events[1:]))
    # The scenario's listings are whole (ModelsUnchanged is applied as the listing it names: test_reducer).
    assert {type(event) for event in events} == set(EVENT_TYPES) - {ProbeCrashed, Checkpoint, ModelsUnchanged}
    run = events[0]
    assert isinstance(run, RunStarted)
    assert isinstance(run.config, Config)
    assert msgspec.json.encode(msgspec.convert(msgspec.to_builtins(run.config), Config)) == msgspec.json.encode(run.config)
    assert len(lines) < 400


# --- replay ----------------------------------------------------------------------------------


def test_replay_table_shows_the_final_state(capsys):
    code, out, err = run_cli(capsys, "replay", SCENARIO)
    assert (code, err) == (0, "")
    assert out.startswith("state after seq 278 (2026-01-02T03:06:06Z), 278 events\n")
    rows = parse_table(out)
    assert list(rows) == ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"]
    assert {ip: row["STATUS"] for ip, row in rows.items()} == {
        "10.0.0.1": "healthy",
        "10.0.0.2": "healthy",
        "10.0.0.3": "dead",
        "10.0.0.4": "healthy",
        "10.0.0.5": "healthy",
    }
    assert {ip: row["MODELS"] for ip, row in rows.items()} == {
        "10.0.0.1": "known",
        "10.0.0.2": "known_empty",
        "10.0.0.3": "known",
        "10.0.0.4": "expired",
        "10.0.0.5": "known",
    }
    assert rows["10.0.0.5"]["NAMES"] == f"{MODEL_7B},{MODEL_8B}"
    assert rows["10.0.0.2"]["NAMES"] == "-"
    assert rows["10.0.0.3"]["RING"] == "ring-a"
    assert rows["10.0.0.1"]["RING"] == "standalone"
    assert rows["10.0.0.3"]["FAILURES"] == "10"
    assert rows["10.0.0.1"]["OFFLINE"] == "until 2026-01-02T03:06:12Z (6.0s left)"
    assert rows["10.0.0.2"]["OFFLINE"] == "-"
    assert rows["10.0.0.2"]["CHECKED"] == "0.4s ago"
    # The one load scrape: requests running+waiting, or unknown where it failed.
    assert {ip: row["LOAD"] for ip, row in rows.items()} == {
        "10.0.0.1": "unknown",
        "10.0.0.2": "0+0",
        "10.0.0.3": "1+0",
        "10.0.0.4": "2+1",
        "10.0.0.5": "0+1",
    }


def test_until_seq_gives_the_earlier_state(capsys):
    code, out, _ = run_cli(capsys, "replay", SCENARIO, "--until-seq", 97)
    assert code == 0
    assert out.startswith("state after seq 97 ")
    rows = parse_table(out)
    assert {row["LOAD"] for row in rows.values()} == {"-"}  # not scraped yet
    assert list(rows) == ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"]  # before the reload
    assert {row["MODELS"] for row in rows.values()} == {"known"}
    assert {row["STATUS"] for row in rows.values()} == {"healthy"}


@pytest.mark.parametrize("moment", ["2026-01-02t03:04:35.000z", "2026-01-02T05:04:35.0+02:00", str(START + 30)])
def test_at_gives_the_state_at_that_time_in_any_time_form(capsys, moment):
    code, out, _ = run_cli(capsys, "replay", SCENARIO, "--at", moment)
    assert code == 0
    assert out.startswith("state after seq 59 (2026-01-02T03:04:32Z), 59 events, seen at 2026-01-02T03:04:35Z\n")
    rows = parse_table(out)
    assert rows["10.0.0.1"]["OFFLINE"] == "until 2026-01-02T03:04:42Z (7.0s left)"


@pytest.mark.parametrize("moment", ["2026-01-02T03:04:35Z", "2026-01-02T05:04:35+02:00", str(int(START + 30))])
def test_at_a_whole_second_includes_the_events_within_that_second(capsys, moment):
    # As a log line prints it: events 60-68 happened at 03:04:35 and some milliseconds.
    assert all(int(event.at) == START + 30 for event in read_events([SCENARIO]) if 60 <= event.seq <= 68)
    code, out, _ = run_cli(capsys, "replay", SCENARIO, "--at", moment)
    assert code == 0
    assert out.startswith("state after seq 68 (2026-01-02T03:04:35Z), 68 events, seen at 2026-01-02T03:04:35Z\n")
    code, out, _ = run_cli(capsys, "explain", SCENARIO, "--model", MODEL_7B, "--at", moment)
    assert out.startswith("moment     2026-01-02T03:04:35Z, after event seq 68\n")


def test_json_matches_the_replayed_state(capsys):
    code, out, _ = run_cli(capsys, "replay", SCENARIO, "--until-seq", 150, "--json")
    assert code == 0
    data = json.loads(out)
    result = replay([SCENARIO], until_seq=150)
    assert (data["seq"], data["at"], data["now"], data["event_count"]) == (150, result.last_at, result.last_at, 150)
    assert msgspec.convert(data["config"], Config) == result.state.config
    assert [node["ip"] for node in data["nodes"]] == list(result.state.nodes)
    for node in data["nodes"]:
        state = result.state.nodes[node["ip"]]
        assert node["status"] == state.status
        assert node["consecutive_failures"] == state.consecutive_failures
        assert node["last_check"] == state.last_check
        assert node["models"]["state"] == state.models.state
        assert node["models"]["names"] == (list(state.models.names) if state.models.names else None)
        assert node["offline"] is False
    assert data["nodes"][3]["models"]["state"] == "expired"


def test_empty_log_has_no_state(capsys, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    code, out, _ = run_cli(capsys, "replay", empty)
    assert code == 0
    assert "no events" in out


# --- explain ---------------------------------------------------------------------------------


def verdicts(out: str) -> dict[str, str]:
    return {ip: row["VERDICT"] for ip, row in parse_table(out).items()}


def test_explain_standalone_model(capsys):
    code, out, _ = run_cli(capsys, "explain", SCENARIO, "--model", MODEL_7B)
    assert code == 0
    assert "moment     2026-01-02T03:06:06Z, after event seq 278\n" in out
    assert "ring       standalone\n" in out
    assert "ring pool  10.0.0.1, 10.0.0.2, 10.0.0.5\n" in out
    assert "pick pool  10.0.0.5\n" in out
    assert verdicts(out) == {
        "10.0.0.1": "excluded: offline",
        "10.0.0.2": "excluded: empty",
        "10.0.0.3": "excluded: not in ring",
        "10.0.0.4": "excluded: not in ring",
        "10.0.0.5": "kept",
    }


def test_explain_ring_model_nobody_can_serve_exits_3(capsys):
    code, out, _ = run_cli(capsys, "explain", SCENARIO, "--model", MODEL_32B)
    assert code == 3
    assert "ring       ring-a\n" in out
    assert "pick pool  none\n" in out
    assert verdicts(out) == {
        "10.0.0.1": "excluded: not in ring",
        "10.0.0.2": "excluded: not in ring",
        "10.0.0.3": "excluded: dead",
        "10.0.0.4": "excluded: expired",
        "10.0.0.5": "excluded: not in ring",
    }
    assert out.rstrip().endswith('the gateway answers 503 "no reachable node available"')


def test_explain_unconfigured_model_uses_the_standalone_pool(capsys):
    code, out, _ = run_cli(capsys, "explain", SCENARIO, "--model", MODEL_8B)
    assert code == 0
    assert verdicts(out)["10.0.0.1"] == "excluded: missing"
    assert verdicts(out)["10.0.0.5"] == "kept"


def test_explain_model_nobody_serves_exits_3_with_the_503_text(capsys):
    code, out, _ = run_cli(capsys, "explain", SCENARIO, "--model", "nobody/serves-this")
    assert code == 3
    assert set(verdicts(out).values()) == {"excluded: missing", "excluded: empty", "excluded: not in ring"}
    assert out.rstrip().endswith(
        'no node in the ring pool serves this model: the gateway answers 503 "no healthy node available"'
    )


def test_explain_at_an_earlier_moment(capsys):
    code, out, _ = run_cli(capsys, "explain", SCENARIO, "--model", MODEL_7B, "--at", "2026-01-02T03:04:36Z")
    assert code == 0
    assert verdicts(out) == {
        "10.0.0.1": "excluded: offline",
        "10.0.0.2": "kept",
        "10.0.0.3": "excluded: not in ring",
        "10.0.0.4": "excluded: not in ring",
    }
    code, out, _ = run_cli(capsys, "explain", SCENARIO, "--model", MODEL_32B, "--until-seq", 160)
    assert code == 0
    assert verdicts(out)["10.0.0.3"] == "kept"  # degraded, but the only candidate
    assert verdicts(out)["10.0.0.4"] == "excluded: expired"


def test_explain_json(capsys):
    code, out, _ = run_cli(capsys, "explain", SCENARIO, "--model", MODEL_32B, "--json")
    assert code == 3
    data = json.loads(out)
    assert data["seq"] == 278
    assert data["ring"] == "ring-a"
    assert data["ring_pool"] == ["10.0.0.3", "10.0.0.4"]
    assert data["candidates"] == ["10.0.0.3"]
    assert data["pick_pool"] == []
    assert data["refusal"] == "no reachable node available"
    assert {v["ip"]: v["reason"] for v in data["verdicts"]}["10.0.0.4"] == "expired"


# --- audit -----------------------------------------------------------------------------------


def test_audit_prints_the_transition_log_lines(capsys):
    code, out, _ = run_cli(capsys, "audit", SCENARIO)
    assert code == 0
    expected = [transition.log_line() for transition in replay([SCENARIO]).transitions]
    assert out.splitlines() == expected
    assert len(expected) == 30
    first = json.loads(expected[0])
    assert first == {
        "cluster": "lab-cluster",
        "level": "info",
        "msg": "starting gateway",
        "seq": "1",
        "timestamp": "2026-01-02T03:04:05Z",
    }


def test_audit_filters_by_node_and_kind(capsys):
    code, out, _ = run_cli(capsys, "audit", SCENARIO, "--node", "10.0.0.3", "--kind", "health")
    assert code == 0
    records = [json.loads(line) for line in out.splitlines()]
    assert [(r["from"], r["to"], r["seq"]) for r in records] == [
        ("healthy", "degraded", "161"),
        ("degraded", "dead", "186"),
    ]

    code, out, _ = run_cli(capsys, "audit", SCENARIO, "--kind", "offline,reload")
    messages = [json.loads(line)["msg"] for line in out.splitlines()]
    assert messages == [
        "node marked offline",
        "config reload failed; keeping current config",
        "node back online",
        "config reloaded",
        "node marked offline",
    ]
    _, repeated, _ = run_cli(capsys, "audit", SCENARIO, "--kind", "offline", "--kind", "reload")
    assert repeated == out


def test_audit_filters_by_time(capsys):
    code, out, _ = run_cli(capsys, "audit", SCENARIO, "--since", "2026-01-02T03:05:00Z", "--until", START + 75)
    assert code == 0
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["seq"] for r in records] == ["111", "111", "112", "117", "122", "147"]
    transitions = replay([SCENARIO]).transitions
    expected = audit(transitions, since=START + 55, until=START + 75)
    assert out.splitlines() == [t.log_line() for t in expected]


def test_audit_since_and_until_a_log_lines_own_timestamp_give_that_second(capsys):
    _, out, _ = run_cli(capsys, "audit", SCENARIO, "--node", "10.0.0.3", "--kind", "health")
    dead = json.loads(out.splitlines()[-1])
    assert (dead["to"], dead["timestamp"]) == ("dead", "2026-01-02T03:05:30Z")
    code, out, _ = run_cli(capsys, "audit", SCENARIO, "--since", dead["timestamp"], "--until", dead["timestamp"])
    assert code == 0
    assert json.loads(out.splitlines()[-1]) == dead
    assert {json.loads(line)["timestamp"] for line in out.splitlines()} == {dead["timestamp"]}


def test_audit_node_is_an_ip_or_a_name(capsys):
    by_ip = run_cli(capsys, "audit", SCENARIO, "--node", "10.0.0.3")
    by_name = run_cli(capsys, "audit", SCENARIO, "--node", "gpu-node-3")
    assert by_name == by_ip and by_ip[0] == 0 and len(by_ip[1].splitlines()) == 4
    reloaded_in = run_cli(capsys, "audit", SCENARIO, "--node", "gpu-node-5")  # a node a reload added
    assert {json.loads(line)["node"] for line in reloaded_in[1].splitlines()} == {"10.0.0.5"}


def test_audit_says_when_nothing_matches_and_names_the_nodes_when_the_node_is_unknown(capsys):
    code, out, err = run_cli(capsys, "audit", SCENARIO, "--node", "gpu-node-2", "--kind", "offline")
    assert (code, out) == (0, "")
    assert one_error_line(err) == "interlock audit: no transition of the log's 30 matches"
    code, out, err = run_cli(capsys, "audit", SCENARIO, "--node", "gpu-node-9")
    assert (code, out) == (2, "")
    assert one_error_line(err) == (
        "interlock audit: error: argument --node: no node 'gpu-node-9' in the log (its nodes: "
        "10.0.0.1 (gpu-node-1), 10.0.0.2 (gpu-node-2), 10.0.0.3 (gpu-node-3), 10.0.0.4 (gpu-node-4), "
        "10.0.0.5 (gpu-node-5))"
    )


def test_replay_and_explain_after_the_gateway_stopped_say_so(capsys):
    stopped = [t for t in replay([SCENARIO]).transitions if t.msg == "gateway stopped"][-1]
    later = str(stopped.at + 60)
    note = f"the gateway was not running at this moment (it stopped at 2026-01-02T03:06:06Z, seq {stopped.seq})"
    code, out, _ = run_cli(capsys, "replay", SCENARIO, "--at", later)
    assert code == 0 and out.splitlines()[2] == note + "; the nodes as it last saw them:"
    code, out, _ = run_cli(capsys, "explain", SCENARIO, "--model", MODEL_7B, "--at", later)
    assert code == 0 and note + ": it routed nothing. Had it been running:" in out.splitlines()
    code, out, _ = run_cli(capsys, "replay", SCENARIO, "--at", later, "--json")
    assert json.loads(out)["stopped"] == {"at": stopped.at, "seq": stopped.seq}
    # Before the stop: no such note.
    code, out, _ = run_cli(capsys, "replay", SCENARIO, "--until-seq", stopped.seq - 1, "--json")
    assert json.loads(out)["stopped"] is None
    _, out, _ = run_cli(capsys, "explain", SCENARIO, "--model", MODEL_7B, "--until-seq", stopped.seq - 1)
    assert "not running" not in out


def test_skip_invalid_replays_a_damaged_log_reporting_each_line_it_skipped(capsys, tmp_path):
    lines = SCENARIO.read_bytes().splitlines(keepends=True)
    assert all(b'"type":"gpu_scrape"' in line for line in lines[9:11])  # no transition depends on them
    damaged = tmp_path / "damaged.jsonl"
    damaged.write_bytes(b"".join([*lines[:9], b'{"type":"no_such_event","at":1,"seq":10}\n', b"\x00\n", *lines[11:]]))
    code, out, err = run_cli(capsys, "audit", damaged)
    assert (code, out) == (2, "")
    assert one_error_line(err).startswith(f"interlock audit: error: {damaged}:10: ")
    code, out, err = run_cli(capsys, "audit", damaged, "--skip-invalid")
    assert code == 0
    assert err.splitlines() == [
        f"interlock audit: warning: {damaged}:10: skipping invalid line (Invalid value 'no_such_event' - at `$.type`)",
        f"interlock audit: warning: {damaged}:11: skipping invalid line "
        "(JSON is malformed: invalid character (byte 0))",
        "interlock audit: warning: events 10-11 are missing from the log (seq 12 follows 9)",
        "interlock audit: warning: skipped 2 invalid lines: from the first one on, the state may differ from the live "
        "gateway's",
    ]
    assert out == run_cli(capsys, "audit", SCENARIO)[1]


# --- check-config ----------------------------------------------------------------------------

VALID_CONFIG = """
[cluster]
name = "test-cluster"

[[nodes]]
ip = "10.0.0.1"
name = "gpu-node-1"

[models]
default = "m"
"""


def test_check_config_ok(capsys, tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(VALID_CONFIG)
    code, out, err = run_cli(capsys, "check-config", path)
    assert (code, err) == (0, "")
    assert out.startswith("ok\ncluster: test-cluster\n")
    assert "gpu-node-1  10.0.0.1:8000  standalone" in out


def test_check_config_error_exits_2_with_the_message(capsys, tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text('[cluster]\nname = "no nodes"\n')
    code, out, err = run_cli(capsys, "check-config", path)
    assert (code, out) == (2, "")
    assert one_error_line(err) == f"{path}: nodes: at least one node must be configured"


MISSPELT_CONFIG = VALID_CONFIG + (
    '[gateway]\nhelth_interval = "1s"\n[gatway]\nlisten = ":1"\n[provision]\nssh_port = 22\n'
)


def test_check_config_warns_for_each_unknown_key_with_the_closest_known_key(capsys, tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(MISSPELT_CONFIG)
    code, out, err = run_cli(capsys, "check-config", path)
    assert code == 0 and out.startswith("ok\n")
    assert err.splitlines() == [
        f"interlock check-config: warning: {path}: gateway.helth_interval: unknown key "
        "(did you mean gateway.health_interval?)",
        f"interlock check-config: warning: {path}: gatway: unknown key (did you mean gateway?)",
    ]


def test_check_config_strict_makes_unknown_keys_errors(capsys, tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(MISSPELT_CONFIG)
    code, out, err = run_cli(capsys, "check-config", "--strict", path)
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        f"{path}: gateway.helth_interval: unknown key (did you mean gateway.health_interval?)",
        f"{path}: gatway: unknown key (did you mean gateway?)",
    ]
    path.write_text(VALID_CONFIG + "[provision]\nssh_port = 22\n")
    assert run_cli(capsys, "check-config", "--strict", path)[0] == 0


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('[gateway]\nlisten = "8000"\n', 'gateway.listen: invalid listen address "8000": missing port in address'),
        (
            '[gateway]\nlisten = "localhost:99999"\n',
            'gateway.listen: invalid listen address "localhost:99999": invalid port "99999"',
        ),
        (
            '[gateway]\nlisten = ":8000"\nmetrics_listen = ":8000"\n',
            'gateway.metrics_listen: metrics_listen ":8000" and listen ":8000" both bind port 8000',
        ),
        (
            '[[nodes]]\nip = "10.0.0.256"\n',
            'nodes[1].ip: invalid node IP "10.0.0.256": not a valid IPv4 address',
        ),
        (
            '[[nodes]]\nip = "10.0.0.2"\nvllm_port = 70000\n',
            "nodes[1].vllm_port: vllm_port must be between 1 and 65535 (got 70000)",
        ),
        (
            '[[models.available]]\nname = "m"\n[[nodes]]\nip = "10.0.0.2"\nring = "r"\n'
            '[[models.available]]\nname = "m"\nring = "r"\n',
            'models.available[1].name: model "m" is listed twice: models.available[0] (standalone) '
            'and models.available[1] (ring "r")',
        ),
    ],
)
def test_check_config_rejects_what_serve_cannot_use(capsys, tmp_path, text, error):
    path = tmp_path / "gateway.toml"
    path.write_text(VALID_CONFIG + text)
    code, out, err = run_cli(capsys, "check-config", path)
    assert (code, out) == (2, "")
    assert one_error_line(err) == f"{path}: {error}"


def test_check_config_refuses_a_log_it_could_not_write_naming_the_key_and_the_path(capsys, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    path = tmp_path / "gateway.toml"
    path.write_text(
        f'[gateway]\nevent_log = "{a_file}/logs/events.jsonl"\ndecision_log = "{tmp_path}"\n' + VALID_CONFIG
    )
    code, out, err = run_cli(capsys, "check-config", path)
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        (
            f"{path}: gateway.event_log = {a_file}/logs/events.jsonl: "
            f"cannot create its directory {a_file}/logs: {a_file} is not a directory"
        ),
        f"{path}: gateway.decision_log = {tmp_path}: {tmp_path} is a directory",
    ]
    # A folder that does not exist yet is fine: the gateway creates it. Nothing is created here.
    path.write_text(f'[gateway]\nevent_log = "{tmp_path}/new/events.jsonl"\n' + VALID_CONFIG)
    code, out, err = run_cli(capsys, "check-config", path)
    assert (code, err) == (0, "")
    assert not (tmp_path / "new").exists()


def test_check_config_prints_sizes_as_sizes(capsys, tmp_path):
    path = tmp_path / "gateway.toml"
    logs = f'event_log = "{tmp_path}/events.jsonl"\nevent_log_retain_bytes = 1073741824\n'
    logs += f'decision_log = "{tmp_path}/decisions.jsonl"\ndecision_log_max_bytes = 1000\n'
    path.write_text("[gateway]\n" + logs + VALID_CONFIG)
    code, out, _ = run_cli(capsys, "check-config", path)
    assert code == 0
    assert f"event log: {tmp_path}/events.jsonl (segments of 64 MiB, keeping up to 1 GiB)" in out
    assert f"decision log: {tmp_path}/decisions.jsonl (segments of 1000 bytes, keeping up to 1 GiB)" in out


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, culprit",
    [
        (["replay", "missing.jsonl"], "missing.jsonl: no such event log or segment"),
        (["replay", SCENARIO, "--at", "yesterday"], "argument --at: invalid time 'yesterday'"),
        (["replay", SCENARIO, "--at", "2026-01-02T03:04:05"], "expected RFC 3339"),
        (["explain", SCENARIO, "--model", "m", "--at", "2026-02-30T00:00:00Z"], "day is out of range"),
        (["audit", SCENARIO, "--since", "noon"], "argument --since: invalid time 'noon'"),
        (["audit", SCENARIO, "--kind", "health,bogus"], "unknown kind 'bogus' (kinds: run, reload, health, models,"),
        (["replay", SCENARIO, "--until-seq", "3", "--at", "1"], "not allowed with argument"),
        (["replay", SCENARIO, "--until-seq", "many"], "argument --until-seq: invalid int value: 'many'"),
        (["explain", SCENARIO], "the following arguments are required: --model"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_arguments_exit_2_with_one_clear_line(capsys, argv, culprit):
    code, out, err = run_cli(capsys, *argv)
    assert (code, out) == (2, "")
    line = one_error_line(err)
    assert line.startswith("interlock")
    assert culprit in line


def test_audit_help_names_every_transition_kind(capsys):
    code, out, _ = run_cli(capsys, "audit", "--help")
    assert code == 0
    help_text = " ".join(out.split())
    assert f"only these kinds: {', '.join(TransitionKind)}" in help_text
    assert "only these kinds: run, reload, health, models, offline, load" in help_text


def test_bad_line_in_the_middle_names_file_and_line(capsys, tmp_path):
    log = tmp_path / "events.jsonl"
    lines = SCENARIO.read_bytes().splitlines(keepends=True)
    lines[9] = b'{"type":"no_such_event","at":1.0,"seq":10}\n'
    log.write_bytes(b"".join(lines))
    code, out, err = run_cli(capsys, "audit", log)
    assert (code, out) == (2, "")
    assert one_error_line(err).startswith(f"interlock audit: error: {log}:10: ")


def test_config_that_does_not_fit_the_schema_is_a_clear_error(capsys, tmp_path):
    log = tmp_path / "events.jsonl"
    log.write_bytes(b'{"type":"run_started","version":"x","config_path":"c","config":{"nodes":"many"},"at":1,"seq":1}\n')
    code, _, err = run_cli(capsys, "replay", log)
    assert code == 2
    assert f"{log}:1: Expected `array`, got `str` - at `$.config.nodes`" in one_error_line(err)


def test_torn_last_line_is_a_warning(capsys, tmp_path):
    log = tmp_path / "events.jsonl"
    log.write_bytes(SCENARIO.read_bytes() + b'{"type":"health_probe","node":"10.0')
    code, out, err = run_cli(capsys, "replay", log)
    assert code == 0
    assert one_error_line(err).startswith(f"interlock replay: warning: {log}:279: skipping torn last line")
    _, intact, _ = run_cli(capsys, "replay", SCENARIO)
    assert out == intact


# --- several segments and runs ---------------------------------------------------------------


def write_segments(folder: Path, chunks: list[list[bytes]]) -> list[Path]:
    paths = []
    for number, chunk in enumerate(chunks, start=1):
        path = folder / f"events.{number:06d}.jsonl"
        path.write_bytes(b"".join(chunk))
        paths.append(path)
    return paths


def test_segments_are_read_in_order(capsys, tmp_path):
    lines = SCENARIO.read_bytes().splitlines(keepends=True)
    segments = write_segments(tmp_path, [lines[:100], lines[100:101], lines[101:]])
    _, whole, _ = run_cli(capsys, "audit", SCENARIO)
    code, by_name, _ = run_cli(capsys, "audit", tmp_path / "events.jsonl")
    assert code == 0
    assert by_name == whole
    _, listed, _ = run_cli(capsys, "audit", *segments)
    assert listed == whole
    _, table, _ = run_cli(capsys, "replay", tmp_path / "events.jsonl")
    _, whole_table, _ = run_cli(capsys, "replay", SCENARIO)
    assert table == whole_table


def test_a_gap_in_the_numbering_is_a_warning_and_replay_goes_on(capsys, tmp_path):
    lines = SCENARIO.read_bytes().splitlines(keepends=True)  # line i holds seq i + 1
    log = tmp_path / "events.jsonl"
    log.write_bytes(b"".join(lines[:100] + lines[103:]))
    code, out, err = run_cli(capsys, "replay", log)
    assert code == 0
    assert one_error_line(err) == "interlock replay: warning: events 101-103 are missing from the log (seq 104 follows 100)"
    assert "state after seq 278" in out
    log.write_bytes(b"".join(lines[:100] + lines[101:]))
    _, _, err = run_cli(capsys, "replay", log)
    assert one_error_line(err) == "interlock replay: warning: event 101 is missing from the log (seq 102 follows 100)"


def test_segments_out_of_order_are_a_warning(capsys, tmp_path):
    lines = SCENARIO.read_bytes().splitlines(keepends=True)
    first, second = write_segments(tmp_path, [lines[:100], lines[100:]])
    code, _, err = run_cli(capsys, "audit", second, first)
    assert code == 0
    assert one_error_line(err) == (
        "interlock audit: warning: seq 1 follows 278: the log's segments are out of order or from different gateways"
    )


def test_a_new_run_starts_from_a_fresh_state(capsys, tmp_path):
    lines = SCENARIO.read_bytes().splitlines(keepends=True)
    config = Config(nodes=(NodeConfig(ip="10.0.0.9", name="fresh"), NodeConfig(ip="10.0.0.3")), models=ModelsConfig())
    second_run = [
        RunStarted(at=START + 600, seq=279, version="0.2.0", config_path="new.toml", config=config),
        HealthProbed(at=START + 601, seq=271, node="10.0.0.9", ok=True, status=200),
    ]
    write_segments(tmp_path, [lines, [encode_event(event) for event in second_run]])
    code, out, _ = run_cli(capsys, "replay", tmp_path / "events.jsonl")
    assert code == 0
    assert "run: interlock 0.2.0, config new.toml" in out
    rows = parse_table(out)
    assert list(rows) == ["10.0.0.3", "10.0.0.9"]
    assert rows["10.0.0.3"]["STATUS"] == "healthy"  # dead in the first run; this run starts afresh
    assert rows["10.0.0.3"]["MODELS"] == "untried"
    assert rows["10.0.0.3"]["CHECKED"] == "never"
    assert rows["10.0.0.9"]["CHECKED"] == "0.0s ago"


# --- time arguments, version, the installed command ------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2026-01-02T03:04:05Z", START),
        ("2026-01-02T03:04:05.25Z", START + 0.25),
        ("2026-01-02T04:34:05+01:30", START),
        ("2026-01-01T23:04:05-04:00", START),
        ("2026-01-02 03:04:05z", START),
        ("1767323045", START),
        ("1767323045.5", START + 0.5),
    ],
)
def test_parse_time_accepts_rfc3339_and_unix_seconds(text, expected):
    assert parse_time(text) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(
    "text", ["", "now", "2026-01-02", "2026-01-02T03:04:05", "2026-01-02T25:00:00Z", "-5", "1e9"]
)
def test_parse_time_rejects_anything_else(text):
    with pytest.raises(ValueError, match="invalid time"):
        parse_time(text)


def test_version(capsys):
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0
    assert out == f"interlock {importlib.metadata.version('interlock')}\n"


def interlock_command() -> list[str]:
    script = Path(sys.executable).parent / "interlock"
    return [str(script)] if script.exists() else [sys.executable, "-m", "interlock.cli"]


def test_the_installed_command(capsys):
    _, expected, _ = run_cli(capsys, "explain", SCENARIO, "--model", "nobody/serves-this")
    finished = subprocess.run(
        interlock_command() + ["explain", str(SCENARIO), "--model", "nobody/serves-this"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (finished.returncode, finished.stdout, finished.stderr) == (3, expected, "")

"""`interlock whatif --health` and `interlock check-config --against`: a real gateway's recorded
run replayed under other health rules, or under a new config, through the CLI (a real process)."""

from __future__ import annotations

import json
from pathlib import Path

import trio
from test_policy_routing import held_requests, seen_busy, served_by, system_prompt
from test_verify import interlock
from test_whatif_cli import SCRAPED, record_run

from events.decisions import read_decisions
from events.state import Health
from interlock.whatif import first_pick
from journal.segments import list_segments

from harness import chat, decision_records, node_specs, nodes_and_gateway

THRESHOLD = 2
SENT_WHILE_DEAD = 6


async def record_an_ejection(folder: Path) -> tuple[Path, Path, str]:
    """A run of three nodes under round robin whose second node fails its probes until it is
    dead, serves nothing while the others take SENT_WHILE_DEAD requests, then recovers."""
    folder.mkdir()
    events, decisions = folder / "events.jsonl", folder / "decisions.jsonl"
    config = {"event_log": str(events), "decision_log": str(decisions), "health_interval": "50ms"}
    async with nodes_and_gateway(folder, node_specs(3), health_fail_threshold=THRESHOLD, **config) as (
        nodes,
        gateway,
    ):
        await gateway.discovered()
        failing = nodes[1]
        failing.behaviour.health = "fail"
        await gateway.wait_for(lambda: gateway.node(failing.host).status == Health.DEAD)
        for number in range(SENT_WHILE_DEAD):
            headers = {"x-request-id": f"while-dead-{number}"}
            response = await gateway.http.post(f"{gateway.url}/v1/chat/completions", json=chat(), headers=headers)
            assert response.status_code == 200
        failing.behaviour.health = "ok"
        await gateway.wait_for(lambda: gateway.node(failing.host).status == Health.HEALTHY)
        await gateway.wait_for(lambda: len(decision_records(decisions)) == SENT_WHILE_DEAD)
    [segment] = list_segments(decisions)
    return events, segment, failing.host


def test_a_higher_fail_threshold_makes_the_ejection_disappear(tmp_path):
    events, decisions, failing = trio.run(record_an_ejection, tmp_path / "run")
    same = interlock("whatif", events, "--health", f"health_fail_threshold={THRESHOLD}")
    assert same.returncode == 0, same.stderr
    assert "ejections gained 0, lost 0" in same.stdout
    assert "3 nodes with the same health intervals" in same.stdout

    result = interlock("whatif", events, "--health", "health_fail_threshold=1000", "--decisions", decisions)
    assert (result.returncode, result.stderr) == (0, ""), result.stdout
    assert "health_interval cannot be replayed" in result.stdout
    assert "ejections gained 0, lost 1" in result.stdout
    assert f"lost: {failing} dead" in result.stdout

    report = json.loads(interlock("whatif", events, "--health", "health_fail_threshold=1000", "--decisions",
                                  decisions, "--json").stdout)  # fmt: skip
    assert [e["node"] for e in report["ejections_lost"]] == [failing]
    [node] = [node for node in report["nodes"] if node["node"] == failing]
    assert Health.DEAD in {interval["status"] for interval in node["before"]}
    assert Health.DEAD not in {interval["status"] for interval in node["after"]}
    assert report["refused"] == 0
    assert 0 < report["met_dead"] <= SENT_WHILE_DEAD
    assert {request["now"] for request in report["met_dead_shown"]} == {failing}


def test_health_settings_that_cannot_be_replayed_are_refused_by_name(tmp_path):
    events = Path(__file__).parent.parent / "fixtures" / "logs" / "golden" / "events.jsonl"
    for argument, message in [
        ("health_interval=5", "health_interval cannot be replayed"),
        ("probe_timeout=5", "probe_timeout cannot be replayed"),
        ("recovery=2", "unknown health setting 'recovery'; the health rules read: health_fail_threshold"),
        ("health_fail_threshold=0", "health_fail_threshold: must be greater than zero"),
        ("health_fail_threshold=x", "health_fail_threshold: 'x' is not a whole number"),
    ]:
        result = interlock("whatif", events, "--health", argument)
        assert result.returncode == 2
        assert message in result.stderr, result.stderr


def without_node(config: Path, ip: str, folder: Path) -> Path:
    """`config` with the [[nodes]] entry of `ip` left out."""
    blocks = config.read_text().split("[[nodes]]")
    kept = [block for block in blocks if f'ip = "{ip}"' not in block]
    assert len(kept) == len(blocks) - 1
    path = folder / "new.toml"
    path.write_text("[[nodes]]".join(kept))
    return path


def test_a_dry_run_that_removes_a_node_shows_its_requests_moving(tmp_path):
    run = trio.run(record_run, tmp_path / "run", "round_robin")
    on_removed = {d.request_id for d in read_decisions(run.decisions) if first_pick(d) == run.busy}
    assert on_removed
    new = without_node(tmp_path / "run" / "gateway.toml", run.busy, tmp_path)
    result = interlock("check-config", new, "--against", run.events, "--decisions", run.decisions)
    assert (result.returncode, result.stderr) == (0, ""), result.stdout
    out = result.stdout
    moved = [line.split() for line in out.split("requests whose pick changes")[1].splitlines()
             if line.startswith(("idle-", "busy-"))]
    assert {request_id for request_id, recorded, _, _ in moved if recorded == run.busy} == on_removed
    assert run.busy not in {now for _, _, now, _ in moved}
    [row] = [line for line in out.splitlines() if line.split()[1:2] == [run.busy] and "%" in line]
    assert row.split()[4:6] == ["0", "(0.0%)"]

    unchanged = interlock("check-config", tmp_path / "run" / "gateway.toml", "--against", run.events,
                          "--decisions", run.decisions)  # fmt: skip
    assert "agreement 100.0%" in unchanged.stdout, unchanged.stdout

    since = interlock("check-config", new, "--against", run.events, "--decisions", run.decisions,
                      "--since", f"{run.middle}")  # fmt: skip
    assert since.returncode == 0, since.stderr
    assert "6 recorded requests, 6 routed again" in since.stdout
    moved_since = {line.split()[0] for line in since.stdout.splitlines() if line.startswith(("idle-", "busy-"))}
    assert moved_since and all(request_id.startswith("busy-") for request_id in moved_since)

    alone = interlock("check-config", new, "--decisions", run.decisions)
    assert alone.returncode == 2
    assert "arguments --decisions and --since: only with --against" in alone.stderr


async def record_a_policy_switch(folder: Path) -> tuple[Path, Path, Path, str]:
    """Six requests under round robin while the first node runs three requests of other clients,
    then a reload to least load (which avoids that node) and six more; the event log is cut into
    segments, each opening with a checkpoint. The config as it was at the start, both logs, and
    the busy node."""
    folder.mkdir()
    events, decisions = folder / "events.jsonl", folder / "decisions.jsonl"
    config = {
        "event_log": str(events), "decision_log": str(decisions), "event_log_max_bytes": 2_000,
        "routing": {"policy": "round_robin", **SCRAPED},
    }  # fmt: skip
    async with nodes_and_gateway(folder, node_specs(3), **config) as (nodes, gateway):
        await gateway.discovered()
        await gateway.wait_for(lambda: all(node.load.known for node in gateway.nodes()))
        config_path = folder / "gateway.toml"
        first = config_path.read_text()
        async with held_requests(nodes[0], 3):
            await seen_busy(gateway, nodes[0], 3)
            for number in range(6):
                await served_by(gateway, system_prompt("reloads"), f"round-robin-{number}")
            config_path.write_text(first.replace('policy = "round_robin"', 'policy = "least_load"'))
            assert await gateway.control_plane.reload()
            for number in range(6):
                await served_by(gateway, system_prompt("reloads"), f"least-load-{number}")
            await gateway.wait_for(lambda: len(decision_records(decisions)) == 12)
    started = folder / "started.toml"
    started.write_text(first)
    return started, events, decisions, nodes[0].host


def test_a_dry_run_changes_the_keys_that_changed_and_keeps_each_periods_policy(tmp_path):
    config, events, decisions, busy = trio.run(record_a_policy_switch, tmp_path / "run")
    assert len(list_segments(events)) > 1  # checkpoints
    threshold = tmp_path / "threshold.toml"
    threshold.write_text(config.read_text().replace("[gateway]", "[gateway]\nhealth_fail_threshold = 7", 1))
    result = interlock("check-config", threshold, "--against", events, "--decisions", decisions)
    assert (result.returncode, result.stderr) == (0, ""), result.stdout
    assert (
        "keys changed: gateway.health_fail_threshold (the rest, the policy among them unless changed, as recorded)"
        in result.stdout.splitlines()
    )
    assert "agreement 100.0%" in result.stdout  # the reload to least load is kept
    policy = tmp_path / "policy.toml"
    policy.write_text(config.read_text().replace('policy = "round_robin"', 'policy = "least_load"'))
    changed = interlock("check-config", policy, "--against", events, "--decisions", decisions)
    assert "keys changed: routing.policy (" in changed.stdout, changed.stdout
    moved = {line.split()[0] for line in changed.stdout.splitlines() if line.startswith("round-robin-")}
    assert moved  # least load from the start: round robin's picks of the busy node move

    removed = without_node(config, busy, tmp_path)
    result = interlock("check-config", removed, "--against", events)
    [row] = [line.split() for line in result.stdout.splitlines() if line.split()[1:2] == [busy]]
    assert row[-1] == "-", row  # never there, not at a checkpoint either

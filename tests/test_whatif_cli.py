"""`interlock whatif`: the requests of a real gateway's run, routed again from its event and
decision logs under another policy, offline (the nodes are gone by the time it runs)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import trio
from test_policy_routing import held_requests, scraped_idle, seen_busy, served_by, system_prompt

from events.config import ModelEntry
from events.decisions import AttemptRecord, Decision, read_decisions
from events.log import encode_event
from events.types import LoadScraped
from interlock.cli import main
from interlock.whatif import what_if
from journal.segments import list_segments

from builders import T0, make_config, node_ip, run_started
from harness import chat, decision_records, node_specs, nodes_and_gateway

SCRAPED = {"load_scrape_interval": "50ms"}


@dataclass(frozen=True)
class Run:
    events: Path
    decisions: Path
    busy: str
    """The node that was kept busy (by requests sent straight to it) for the run's second half."""
    middle: float
    """A moment between the two halves (UNIX seconds)."""


async def record_run(folder: Path, policy: str) -> Run:
    """Twelve requests under `policy` (three nodes, load scraped): six on idle nodes (each once
    a scrape has seen the last one end), then six while n1 runs three requests of other
    clients; each request opens with one of four system prompts."""
    folder.mkdir()
    events, decisions = folder / "events.jsonl", folder / "decisions.jsonl"
    routing = {"policy": policy, **SCRAPED}
    config = {"event_log": str(events), "decision_log": str(decisions), "routing": routing}
    async with nodes_and_gateway(folder, node_specs(3), **config) as (nodes, gateway):
        await gateway.discovered()
        await gateway.wait_for(lambda: all(node.load.known for node in gateway.nodes()))
        for number in range(6):
            await served_by(gateway, system_prompt(f"topic {number % 4}"), f"idle-{number}")
            await scraped_idle(gateway)
        middle = gateway.control_plane.view.now()
        async with held_requests(nodes[0], 3):
            await seen_busy(gateway, nodes[0], 3)
            for number in range(6):
                await served_by(gateway, system_prompt(f"topic {number % 4}"), f"busy-{number}")
            await gateway.wait_for(lambda: len(decision_records(decisions)) == 12)
    [segment] = list_segments(decisions)
    return Run(events=events, decisions=segment, busy=nodes[0].host, middle=middle)


@pytest.fixture(scope="module")
def round_robin_run(tmp_path_factory) -> Run:
    return trio.run(record_run, tmp_path_factory.mktemp("whatif") / "round_robin", "round_robin")


@pytest.fixture(scope="module")
def least_load_run(tmp_path_factory) -> Run:
    return trio.run(record_run, tmp_path_factory.mktemp("whatif") / "least_load", "least_load")


@pytest.fixture(scope="module")
def prefix_affinity_run(tmp_path_factory) -> Run:
    return trio.run(record_run, tmp_path_factory.mktemp("whatif") / "prefix_affinity", "prefix_affinity")


def whatif(capsys, run: Run, *options: str) -> tuple[int, str, str]:
    code = main(["whatif", str(run.events), "--decisions", str(run.decisions), *options])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def report(capsys, run: Run, *options: str) -> dict:
    code, out, err = whatif(capsys, run, "--json", *options)
    assert (code, err) == (0, "")
    return json.loads(out)


@pytest.mark.parametrize("run_name", ["round_robin_run", "least_load_run", "prefix_affinity_run"])
def test_routed_again_under_its_recorded_policy_every_request_goes_where_it_went(capsys, request, run_name):
    run = request.getfixturevalue(run_name)
    if run_name == "prefix_affinity_run":  # the node each prefix last went to is an input too
        assert any(decision.remembered for decision in read_decisions(run.decisions))
    same = report(capsys, run)
    assert (same["policy"], same["decisions"], same["routed_again"], same["changed"]) == ("recorded", 12, 12, 0)
    assert same["before"] == same["after"] and sum(same["before"].values()) == 12
    assert same["became_503"] == same["stopped_503"] == same["beyond_log"] == 0


def test_least_load_would_have_kept_the_busy_nodes_share_for_when_it_was_idle(capsys, round_robin_run):
    recorded = report(capsys, round_robin_run, "--since", str(round_robin_run.middle))
    assert recorded["before"][round_robin_run.busy] == 2  # round robin: its turn came twice in six
    shifted = report(capsys, round_robin_run, "--policy", "least_load", "--since", str(round_robin_run.middle))
    assert shifted["decisions"] == 6 and round_robin_run.busy not in shifted["after"]
    assert shifted["changed"] >= 2 and sum(shifted["after"].values()) == 6


def test_prefix_affinity_would_send_each_prompt_back_to_a_node_that_saw_it(capsys, round_robin_run):
    until = ("--until", str(round_robin_run.middle))
    recorded = report(capsys, round_robin_run, *until)
    affinity = report(capsys, round_robin_run, "--policy", "prefix_affinity", *until)
    assert recorded["prefixed"] == affinity["prefixed"] == 6
    # Four prompts, the first two twice: round robin sent each repeat to the next node, prefix
    # affinity to the node that had its prompt.
    assert (recorded["prefix_seen_before"], affinity["prefix_seen_after"]) == (0, 2)


def test_kv_aware_on_records_that_kept_no_match_says_so_and_routes_as_prefix_affinity(capsys, round_robin_run):
    kv = report(capsys, round_robin_run, "--policy", "kv_aware")
    affinity = report(capsys, round_robin_run, "--policy", "prefix_affinity")
    assert kv["kv_unmatched"] == kv["routed_again"] == 12 and affinity["kv_unmatched"] == 0
    assert kv["after"] == affinity["after"]
    code, out, _ = whatif(capsys, round_robin_run, "--policy", "kv_aware")
    assert code == 0
    assert "12 of 12 picks routed again without a KV match: their records kept none" in out


def test_the_report_is_the_same_every_time_and_reads_as_a_table(capsys, round_robin_run):
    options = ("--policy", "power_of_two")
    first, second = whatif(capsys, round_robin_run, "--json", *options), whatif(capsys, round_robin_run, "--json", *options)
    assert first == second and first[0] == 0
    code, out, _ = whatif(capsys, round_robin_run, *options)
    assert code == 0
    assert out.splitlines()[0].startswith("12 recorded requests, 12 routed again under power_of_two (open-loop: ")
    assert "NODE  IP" in out and "RECORDED" in out and "ROUTED AGAIN" in out


def test_requests_whose_snapshot_the_event_log_does_not_hold_are_counted_not_routed(capsys, round_robin_run, tmp_path):
    [segment] = list_segments(round_robin_run.events)
    lines = segment.read_text().splitlines(keepends=True)
    cut = tmp_path / "events.000001.jsonl"
    first_seq = min(record.seq for record in read_decisions(round_robin_run.decisions))
    cut.write_text("".join(line for line in lines if json.loads(line)["seq"] < first_seq))
    code, out, err = whatif(capsys, Run(cut, round_robin_run.decisions, "", 0.0), "--json")
    assert (code, err) == (0, "")
    assert json.loads(out)["beyond_log"] == 12 and json.loads(out)["routed_again"] == 0


def test_bad_input_is_named(capsys, round_robin_run, tmp_path):
    broken = tmp_path / "decisions.jsonl"
    broken.write_text('{"request_id": "x"}\n' + round_robin_run.decisions.read_text())
    code, _, err = whatif(capsys, Run(round_robin_run.events, broken, "", 0.0))
    assert code == 2 and f"{broken}:1: Object missing required field" in err
    code, _, err = whatif(capsys, round_robin_run, "--cache-entries", "0")
    assert code == 2 and "--cache-entries: must be at least 1" in err
    code, _, err = whatif(capsys, round_robin_run, "--policy", "fastest")
    assert code == 2 and "invalid choice: 'fastest'" in err
    code, _, err = whatif(capsys, round_robin_run, "--since", "2026-01-02T00:00:00Z", "--until", "2026-01-01T00:00:00Z")
    assert code == 2 and "--since: must not be after --until" in err


def test_a_request_moved_to_a_faster_node_stays_in_flight_there_for_its_duration_scaled_by_speed(tmp_path):
    """Node 1 makes its tokens 3× faster than node 2, which runs a request of another client (as
    scraped). Round robin sent A and B to node 2, 0.5 s apart; A took 0.9 s there. least_load
    would have sent A to node 1, where it would have taken 0.3 s; so B finds node 1 idle and goes
    there too. Counted for its recorded 0.9 s, A would still hold node 1, and the tie would have
    left B on node 2 (its turn)."""
    fast, slow = node_ip(1), node_ip(2)
    config = make_config(2, models=[ModelEntry(name="m")], default="m")
    scrapes = [
        LoadScraped(at=T0 + at, node=ip, running=running, waiting=0.0, token_seconds=seconds, tokens=tokens)
        for at, ip, running, seconds, tokens in [
            (1, fast, 0.0, 0.0, 0), (1, slow, 1.0, 0.0, 0), (2, fast, 0.0, 1.0, 100), (2, slow, 1.0, 3.0, 100),
        ]
    ]  # fmt: skip
    events = tmp_path / "events.jsonl"
    events.write_bytes(
        b"".join(
            encode_event(msgspec.structs.replace(event, seq=seq))
            for seq, event in enumerate([run_started(config), *scrapes], start=1)
        )
    )

    def on_slow_node(request_id: str, after: float, rotation: int) -> Decision:
        return Decision(
            request_id=request_id, at=T0 + 3 + after, path="/v1/chat/completions", model="m", stream=True, seq=5,
            ring="", ring_pool=(fast, slow), excluded=(), attempts=(AttemptRecord(node=slow, outcome="completed"),),
            status=200, duration=0.9, rotation=rotation,
        )  # fmt: skip

    requests = [on_slow_node("A", 0.0, rotation=1), on_slow_node("B", 0.5, rotation=3)]
    assert what_if([events], requests).changed == 0  # as recorded
    report = what_if([events], requests, policy="least_load")
    assert (report.changed, report.after) == (2, {fast: 2})


def test_whatif_says_what_the_requests_it_did_not_route_again_were(capsys):
    # The sample run: 41 of its 432 requests got a 503 with no node picked (none in the pool).
    logs = Path(__file__).resolve().parent.parent / "fixtures" / "logs"
    command = ["whatif", str(logs / "scenario.jsonl"), "--decisions", str(logs / "scenario-decisions.jsonl")]
    assert main([*command, "--policy", "least_load"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("432 recorded requests, 391 routed again under least_load")
    assert lines[3] == "41 not routed again: no node was picked for them when recorded (41 answered 503)"
    assert main([*command, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["unpicked"] == {"503": 41}

"""`interlock verify`: every decision of a real gateway's recorded run made again with this
checkout's code, through the CLI (a real process), on the run's own logs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from test_whatif_cli import Run, record_run

from fixtures.scenarios import DECISIONS_PATH, SCENARIO_PATH
from journal.segments import list_segments

POLICIES = ("round_robin", "least_load", "power_of_two", "prefix_affinity")


def interlock(*arguments: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "interlock.cli", *map(str, arguments)], capture_output=True, text=True, timeout=120
    )


def verify(events: Path, *decisions: Path, options: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return interlock("verify", events, "--decisions", *decisions, *options)


@pytest.fixture(scope="module", params=POLICIES)
def run(request, tmp_path_factory) -> Run:
    return trio.run(record_run, tmp_path_factory.mktemp("verify") / request.param, request.param)


def test_every_decision_of_a_fresh_run_is_made_again_as_recorded(run):
    result = verify(run.events, run.decisions)
    assert (result.returncode, result.stderr) == (0, ""), result.stdout
    assert "12 verified in full, 0 lacking policy inputs, 0 beyond the event log" in result.stdout
    assert "every decision made again matches (12 of 12)" in result.stdout


def edited(run: Run, folder: Path, number: int, edit) -> tuple[Path, str]:
    """The run's decision log with its `number`-th record edited by `edit` (a dict in place)."""
    lines = run.decisions.read_text().splitlines()
    record = json.loads(lines[number])
    edit(record)
    lines[number] = json.dumps(record)
    path = folder / "edited.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, record["request_id"]


def swap_the_pick(record: dict) -> None:
    first, second = record["candidates"][:2]
    record["candidates"][:2] = [second, first]
    record["attempts"][0]["node"] = second["node"]


@pytest.mark.parametrize("number", [0, 7])
def test_a_record_whose_pick_was_edited_fails_and_is_named(run, tmp_path, number):
    decisions, request_id = edited(run, tmp_path, number, swap_the_pick)
    result = verify(run.events, decisions)
    assert result.returncode == 1
    assert "1 records diverge" in result.stdout
    fields = {line.split()[2] for line in result.stdout.splitlines() if line.startswith(request_id)}
    assert fields == {"candidates", "pick"}


def test_a_record_whose_exclusion_was_edited_fails_and_is_named(run, tmp_path):
    def exclude_a_node(record: dict) -> None:
        record["excluded"].append({"node": record["ring_pool"][-1], "reason": "dead"})

    decisions, request_id = edited(run, tmp_path, 3, exclude_a_node)
    result = verify(run.events, decisions, options=("--json",))
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert (report["passed"], report["divergent"]) == (False, 1)
    assert [(d["request_id"], d["field"]) for d in report["divergences"]] == [(request_id, "excluded")]
    assert report["divergences"][0]["derived"] == "[]"


def test_a_log_split_over_workers_and_replicas_is_verified_per_process(run, tmp_path):
    """Each file a process's records: its counter, in-flight counts and prefix memory are in them."""
    lines = run.decisions.read_text().splitlines()
    files = []
    for index, name in enumerate(("a", "b", "c")):
        path = tmp_path / f"decisions-{name}.jsonl"
        records = [json.loads(line) for line in lines[index::3]]
        for record in records:
            record["replica"], record["worker"] = ("gw-1", index) if index < 2 else ("gw-2", 0)
        path.write_text("".join(json.dumps(record) + "\n" for record in records))
        files.append(path)
    result = verify(run.events, *files)
    assert (result.returncode, result.stderr) == (0, ""), result.stdout
    assert "12 decision records from 3 routing processes (gw-1/0 4, gw-1/1 4, gw-2/0 4)" in result.stdout


def test_records_without_policy_inputs_are_counted_and_named_not_compared(run, tmp_path):
    def strip_inputs(record: dict) -> None:
        for field in ("candidates", "rotation", "policy", "prefix", "remembered", "margin"):
            record.pop(field)
        record["attempts"][0]["node"] = "10.9.9.9"  # would diverge, were it compared

    decisions, request_id = edited(run, tmp_path, 5, strip_inputs)
    result = verify(run.events, decisions)
    assert result.returncode == 0, result.stdout
    assert "11 verified in full, 1 lacking policy inputs" in result.stdout
    assert result.stderr == (
        "interlock verify: warning: 1 of 12 decision records lack policy inputs, their picks cannot be made again"
        f" as recorded: missing candidates (1), policy (1), prefix (1), remembered (1), rotation (1): {request_id}\n"
    )


def test_records_beyond_the_event_log_fail(run, tmp_path):
    [segment] = list_segments(run.events)
    lines = segment.read_text().splitlines(keepends=True)
    cut = tmp_path / "events.jsonl"
    cut.write_text("".join(lines[:3]))
    result = verify(cut, run.decisions)
    assert result.returncode == 1
    assert "12 records not verified: the event log does not hold their snapshot" in result.stdout


def test_the_shipped_sample_holds_every_policy_input_and_warns_no_more():
    verified = verify(SCENARIO_PATH, DECISIONS_PATH)
    assert (verified.returncode, verified.stderr) == (0, "")
    assert "432 verified in full, 0 lacking policy inputs, 0 beyond the event log" in verified.stdout
    same = interlock("whatif", SCENARIO_PATH, "--decisions", DECISIONS_PATH, "--json")
    assert (same.returncode, same.stderr) == (0, "")
    assert (json.loads(same.stdout)["changed"], json.loads(same.stdout)["agreement"]) == (0, 100.0)


def test_whatif_says_what_it_is_agreement_moves_with_margins_share_deltas_open_loop():
    shifted = interlock("whatif", SCENARIO_PATH, "--decisions", DECISIONS_PATH, "--policy", "least_load")
    assert (shifted.returncode, shifted.stderr) == (0, "")
    lines = shifted.stdout.splitlines()
    assert "open-loop" in lines[0]
    assert lines[1].startswith("agreement 84.1%: 62 would have gone to another node")
    assert "SHARE Δ (POINTS)" in shifted.stdout
    assert "requests whose pick changes (the first 20 of 62):" in lines
    assert lines[lines.index("requests whose pick changes (the first 20 of 62):") + 2].split() == [
        "REQUEST", "ID", "RECORDED", "ROUTED", "AGAIN", "MARGIN"
    ]  # fmt: skip


GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "logs" / "golden"


def test_the_golden_run_is_decided_today_as_it_was_recorded():
    """The gate: a change of routing or policy code that alters a past decision fails here
    until `python -m fixtures.golden` records the run again (on purpose)."""
    result = verify(GOLDEN / "events.jsonl", GOLDEN / "decisions.jsonl", options=("--json",))
    report = json.loads(result.stdout)
    assert (result.returncode, result.stderr, report["divergences"]) == (0, "", [])
    assert report["verified"] == report["decisions"] >= 200
    assert len(report["processes"]) == 2  # two workers


def test_an_edited_golden_record_fails_and_is_named(tmp_path):
    lines = (GOLDEN / "decisions.jsonl").read_text().splitlines()
    number = next(i for i, line in enumerate(lines) if len(json.loads(line)["candidates"]) > 1)
    record = json.loads(lines[number])
    swap_the_pick(record)
    lines[number] = json.dumps(record)
    decisions = tmp_path / "decisions.jsonl"
    decisions.write_text("\n".join(lines) + "\n")
    result = verify(GOLDEN / "events.jsonl", decisions)
    assert result.returncode == 1
    assert any(line.startswith(record["request_id"]) for line in result.stdout.splitlines())


def test_the_golden_run_is_recorded_again_by_one_command_and_verifies(tmp_path):
    made = subprocess.run(
        [sys.executable, "-m", "fixtures.golden", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert made.returncode == 0, made.stderr
    result = verify(tmp_path / "events.jsonl", tmp_path / "decisions.jsonl", options=("--json",))
    report = json.loads(result.stdout)
    assert (result.returncode, report["divergences"]) == (0, [])
    records = [json.loads(line) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert {record["policy"] for record in records} == {"round_robin", "least_load", "power_of_two", "prefix_affinity"}
    assert {exclusion["reason"] for record in records for exclusion in record["excluded"]} >= {"offline", "dead"}
    assert len({record["worker"] for record in records}) == 2

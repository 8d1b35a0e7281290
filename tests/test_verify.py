"""`interlock verify`: every decision of a real gateway's recorded run made again with this
checkout's code, through the CLI (a real process), on the run's own logs."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from test_kv_routing import KvRun, record_kv_run
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
    assert result.stdout == f"12 of 12 verified, 0 not verified, 0 differ ({socket.gethostname()}/0 12)\n"
    assert [record["number"] for record in records(run.decisions)] == list(range(1, 13))


def records(decisions: Path) -> list[dict]:
    return [json.loads(line) for line in decisions.read_text().splitlines()]


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
    assert "12 of 12 verified, 0 not verified, 1 differs" in result.stdout
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
        for number, record in enumerate(records, start=1):
            record["replica"], record["worker"] = ("gw-1", index) if index < 2 else ("gw-2", 0)
            record["number"] = number
        path.write_text("".join(json.dumps(record) + "\n" for record in records))
        files.append(path)
    result = verify(run.events, *files)
    assert (result.returncode, result.stderr) == (0, ""), result.stdout
    assert result.stdout == "12 of 12 verified, 0 not verified, 0 differ (gw-1/0 4, gw-1/1 4, gw-2/0 4)\n"


def strip_inputs(record: dict) -> None:
    for field in ("candidates", "rotation", "policy", "prefix", "remembered", "margin"):
        record.pop(field)


def test_records_without_policy_inputs_are_not_verified_and_fail_unless_allowed(run, tmp_path):
    decisions, request_id = edited(run, tmp_path, 5, strip_inputs)
    result = verify(run.events, decisions)
    assert result.returncode == 1, result.stdout
    assert "11 of 12 verified, 1 not verified (1 lacking policy inputs), 0 differ" in result.stdout
    assert result.stderr == (
        "interlock verify: warning: 1 of 12 decision records lack policy inputs, their picks cannot be made again"
        f" as recorded: missing candidates (1), policy (1), prefix (1), remembered (1), rotation (1): {request_id}\n"
    )
    allowed = verify(run.events, decisions, options=("--allow-unverified",))
    assert allowed.returncode == 0, allowed.stdout
    assert "11 of 12 verified, 1 not verified (1 lacking policy inputs), allowed, 0 differ" in allowed.stdout


def test_a_record_without_policy_inputs_still_has_its_node_checked(run, tmp_path):
    def strip_and_move(record: dict) -> None:
        strip_inputs(record)
        record["attempts"][0]["node"] = "10.9.9.9"

    decisions, request_id = edited(run, tmp_path, 5, strip_and_move)
    result = verify(run.events, decisions, options=("--allow-unverified", "--json"))
    assert result.returncode == 1
    [divergence] = json.loads(result.stdout)["divergences"]
    assert (divergence["request_id"], divergence["field"], divergence["recorded"]) == (
        request_id, "attempts[0].node", "10.9.9.9"
    )  # fmt: skip


def test_records_beyond_the_event_log_fail(run, tmp_path):
    [segment] = list_segments(run.events)
    lines = segment.read_text().splitlines(keepends=True)
    cut = tmp_path / "events.jsonl"
    cut.write_text("".join(lines[:3]))
    result = verify(cut, run.decisions)
    assert result.returncode == 1
    assert "0 of 12 verified, 12 not verified (12 beyond the event log), 0 differ" in result.stdout
    assert "12 records not verified: the event log does not hold their snapshot" in result.stdout


def test_the_shipped_sample_holds_every_policy_input_and_warns_no_more():
    verified = verify(SCENARIO_PATH, DECISIONS_PATH)
    assert (verified.returncode, verified.stderr) == (0, "")
    assert verified.stdout == "432 of 432 verified, 0 not verified, 0 differ (gateway-1/0 432)\n"
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
    assert (result.returncode, report["divergences"]) == (0, [])
    assert report["verified"] == report["decisions"] >= 200
    assert len(report["processes"]) == 2  # two workers
    assert result.stderr == (  # recorded before records were numbered
        f"interlock verify: warning: {report['decisions']} of {report['decisions']} decision records are not numbered"
        " (written before records were numbered): a record missing or repeated among them cannot be seen\n"
    )


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
    assert (result.returncode, result.stderr, report["divergences"]) == (0, "", [])
    records = [json.loads(line) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    for worker in {record["worker"] for record in records}:  # each worker numbers its own records
        numbers = [record["number"] for record in records if record["worker"] == worker]
        assert numbers == list(range(1, len(numbers) + 1))
    assert {record["policy"] for record in records} == {"round_robin", "least_load", "power_of_two", "prefix_affinity"}
    assert {exclusion["reason"] for record in records for exclusion in record["excluded"]} >= {"offline", "dead"}
    assert len({record["worker"] for record in records}) == 2


# --- the tamper suite: one change of one record of a recorded run, for each kind of field ------------------


def _reorder_candidates(record: dict) -> None:
    record["candidates"] = record["candidates"][:1]


def _score(record: dict) -> None:
    record["candidates"][1]["score"] += 0.5


def _load(record: dict) -> None:
    record["candidates"][0]["running"] = 7.0


def _other_node(record: dict) -> None:
    record["attempts"][0]["node"] = record["candidates"][1]["node"]


def _extra_attempt(record: dict) -> None:
    record["attempts"].append({"node": record["candidates"][1]["node"], "outcome": "completed", "status": 200})


def _prefill_leg(record: dict) -> None:
    record["prefill_attempts"] = [{"node": record["candidates"][1]["node"], "outcome": "completed", "status": 200}]


def _refused(record: dict) -> None:
    record["admission"] = {"tenant": "default", "verdict": "refused", "refused_by": "queue_full"}


def _tenant(record: dict) -> None:
    record["admission"] = {"tenant": "someone-else"}


def _priority(record: dict) -> None:
    record["admission"] = {"tenant": "default", "priority": 3}


def _status(record: dict) -> None:
    record["status"] = 503


def _an_hour_earlier(record: dict) -> None:
    record["at"] -= 3600


TAMPERS = {
    "route": (lambda record: record.update(ring_pool=record["ring_pool"][:-1]), "ring_pool"),
    "candidates": (_reorder_candidates, "candidates"),
    "scores": (_score, "candidates[1].score"),
    "loads": (_load, "candidates[0].running"),
    "pick": (swap_the_pick, "pick"),
    "attempts": (_other_node, "attempts[0].node"),
    "attempt order": (_extra_attempt, "attempts[1]"),
    "legs": (_prefill_leg, "prefill_attempts"),
    "admission verdict": (_refused, "admission.verdict"),
    "admission tenant": (_tenant, "admission.tenant"),
    "admission priority": (_priority, "admission.priority"),
    "status": (_status, "status"),
    "times": (_an_hour_earlier, "at"),
}


@pytest.fixture(scope="module")
def least_load_run(tmp_path_factory) -> Run:
    """A run whose records have several candidates with load figures and scores."""
    return trio.run(record_run, tmp_path_factory.mktemp("tamper") / "least_load", "least_load")


@pytest.mark.parametrize("kind", TAMPERS)
def test_a_changed_field_of_any_kind_fails_naming_the_record_and_the_field(least_load_run, tmp_path, kind):
    edit, field = TAMPERS[kind]
    decisions, request_id = edited(least_load_run, tmp_path, 4, edit)
    result = verify(least_load_run.events, decisions, options=("--json",))
    assert result.returncode == 1, result.stdout
    report = json.loads(result.stdout)
    assert (request_id, field) in {(d["request_id"], d["field"]) for d in report["divergences"]}, report["divergences"]
    assert {d["request_id"] for d in report["divergences"]} == {request_id}


def test_a_missing_repeated_or_reordered_record_is_named(least_load_run, tmp_path):
    lines = least_load_run.decisions.read_text().splitlines(keepends=True)
    [process] = {f"{record['replica']}/{record['worker']}" for record in records(least_load_run.decisions)}
    request = {record["number"]: record["request_id"] for record in records(least_load_run.decisions)}

    def verified(*kept: int) -> subprocess.CompletedProcess[str]:
        path = tmp_path / "decisions.jsonl"
        path.write_text("".join(lines[index] for index in kept))
        return verify(least_load_run.events, path)

    missing = verified(0, 1, 2, 6, 7, 8, 9, 10, 11)
    assert missing.returncode == 1
    assert f"records 4-6 of {process} are missing" in missing.stdout.splitlines()
    repeated = verified(*range(6), 4, *range(6, 12))
    assert repeated.returncode == 1
    assert f"record 5 of {process} is repeated (request {request[5]})" in repeated.stdout.splitlines()
    reordered = verified(0, 1, 3, 2, *range(4, 12))
    assert reordered.returncode == 0  # nothing lost: named, not failed
    assert f"record 3 of {process} comes after later ones (request {request[3]})" in reordered.stdout.splitlines()
    moved, _ = edited(least_load_run, tmp_path, 5, lambda record: record.update(worker=record["worker"] + 1))
    other_worker = verify(least_load_run.events, moved)  # its record 6 now another process's
    assert other_worker.returncode == 1
    assert f"record 6 of {process} is missing" in other_worker.stdout.splitlines()
    retained = verified(*range(5, 12))  # the oldest segments removed by retention
    assert retained.returncode == 0, retained.stdout
    assert (
        f"the log of {process} starts at its record 6 (the older ones removed by retention, or not given)"
        in retained.stdout.splitlines()
    )


def test_a_segment_cut_mid_line_in_the_middle_is_named_as_missing_records(least_load_run, tmp_path):
    lines = least_load_run.decisions.read_text().splitlines(keepends=True)
    (tmp_path / "decisions.jsonl").write_text("".join(lines[:5]) + lines[5][:40])
    (tmp_path / "decisions.jsonl.1").write_text("".join(lines[8:]))
    process = "{replica}/{worker}".format(**json.loads(lines[0]))
    result = verify(least_load_run.events, tmp_path / "decisions.jsonl", tmp_path / "decisions.jsonl.1")
    assert result.returncode == 1
    assert f"records 6-8 of {process} are missing" in result.stdout.splitlines()
    assert "skipping torn last line" in result.stderr


def test_skip_invalid_skips_a_broken_decision_line_and_says_so(least_load_run, tmp_path):
    lines = least_load_run.decisions.read_text().splitlines(keepends=True)
    broken = tmp_path / "decisions.jsonl"
    broken.write_text("".join(lines[:3]) + '{"request_id": \n' + "".join(lines[3:]))
    assert verify(least_load_run.events, broken).returncode == 2
    skipped = verify(least_load_run.events, broken, options=("--skip-invalid",))
    assert skipped.returncode == 0, skipped.stdout
    assert f"{broken}:4: skipping invalid line" in skipped.stderr


def test_a_log_without_numbers_verifies_with_a_warning(least_load_run, tmp_path):
    unnumbered = tmp_path / "decisions.jsonl"
    lines = [json.dumps({**record, "number": 0}) + "\n" for record in records(least_load_run.decisions)]
    unnumbered.write_text("".join(lines))
    result = verify(least_load_run.events, unnumbered)
    assert result.returncode == 0, result.stdout
    assert result.stderr == (
        "interlock verify: warning: 12 of 12 decision records are not numbered (written before records were"
        " numbered): a record missing or repeated among them cannot be seen\n"
    )


def test_records_later_than_the_window_of_records_are_made_again_in_a_second_fold(least_load_run):
    """A log holds records as requests ended; those that come out of the window after the fold
    of the event log has passed their seq are made again on their own state all the same."""
    from events.decisions import read_decisions_with_gaps
    from interlock.verify import verify as verify_records

    backwards = list(reversed(list(read_decisions_with_gaps([least_load_run.decisions]))))
    report = verify_records([least_load_run.events], backwards, window=2)
    assert (report.decisions, report.verified, report.divergent) == (12, 12, 0), report.divergences


@pytest.fixture(scope="module")
def kv_run(tmp_path_factory) -> KvRun:
    """A kv_aware run whose records keep each candidate's match (`test_kv_routing`)."""
    return trio.run(record_kv_run, tmp_path_factory.mktemp("kv"))


def _matched(candidates: list[dict]) -> None:
    """A node that held nothing said to hold the whole prompt."""
    candidates[1]["kv"]["matched"] = candidates[1]["kv"]["total"]


def _total(candidates: list[dict]) -> None:
    """The prompt's blocks one more at the node that held it."""
    candidates[0]["kv"]["total"] += 1


def _not_flowing(candidates: list[dict]) -> None:
    candidates[1]["kv"]["flowing"] = False


@pytest.mark.parametrize("edit", [_matched, _total, _not_flowing], ids=["matched", "total", "flowing"])
def test_a_kv_aware_record_whose_match_was_changed_fails_naming_it(kv_run, tmp_path, edit):
    """A match is an input of the pick like load: changed where it changes a score, it fails."""
    lines = kv_run.decisions.read_text().splitlines()
    tampered = json.loads(lines[-1])
    edit(tampered["candidates"])
    lines[-1] = json.dumps(tampered)
    edited = tmp_path / "edited.jsonl"
    edited.write_text("\n".join(lines) + "\n")
    result = verify(kv_run.events, edited, options=("--json",))
    assert result.returncode == 1, result.stdout
    report = json.loads(result.stdout)
    assert {d["request_id"] for d in report["divergences"]} == {tampered["request_id"]}
    assert any(d["field"].startswith("candidates") for d in report["divergences"]), report["divergences"]

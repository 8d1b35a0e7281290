"""`interlock explain --request-id`: one recorded request, from the decision log a real gateway
wrote, and traced to the control-plane events behind its exclusions in the event log it wrote."""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import trio

from events.log import read_events
from events.types import HealthProbed, ModelsListed
from interlock.cli import main
from journal.segments import list_segments

from harness import MODEL, chat, decision_records, node_specs, nodes_and_gateway, table

CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class Recorded:
    decisions: Path
    events: Path
    n1: str
    n2: str
    n3: str


async def record_requests(tmp_path: Path) -> Recorded:
    """A gateway run with four requests: `retried` (n1 refuses, n2 answers), `after-failure`
    (n1 is dead by then), `unserved` (a configured model no node serves: 503) and `unknown` (a
    model neither configured nor served: 404). n3's model listing fails, which expires it at
    once (threshold 1): it is excluded from every request."""
    decisions, events = tmp_path / "decisions.jsonl", tmp_path / "events.jsonl"
    specs = node_specs(3)
    specs[2].behaviour.models = "error"
    config = {
        "decision_log": str(decisions),
        "event_log": str(events),
        "health_fail_threshold": 1,
        "models": [(MODEL, ""), ("nobody-serves-this", "")],
    }
    async with nodes_and_gateway(tmp_path, specs, **config) as (nodes, gateway):
        n1, n2, n3 = (node.host for node in nodes)
        await gateway.discovered()
        nodes[0].behaviour.refuse = True
        await gateway.http.post(gateway.url + CHAT, json=chat(), headers={"X-Request-Id": "retried"})
        await gateway.wait_for(lambda: gateway.node(n1).status == "dead")
        await gateway.http.post(gateway.url + CHAT, json=chat(), headers={"X-Request-Id": "after-failure"})
        unserved = chat("nobody-serves-this")
        await gateway.http.post(gateway.url + CHAT, json=unserved, headers={"X-Request-Id": "unserved"})
        await gateway.http.post(gateway.url + CHAT, json=chat("no-such-model"), headers={"X-Request-Id": "unknown"})
        await gateway.wait_for(lambda: len(decision_records(decisions)) == 4)
    [segment] = list_segments(decisions)  # the decision log's one segment, whose lines the tests read
    return Recorded(decisions=segment, events=events, n1=n1, n2=n2, n3=n3)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Recorded:
    return trio.run(record_requests, tmp_path_factory.mktemp("recorded"))


def run_cli(capsys, *argv: object) -> tuple[int, str, str]:
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def fields(out: str) -> dict[str, str]:
    """The `label  value` lines at the top of the output."""
    return dict(re.split(r"\s{2,}", line, maxsplit=1) for line in out.split("\n\n")[0].splitlines())


def seq_of_first(events_path: Path, kind: type, node: str, **match: object) -> int:
    return next(
        event.seq
        for event in read_events([events_path])
        if isinstance(event, kind) and event.node == node and all(getattr(event, k) == v for k, v in match.items())
    )


# --- the decision record alone -----------------------------------------------------------------


def test_a_retried_request(capsys, recorded):
    code, out, err = run_cli(capsys, "explain", "--request-id", "retried", "--decisions", recorded.decisions)
    assert (code, err) == (0, "")
    top = fields(out)
    assert top["request"] == "retried" and top["path"] == CHAT and top["model"] == MODEL
    assert top["stream"] == "no" and top["ring"] == "standalone" and top["status"] == "200"
    assert top["ring pool"] == f"{recorded.n1}, {recorded.n2}, {recorded.n3}"
    assert top["snapshot"].startswith("seq ") and top["time"].endswith("Z") and top["duration"].endswith(" ms")
    assert top["routed by"] == socket.gethostname()
    assert table(out, "EXCLUDED") == [{"EXCLUDED": recorded.n3, "REASON": "expired"}]
    refused, served = table(out, "ATTEMPT")
    assert refused["NODE"] == recorded.n1 and refused["OUTCOME"] == "retried" and refused["STATUS"] == "-"
    assert refused["ERROR"] != "-"
    assert served == {"ATTEMPT": "2", "NODE": recorded.n2, "OUTCOME": "completed", "STATUS": "200", "ERROR": "-"}
    assert "control plane" not in out


def test_a_request_no_node_serves_names_the_503(capsys, recorded):
    code, out, _ = run_cli(capsys, "explain", "--request-id", "unserved", "--decisions", recorded.decisions)
    assert code == 0
    assert fields(out)["status"] == '503 "no healthy node available"'
    assert table(out, "EXCLUDED") == [
        {"EXCLUDED": recorded.n1, "REASON": "missing"},
        {"EXCLUDED": recorded.n2, "REASON": "missing"},
        {"EXCLUDED": recorded.n3, "REASON": "expired"},
    ]
    assert "no attempt: no node could be picked" in out


def test_a_request_for_an_unknown_model_names_the_404(capsys, recorded):
    code, out, _ = run_cli(capsys, "explain", "--request-id", "unknown", "--decisions", recorded.decisions)
    assert code == 0
    assert fields(out)["status"] == '404 "The model `no-such-model` does not exist."'
    assert "no attempt: no node could be picked" in out


def test_json_prints_the_record(capsys, recorded):
    code, out, _ = run_cli(capsys, "explain", "--request-id", "retried", "--decisions", recorded.decisions, "--json")
    assert code == 0
    [logged] = [
        record
        for record in map(msgspec.json.decode, recorded.decisions.read_bytes().splitlines())
        if record["request_id"] == "retried"
    ]
    assert msgspec.json.decode(out) == logged


# --- traced in the event log -------------------------------------------------------------------


def test_exclusions_are_traced_to_the_transitions_behind_them(capsys, recorded):
    code, out, err = run_cli(
        capsys, "explain", recorded.events, "--request-id", "after-failure", "--decisions", recorded.decisions
    )
    assert (code, err) == (0, "")
    seq = fields(out)["snapshot"]
    assert f"control plane at {seq} (" in out
    assert "warning" not in out
    expired, dead = table(out, "NODE")
    assert [expired[key] for key in ("NODE", "NAME", "EXCLUDED", "MODELS")] == [recorded.n3, "n3", "expired", "expired"]
    expired_at = seq_of_first(recorded.events, ModelsListed, recorded.n3)
    assert expired["LAST CHANGE"].startswith(f"seq {expired_at} ")
    assert "model discovery expired (error=models endpoint returned status 500)" in expired["LAST CHANGE"]
    assert [dead[key] for key in ("NODE", "NAME", "EXCLUDED", "STATUS")] == [recorded.n1, "n1", "dead", "dead"]
    died_at = seq_of_first(recorded.events, HealthProbed, recorded.n1, ok=False)
    assert dead["LAST CHANGE"].startswith(f"seq {died_at} ")
    assert "node health changed (from=healthy, to=dead, failures=1, error=" in dead["LAST CHANGE"]


def test_a_model_filter_exclusion_is_traced_to_the_model_list(capsys, recorded):
    code, out, _ = run_cli(
        capsys, "explain", recorded.events, "--request-id", "unserved", "--decisions", recorded.decisions
    )
    assert code == 0
    rows = {row["NODE"]: row for row in table(out, "NODE")}
    assert "configured model not served by node (model=nobody-serves-this)" in rows[recorded.n1]["LAST CHANGE"]
    assert "model discovery expired" in rows[recorded.n3]["LAST CHANGE"]


def test_json_with_the_event_log_adds_the_causes(capsys, recorded):
    code, out, _ = run_cli(
        capsys, "explain", recorded.events, "--request-id", "after-failure", "--decisions", recorded.decisions, "--json"
    )
    assert code == 0
    causes = msgspec.json.decode(out)["causes"]
    assert [(cause["node"], cause["reason"]) for cause in causes] == [(recorded.n3, "expired"), (recorded.n1, "dead")]
    assert causes[0]["last_change"]["msg"] == "model discovery expired"
    assert causes[1]["last_change"]["msg"] == "node health changed" and causes[1]["last_change"]["to"] == "dead"


# --- bad input ---------------------------------------------------------------------------------


def one_error_line(err: str) -> str:
    assert "Traceback" not in err
    [line] = err.strip().splitlines()
    return line


def test_an_unknown_request_id_exits_2_naming_the_file(capsys, recorded):
    code, out, err = run_cli(capsys, "explain", "--request-id", "nope", "--decisions", recorded.decisions)
    assert (code, out) == (2, "")
    assert one_error_line(err) == (
        f"interlock explain: error: no request with id 'nope' in the decision log {recorded.decisions}"
    )


def test_a_bad_line_names_file_and_line(capsys, recorded, tmp_path):
    damaged = tmp_path / "decisions.jsonl"
    lines = recorded.decisions.read_bytes().splitlines(keepends=True)
    damaged.write_bytes(lines[0] + b'{"request_id": 7}\n' + b"".join(lines[1:]))
    code, out, err = run_cli(capsys, "explain", "--request-id", "unserved", "--decisions", damaged)
    assert (code, out) == (2, "")
    assert one_error_line(err).startswith(f"interlock explain: error: {damaged}:2: ")
    code, out, err = run_cli(capsys, "explain", "--request-id", "retried", "--decisions", damaged, "--skip-invalid")
    assert code == 0 and fields(out)["request"] == "retried"
    assert one_error_line(err).startswith(f"interlock explain: warning: {damaged}:2: skipping invalid line")


def test_a_torn_last_line_is_skipped_with_a_warning(capsys, recorded, tmp_path):
    torn = tmp_path / "decisions.jsonl"
    torn.write_bytes(recorded.decisions.read_bytes() + b'{"request_id": "cut sh')
    code, out, err = run_cli(capsys, "explain", "--request-id", "retried", "--decisions", torn)
    assert code == 0 and fields(out)["request"] == "retried"
    torn_line = len(recorded.decisions.read_bytes().splitlines()) + 1
    assert one_error_line(err).startswith(f"interlock explain: warning: {torn}:{torn_line}: skipping torn last line")


@pytest.mark.parametrize(
    ("argv", "culprit"),
    [
        (["--request-id", "r"], "required: --decisions"),
        (["--request-id", "r", "--decisions", "d.jsonl", "--model", MODEL], "argument --model: not allowed"),
        (["--request-id", "r", "--decisions", "d.jsonl", "--until-seq", "3"], "argument --until-seq: not allowed"),
        (["events.jsonl", "--model", MODEL, "--decisions", "d.jsonl"], "--decisions: only allowed with --request-id"),
        (["events.jsonl", "--model", MODEL, "--partition", "r1-from-7"], "--partition: only allowed with --request-id"),
        (["--model", MODEL], "the following arguments are required: LOG"),
    ],
)
def test_bad_arguments_exit_2_with_one_clear_line(capsys, argv, culprit):
    code, out, err = run_cli(capsys, "explain", *argv)
    assert (code, out) == (2, "")
    assert culprit in one_error_line(err)


# --- a time no date can hold (issue 37) ---------------------------------------------------------


def test_a_time_out_of_range_is_a_clear_error_in_every_tool(capsys, recorded, tmp_path):
    def with_far_time(path: Path, line: int) -> Path:
        """A copy of the log whose `line`-th line is at 1e300 (a second number no date can show)."""
        lines = path.read_bytes().splitlines(keepends=True)
        record = msgspec.json.decode(lines[line - 1])
        lines[line - 1] = msgspec.json.encode(record | {"at": 1e300}) + b"\n"
        far = tmp_path / path.name
        far.write_bytes(b"".join(lines))
        return far

    events = [segment for segment in list_segments(recorded.events)][0]
    far_events, far_decisions = with_far_time(events, 2), with_far_time(recorded.decisions, 1)
    commands = {
        "explain": ["explain", "--request-id", "retried", "--decisions", far_decisions, far_events],
        "whatif": ["whatif", "--decisions", far_decisions, "--", far_events],
        "verify": ["verify", "--decisions", far_decisions, "--", far_events],
        "timeline": ["timeline", "-o", tmp_path / "page.html", far_events],
        "audit": ["audit", far_events],
        "replay": ["replay", far_events],
    }
    for name, argv in commands.items():
        code, out, err = run_cli(capsys, *argv)
        assert code != 0, name
        assert "Traceback" not in err and "OverflowError" not in err, (name, err)
        assert "$.at" in err and "253402300799" in err, (name, err)

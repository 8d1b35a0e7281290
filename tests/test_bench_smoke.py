"""The benchmark harness's building blocks, each run briefly for real: the bench upstream answers,
the stream client measures gaps against it, wrk and nginx (when installed) drive and proxy it,
and the results are judged, rendered and written as JSON. No speed is asserted."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bench.processes import Processes
from bench.report import RESULTS_FOLDER, evaluate_targets, render, write_results
from bench.results_table import README, current_results, prune, render_table, stale_results, write_table
from bench.servers import Server, interlock_config, nginx_path, start_nginx, start_upstream
from bench.upstream import MODEL, STREAM_CHUNKS
from bench.wrk import run_wrk, wrk_path
from controlplane.infrastructure.config import load_config
from events.decisions import read_decisions
from journal.segments import list_segments

PROJECT_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def processes(tmp_path):
    """Processes started through the harness; afterwards, not one process of theirs is left."""
    with Processes(tmp_path) as processes:
        yield processes
    assert processes.leftovers() == []


@pytest.fixture
def upstream(processes) -> Server:
    return start_upstream(processes, cores=None)


def run_bench(module: str, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m module argv…` from the checkout, which must succeed; its output as text."""
    completed = subprocess.run(
        [sys.executable, "-m", module, *argv], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert completed.returncode == 0, completed.stderr
    return completed


def sse_data(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]


def test_the_upstream_answers_probes_completions_and_streams(upstream):
    base = f"http://127.0.0.1:{upstream.port}"
    with httpx.Client(timeout=60) as client:
        assert client.get(base + "/health").status_code == 200
        assert [model["id"] for model in client.get(base + "/v1/models").json()["data"]] == [MODEL]
        assert 'gpu="GPU-bench-0"' in client.get(base + "/metrics").text

        completion = client.post(upstream.url, json={"model": MODEL, "messages": []})
        assert completion.status_code == 200 and completion.json()["choices"][0]["message"]["role"] == "assistant"

        stream = client.post(upstream.url, json={"model": MODEL, "stream": True})
        events = sse_data(stream.text)
        assert stream.headers["content-type"] == "text/event-stream"
        assert len(events) == STREAM_CHUNKS and events[-1] == "[DONE]"
        assert json.loads(events[0])["object"] == "chat.completion.chunk"

        paced = client.post(upstream.url, json={"stream": True, "bench_chunks": 3, "bench_interval": 0.01})
        assert len(sse_data(paced.text)) == 3
        assert client.get(base + "/nowhere").status_code == 404


def test_the_stream_client_measures_gaps_and_cpu_against_the_upstream(upstream):
    completed = subprocess.run(
        [
            sys.executable, "-m", "bench.stream_client", upstream.url, "--concurrency", "3", "--duration", "1",
            "--warm-up", "0.3", "--chunks", "10", "--interval", "0.02", "--pid", str(upstream.process.pid),
        ],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    assert report["errors"] == 0, report["first_errors"]
    assert report["events"] > 0 and report["streams"] > 0 and report["gaps"] > 0
    assert report["added_delay_p99_ms"] is not None and report["added_delay_p99_ms"] >= report["added_delay_p50_ms"]
    assert report["cpu_seconds"] is not None


@pytest.mark.skipif(wrk_path() is None, reason="wrk is not installed")
def test_wrk_drives_the_upstream(upstream, tmp_path):
    body = json.dumps({"model": MODEL, "messages": []}).encode()
    result = run_wrk(upstream.url, body, connections=2, seconds=1, cores=None, folder=tmp_path)
    assert result.requests > 0 and result.errors == 0
    assert 0 < result.p50_ms <= result.p99_ms


@pytest.mark.skipif(nginx_path() is None, reason="nginx is not installed")
def test_nginx_proxies_to_the_upstream_and_stops_with_its_worker(processes, upstream, tmp_path):
    nginx = start_nginx(processes, tmp_path, None, upstream)
    assert len(nginx.pids()) == 2  # the master and one worker
    with httpx.Client(timeout=60) as client:
        stream = client.post(nginx.url, json={"model": MODEL, "stream": True})
    assert sse_data(stream.text)[-1] == "[DONE]"
    processes.stop(nginx.process)
    assert nginx.pids() == []


def test_the_generated_interlock_config_loads(upstream, tmp_path):
    path = tmp_path / "interlock.toml"
    path.write_text(interlock_config(tmp_path, 18000, 19000, upstream))
    config = load_config(path)
    assert [(node.ip, node.vllm_port, node.metrics_port) for node in config.nodes] == [
        ("127.0.0.1", upstream.port, upstream.port)
    ]
    assert config.models.default == MODEL and config.gateway.event_log and config.gateway.health_interval == 1.0


def test_results_are_judged_rendered_and_written_as_json(tmp_path):
    paced = [
        {"concurrency": 8, "added_delay_p99_ms": 3.0, "errors": 0, "cpu_per_chunk_us": 300.0},
        {"concurrency": 16, "added_delay_p99_ms": 25.0, "errors": 0, "cpu_per_chunk_us": 250.0},
    ]
    requests = {"requests_per_second": 300.0, "p50_ms": 40.0, "p99_ms": 90.0, "errors": 0}
    results = {
        "started_at": "2026-01-02 03:04:05 UTC",
        "machine": {"cpu_model": "test CPU", "cores_available": 2, "kernel": "6.1", "python": "3.11.7", "load_average_at_start": "0.01 0.02 0.03"},
        "settings": {
            "cores": "server on core 0, load on core 1", "duration": 1.0, "warm_up": 0.5, "connections": 16,
            "sse_chunks": 64, "paced_concurrency": [8, 16, 32], "paced_interval": 0.02, "paced_chunks": 100,
        },
        "notes": [],
        "rows": {
            "floor": {"requests": {**requests, "cpu_per_request_us": 1000.0}},
            "interlock": {"requests": {**requests, "cpu_per_request_us": 2500.0}, "paced": paced, "peak_rss_bytes": 50 << 20},
        },
        "replay": {"events": 1000, "seconds": [0.004], "median_seconds": 0.004, "events_per_second": 250_000.0},
    }
    results["targets"] = evaluate_targets(results)
    verdicts = {target["target"].split(" ")[0]: target["verdict"] for target in results["targets"]}
    assert verdicts["non-streaming"] == "MISS"  # 2.5x the floor
    assert verdicts[">="] == "MISS"  # held 8 streams
    assert verdicts["replay"] == "PASS"
    assert verdicts["control"] == "n/a"

    table = render(results)
    assert "2.50x" in table and "held 8, passed at 16" in table

    first, second = write_results(results, tmp_path), write_results(results, tmp_path)
    assert first != second and first.suffix == ".json"
    assert json.loads(first.read_text()) == json.loads(second.read_text()) == results



def test_bench_results_holds_the_latest_run_of_each_bench_and_the_table_of_their_figures():
    command = "python -m bench.results_table --prune"
    assert stale_results(RESULTS_FOLDER) == [], f"older runs in bench/results/ (git keeps them): {command}"
    assert (RESULTS_FOLDER / README).read_text() == render_table(RESULTS_FOLDER), f"the table is not current: {command}"


def _bench_run(targets: dict[str, str]) -> dict:
    """A `python -m bench` result measuring these targets (their figure: what was measured)."""
    return {"rows": {}, "targets": [{"target": name, "verdict": "PASS", "measured": text} for name, text in targets.items()]}


def test_a_run_supersedes_its_bench_s_earlier_ones_and_each_target_keeps_its_latest_figure(tmp_path):
    def result(name: str, content: dict) -> None:
        (tmp_path / name).write_text(json.dumps(content))

    admission = {"targets": [{"run": "flood", "target": "B's p99 <= 2x idle", "verdict": "MISS", "measured": "3x"}]}
    result("2026-01-02T03-04-05Z-admission.json", admission)
    result("2026-01-03T03-04-05Z-admission.json", admission | {"targets": [admission["targets"][0] | {"measured": "1.5x"}]})
    result("2026-01-02T03-04-05Z.json", _bench_run({"replay": "250,000 events/s", "CPU": "900 us"}))
    result("2026-01-03T03-04-05Z.json", _bench_run({"CPU": "800 us"}))  # --sections requests
    side_by_side = tmp_path / "2026-01-04T03-04Z-side-by-side-abc1234"
    side_by_side.mkdir()
    (side_by_side / README).write_text("| CPU | base | head |\n|---|---|---|\n| per request | 500 us | 450 us |\n")
    again = write_results(admission, tmp_path, kind="admission"), write_results(admission, tmp_path, kind="admission")

    current = {kind: [path.name for path, _ in runs] for kind, runs in current_results(tmp_path).items()}
    assert current == {
        "admission": [again[1].name],  # the second of one second is the later
        "bench": ["2026-01-02T03-04-05Z.json", "2026-01-03T03-04-05Z.json"],
        "side-by-side": [side_by_side.name],
    }
    table = render_table(tmp_path)
    assert "| bench | replay | 250,000 events/s | PASS | [2026-01-02T03-04-05Z.json]" in table
    assert "| bench | CPU | 800 us | PASS | [2026-01-03T03-04-05Z.json]" in table and "900 us" not in table
    assert "| side-by-side | per request (CPU) | base: 500 us; head: 450 us |" in table

    deleted = prune(tmp_path)
    assert sorted(path.name for path in deleted) == sorted(
        ["2026-01-02T03-04-05Z-admission.json", "2026-01-03T03-04-05Z-admission.json", again[0].name]
    )
    assert write_table(tmp_path).read_text() == table  # what was pruned was in no row
    assert stale_results(tmp_path) == []

def test_the_failover_drill_kills_a_node_under_load_and_counts_the_failures():
    completed = subprocess.run(
        [sys.executable, "-m", "bench.failover_drill", "--duration", "2", "--kill-at", "1", "--settings", "on"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 0, completed.stderr
    [run] = json.loads(completed.stdout.splitlines()[-1])["runs"]
    assert run["retry_unanswered"] is True and run["requests"] > 0
    assert run["failed"] == 0, run["failures"]


def test_the_log_files_bench_measures_the_writers_and_a_checkpoint():
    from bench.log_files import measure_checkpoint, measure_writer

    writer = measure_writer(batch_count=5, rounds=1)
    assert writer["plain_us"] > 0 and writer["segmented_us"] > 0 and writer["batch_bytes"] > 0
    checkpoint = measure_checkpoint(node_count=10, rounds=1)
    assert checkpoint["nodes"] == 10 and checkpoint["kib"] > 0 and checkpoint["decode_ms"] > 0


def test_the_routing_bench_runs_each_policy_and_keeps_its_logs(tmp_path):
    completed = run_bench(
        "bench.routing", "--duration", "2", "--rate", "5", "--policies", "round_robin,least_load",
        "--out", str(tmp_path / "results"), "--logs", str(tmp_path / "logs"),
    )  # fmt: skip
    [path] = (tmp_path / "results").iterdir()
    results = json.loads(path.read_text())
    assert [run["policy"] for run in results["runs"]] == ["round_robin", "least_load"]
    for run in results["runs"]:
        assert run["requests"] > 0 and run["failed"] == 0 and sum(run["share"].values()) > 0.99
        assert list_segments(tmp_path / "logs" / run["policy"] / "decisions.jsonl")
    least_load, prefix_affinity, what_if = (target["verdict"] for target in results["targets"])
    assert least_load in ("PASS", "MISS") and prefix_affinity == "n/a"  # prefix_affinity was not run
    # whatif read the round-robin run's logs and routed its requests under least_load.
    assert what_if in ("PASS", "MISS") and abs(sum(results["whatif"]["predicted_share"].values()) - 1) < 0.01
    assert "round_robin" in completed.stdout and "least_load" in completed.stdout


def test_the_disaggregated_bench_measures_both_settings_without_failures(tmp_path):
    completed = run_bench("bench.disaggregated", "--requests", "20", "--rounds", "1", "--out", str(tmp_path))
    [path] = tmp_path.iterdir()
    rows = json.loads(path.read_text())["rows"]
    assert [row["setting"] for row in rows] == ["whole", "two legs"]
    assert all(row[mode]["failures"] == 0 for row in rows for mode in ("whole_answer", "streamed"))
    assert "two legs" in completed.stdout


def test_the_call_count_profiles_the_gateway_only_while_the_load_runs(tmp_path):
    out = tmp_path / "calls.json"
    completed = run_bench(
        "bench.call_count", "--requests", "30", "--streams", "2", "--chunks", "5", "--top", "500", "--out", str(out)
    )
    result = json.loads(out.read_text())
    requests, chunks = result["per_small_request"], result["per_paced_chunk"]
    assert (requests["units"], chunks["units"]) == (30, 10)
    for figures in (requests, chunks):
        assert 0 < figures["own_per_unit"] < figures["all_per_unit"]
        assert all(not where.startswith(("bench/", "/")) for where, _ in figures["top_own"])
    # One ledger per request counted: the warm-up's requests, before the window, are not.
    ledger = re.compile(r"dataplane/ledger\.py:\d+\(__init__\)")
    ledgers = [calls for where, calls in requests["top_own"] if ledger.fullmatch(where)]
    assert ledgers == [1.0]
    assert "calls per small request: own" in completed.stdout


def test_the_call_count_measures_cpu_time_instead_without_the_profiler(tmp_path):
    out = tmp_path / "cpu.json"
    run_bench("bench.call_count", "--cpu", "--requests", "30", "--streams", "2", "--chunks", "5", "--out", str(out))
    result = json.loads(out.read_text())
    assert (result["per_small_request"]["units"], result["per_paced_chunk"]["units"]) == (30, 10)
    assert result["per_small_request"]["cpu_us_per_unit"] >= 0 and "own_per_unit" not in result["per_small_request"]


def test_the_admission_bench_runs_a_flood_with_and_without_admission(tmp_path):
    completed = run_bench(
        "bench.admission", "--duration", "2", "--idle-duration", "1", "--grace", "3", "--token-window", "1",
        "--out", str(tmp_path), timeout=180,
    )  # fmt: skip
    [path] = tmp_path.iterdir()
    results = json.loads(path.read_text())
    runs = {run["run"]: run["tenants"] for run in results["runs"]}
    assert list(runs) == [
        "idle",
        "no admission",
        "admission, equal priorities",
        "admission, B above A",
        "admission, B above A, headroom 1",
        "admission, B above A, headroom 2",
        "admission, equal priorities, node priority scheduling",
        "admission, B above A, node priority scheduling",
    ]
    assert runs["idle"]["B"]["completed"] == runs["idle"]["B"]["requests"] > 0
    for name, tenants in runs.items():
        if name.startswith("admission"):
            # With admission the flooding tenant hears only from the gateway, never of a node's failure.
            assert tenants["A"]["node_error"] == 0 and tenants["A"]["completed"] > 0
    assert results["token_run"]["window_opened_at_seconds"] is not None  # the limit refused, then the window
    verdicts = {target["verdict"] for target in results["targets"]}
    assert verdicts <= {"PASS", "MISS"} and "admission" in completed.stdout


def test_the_kv_bench_routes_by_the_nodes_events_and_judges_kv_aware_against_prefix_affinity(tmp_path):
    completed = run_bench(
        "bench.kv", "--duration", "2", "--rate", "2", "--turns", "2", "--cpu-requests", "4",
        "--policies", "prefix_affinity,kv_aware", "--out", str(tmp_path / "results"), "--logs", str(tmp_path / "logs"),
    )  # fmt: skip
    [path] = (tmp_path / "results").iterdir()
    results = json.loads(path.read_text())
    assert [run["policy"] for run in results["runs"]] == ["prefix_affinity", "kv_aware"]
    for run in results["runs"]:
        assert run["requests"] > 0 and run["failed"] == 0 and sum(run["share"].values()) > 0.99
        assert run["prompt_blocks"] > 0 and 0 <= run["hit_ratio"] <= 1  # the nodes' own counters
    # kv_aware matched the prompts against what the nodes' KV events said they hold.
    records = list(read_decisions(next((tmp_path / "logs" / "kv_aware").glob("decisions.*.jsonl"))))
    assert records and all(record.policy == "kv_aware" for record in records)
    assert any(candidate.kv and candidate.kv.matched for record in records for candidate in record.candidates)
    assert [row["policy"] for row in results["cpu"]] == ["prefix_affinity", "kv_aware"]
    assert all(row[size]["failures"] == 0 for row in results["cpu"] for size in ("1000", "8000"))
    verdicts = [target["verdict"] for target in results["targets"]]
    assert set(verdicts[:3]) <= {"PASS", "MISS"} and verdicts[3:] == ["", ""]  # the CPU figures have no target
    assert "kv_aware" in completed.stdout

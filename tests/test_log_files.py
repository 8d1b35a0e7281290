"""The event log and the decision log are the audit trail: nothing may corrupt them.

A second gateway on the same logs, a disk that fills (a file-size limit on the gateway process:
the kernel cuts writes short, then refuses them), a segment deleted or moved away, retention
removing the oldest segments: each through a real gateway, the logs read back by the real
readers and the `interlock` CLI.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
from pathlib import Path

import httpx
import msgspec
import pytest
import trio
from prometheus_client import CollectorRegistry, Counter

from controlplane.rules.reducer import INITIAL_STATE, reduce
from controlplane.effects.replay import replay
from controlplane.effects.control_plane import segment_head
from events.decisions import read_decisions
from events.log import decode_event, encode_event, read_events
from events.types import Checkpoint, HealthProbed, RunStarted, RunStopped
from fixtures.node import serve_nodes
from interlock.cli import main
from journal.reader import segment_lines
from journal.segments import list_segments
from journal.writer import LogAppender, SegmentedFile

from builders import T0, encode_state, make_config, node_ip, run_started
from harness import (
    MODEL,
    CapturedLog,
    chat,
    config_text,
    decision_records,
    node_specs,
    nodes_and_gateway,
    serve_process,
)

CHAT = "/v1/chat/completions"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class GatewayFile:
    """A config file for `interlock serve` on free ports it names."""

    def __init__(self, path: Path, nodes, **gateway: object) -> None:
        self.path = path
        self.api = f"127.0.0.1:{free_port()}"
        self.metrics = f"127.0.0.1:{free_port()}"
        text = config_text(nodes, **gateway)
        text = text.replace('listen = "127.0.0.1:0"', f'listen = "{self.api}"', 1)
        path.write_text(text.replace('metrics_listen = "127.0.0.1:0"', f'metrics_listen = "{self.metrics}"', 1))


# --- a second instance -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("logs", "named"),
    [
        (("event_log",), "event log"),
        (("event_log", "decision_log"), "decision log"),
        (("decision_log",), "decision log"),
    ],
)
async def test_a_second_gateway_on_the_same_logs_exits_1_naming_the_log_and_its_holder_and_writes_nothing(
    tmp_path, logs, named
):
    paths = {"event_log": tmp_path / "var" / "events.jsonl", "decision_log": tmp_path / "var" / "decisions.jsonl"}
    keys = {key: str(paths[key]) for key in logs}
    async with serve_nodes(node_specs(1)) as nodes:
        first_config = GatewayFile(tmp_path / "first.toml", nodes, **keys)
        second_config = tmp_path / "second.toml"  # the same logs, other ports
        second_config.write_text(config_text(nodes, **keys))
        async with serve_process(first_config.path) as first:
            await first.wait_for_log("metrics server listening")
            async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
                assert (await http.post(f"http://{first_config.api}{CHAT}", json=chat())).status_code == 200
                seq = int((await http.get(f"http://{first_config.api}/health")).headers["X-Interlock-Seq"])
            if "event_log" in logs:  # written: every event so far, and the request's decision record
                await wait_until(lambda: logged_seq(paths["event_log"]) >= seq)
            if "decision_log" in logs:
                await wait_until(lambda: len(decision_records(paths["decision_log"])) == 1)
            segments = {key: list_segments(paths[key]) for key in logs}
            contents = {segment: segment.read_bytes() for key in logs for segment in segments[key]}
            async with serve_process(second_config) as second:
                code, lines, errors = await second.exit()
            assert {segment: segment.read_bytes() for segment in contents} == contents
            first.process.send_signal(signal.SIGTERM)
            first_code, _, _ = await first.exit()
    log_path = paths["event_log" if named == "event log" else "decision_log"]
    assert (code, lines) == (1, [])
    assert errors == f"fatal: {named} {log_path} is in use by another process (pid {first.process.pid})\n"
    assert first_code == 0
    for key in logs:
        assert list_segments(paths[key]) == segments[key]  # no segment of the second instance
    if "event_log" in logs:
        events = list(read_events([paths["event_log"]]))
        assert [type(event) for event in events].count(RunStarted) == 1
        assert isinstance(events[-1], RunStopped)


# --- a full disk -----------------------------------------------------------------------------


def file_size_limit(limit: int):
    """A preexec_fn: files the gateway writes cannot grow past `limit` bytes (EFBIG after a
    short write, as on a disk that fills up; Python ignores SIGXFSZ)."""

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    return apply


@pytest.mark.parametrize(
    "limit",
    [
        pytest.param(16, id="the first write of each segment fails"),
        pytest.param(3000, id="a write is cut short mid-segment"),
    ],
)
async def test_short_and_failed_writes_leave_both_logs_whole_counted_and_logged_once(tmp_path, limit):
    event_log, decision_log = tmp_path / "events.jsonl", tmp_path / "decisions.jsonl"
    keys = {"event_log": str(event_log), "decision_log": str(decision_log), "health_interval": "200ms"}
    sent = 0
    async with serve_nodes(node_specs(2)) as nodes:
        config = GatewayFile(tmp_path / "gateway.toml", nodes, **keys)
        async with (
            serve_process(config.path, preexec_fn=file_size_limit(limit)) as gateway,
            httpx.AsyncClient(timeout=60, trust_env=False) as http,
        ):
            await gateway.wait_for_log("metrics server listening")

            async def request() -> None:
                nonlocal sent
                response = await http.post(
                    f"http://{config.api}{CHAT}", json=chat(), headers={"X-Request-Id": f"r{sent}"}
                )
                assert response.status_code == 200
                sent += 1

            with trio.fail_after(60):
                while not gateway.logged("decision log write failed"):
                    await request()
                    with trio.move_on_after(0.1):
                        await gateway.wait_for_log("decision log write failed")
                await gateway.wait_for_log("event log write failed")
                while True:  # more batches fail, and are kept for the next try
                    metrics_text = (await http.get(f"http://{config.metrics}/metrics")).text
                    if all(sample(metrics_text, f"interlock_{log}_write_errors_total") >= 2 for log in LOGS):
                        break
                    await trio.sleep(0.05)
            resource.prlimit(gateway.process.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
            await gateway.wait_for_log("event log write recovered")
            await gateway.wait_for_log("decision log write recovered")
            await request()
            await wait_until(lambda: len(decision_records(decision_log)) == sent)
            gateway.process.send_signal(signal.SIGTERM)
            code, lines, errors = await gateway.exit()
    assert (code, errors) == (0, "")
    for what in ("event log", "decision log"):
        [failure] = [line for line in lines if line["msg"] == f"{what} write failed"]  # once per streak
        assert failure["level"] == "error" and "File too large" in failure["error"]
        errors_total = sample(metrics_text, f"interlock_{what.replace(' ', '_')}_write_errors_total")
        assert errors_total >= 2
    # Every segment holds whole lines only: nothing torn, nothing empty, nothing missing.
    for log in (event_log, decision_log):
        for segment in list_segments(log):
            data = segment.read_bytes()
            assert data and data.endswith(b"\n"), segment
    warnings: list[str] = []
    events = list(read_events([event_log], warn=warnings.append))
    assert [event.seq for event in events] == list(range(1, len(events) + 1))
    assert isinstance(events[0], RunStarted) and isinstance(events[-1], RunStopped)
    assert [record.request_id for record in decision_records(decision_log)] == [f"r{i}" for i in range(sent)]
    result = replay([event_log], warn=warnings.append)
    assert warnings == [] and result.state.seq == events[-1].seq


LOGS = ("event_log", "decision_log")


async def wait_until(condition, timeout: float = 60.0) -> None:
    """Wait until `condition()` holds (TooSlowError after `timeout` seconds)."""
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.02)


def logged_seq(event_log: Path) -> int:
    """The seq of the last event the log holds so far (0 if none)."""
    if not list_segments(event_log):
        return 0
    return max((event.seq for event in read_events([event_log])), default=0)


def sample(metrics_text: str, name: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no sample {name}")


# --- deleted or moved under the gateway ------------------------------------------------------


async def test_a_segment_deleted_or_moved_away_is_noticed_and_the_logs_go_on_in_new_segments(tmp_path):
    event_log, decision_log = tmp_path / "events.jsonl", tmp_path / "decisions.jsonl"
    config = {"event_log": str(event_log), "decision_log": str(decision_log), "health_interval": "200ms"}
    async with nodes_and_gateway(tmp_path, node_specs(2), **config) as (_, gateway):
        await gateway.discovered()
        assert (
            await gateway.http.post(gateway.url + CHAT, json=chat(), headers={"X-Request-Id": "before"})
        ).status_code == 200
        await gateway.wait_for(lambda: decision_records(decision_log) and list_segments(event_log))
        [first_events] = list_segments(event_log)
        [first_decisions] = list_segments(decision_log)

        first_events.unlink()  # deleted: noticed at the next write
        await gateway.wait_for(lambda: gateway.logged("event log segment deleted or moved; starting a new segment"))
        [notice] = gateway.logged("event log segment deleted or moved; starting a new segment")
        assert (notice["level"], notice["path"]) == ("warn", str(first_events))

        rotated = first_decisions.with_name("decisions.jsonl.1")
        first_decisions.rename(rotated)  # logrotate's move, then its SIGHUP
        os.kill(os.getpid(), signal.SIGHUP)
        moved = "decision log segment deleted or moved; the next write starts a new segment"
        await gateway.wait_for(lambda: gateway.logged(moved))
        assert gateway.logged(moved)[0]["path"] == str(first_decisions)
        assert (
            await gateway.http.post(gateway.url + CHAT, json=chat(), headers={"X-Request-Id": "after"})
        ).status_code == 200
        await gateway.wait_for(lambda: decision_records(decision_log))
        assert [record.request_id for record in decision_records(decision_log)] == ["after"]
        assert [record.request_id for record in read_decisions(rotated)] == ["before"]
        # The new event-log segment is self-contained: it opens with the whole state.
        [second_events] = list_segments(event_log)
        assert isinstance(decode_event(next(segment_lines(second_events))), Checkpoint)
        seq = gateway.control_plane.view.snapshot.seq
        await gateway.wait_for(lambda: gateway.control_plane.view.snapshot.seq > seq + 5)
    live = gateway.control_plane.view.snapshot
    warnings: list[str] = []
    replayed = replay([event_log], warn=warnings.append)
    assert Checkpoint.of(replayed.state).digest() == Checkpoint.of(live).digest()
    assert warnings == [f"the log starts at the checkpoint of seq {replayed.from_seq} (its older segments are gone)"]


# --- retention -------------------------------------------------------------------------------


async def test_retention_removes_the_oldest_segments_and_replay_explain_and_audit_work_on_the_rest(tmp_path, capsys):
    event_log, decision_log = tmp_path / "events.jsonl", tmp_path / "decisions.jsonl"
    config = {
        "event_log": str(event_log),
        "event_log_max_bytes": 4096,
        "event_log_retain_bytes": 16384,
        "decision_log": str(decision_log),
        "decision_log_max_bytes": 1024,
        "decision_log_retain_bytes": 2048,
        "health_interval": "100ms",
    }
    async with nodes_and_gateway(tmp_path, node_specs(2), **config) as (_, gateway):
        await gateway.discovered()
        sent = 0
        with trio.fail_after(30):
            while not (
                gateway.logged("event log segment removed by retention")
                and gateway.logged("decision log segment removed by retention")
            ):
                response = await gateway.http.post(
                    gateway.url + CHAT, json=chat(), headers={"X-Request-Id": f"r{sent}"}
                )
                assert response.status_code == 200
                sent += 1
                await trio.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
        assert await gateway.exited() == 0
    live = gateway.control_plane.view.snapshot
    removed = {record["path"] for record in gateway.logged("event log segment removed by retention")}
    segments = list_segments(event_log)
    assert removed and not removed & {str(segment) for segment in segments}
    assert sum(segment.stat().st_size for segment in segments[:-1]) <= 16384
    first_event = decode_event(next(segment_lines(segments[0])))
    assert isinstance(first_event, Checkpoint)
    start = first_event.seq

    assert main(["replay", str(event_log)]) == 0
    out, err = capsys.readouterr()
    assert f"replayed from seq {start}" in out.splitlines()[0]
    assert (
        err
        == f"interlock replay: warning: the log starts at the checkpoint of seq {start} (its older segments are gone)\n"
    )
    assert Checkpoint.of(replay([event_log]).state).digest() == Checkpoint.of(live).digest()

    assert main(["audit", str(event_log)]) == 0
    out, err = capsys.readouterr()
    assert '"msg":"gateway stopped"' in out.splitlines()[-1]
    assert f"checkpoint of seq {start}" in err

    assert main(["explain", str(event_log), "--model", MODEL]) == 0
    out, err = capsys.readouterr()
    assert f"checkpoint of seq {start}" in err

    records = decision_records(decision_log)
    assert records and records[0].request_id != "r0"  # the oldest records are gone
    assert records[-1].request_id == f"r{sent - 1}"
    kept = next(record for record in records if record.seq > start)
    assert main(["explain", str(event_log), "--request-id", kept.request_id, "--decisions", str(decision_log)]) == 0
    out, err = capsys.readouterr()
    assert kept.request_id in out


# --- a backlog that overflows ----------------------------------------------------------------


async def test_a_full_backlog_drops_the_newest_and_what_follows_the_gap_opens_a_segment_with_a_checkpoint(tmp_path):
    """The appender alone, on real files: while the disk refuses writes, three events wait and
    two more are dropped; once it writes again, the events after the gap open a new segment
    with the state they follow, so both segments replay to the live state."""
    config = make_config(2)
    events = [run_started(config)] + [
        HealthProbed(at=T0 + i, node=node_ip(1 + i % 2), ok=i % 3 != 0, status=200) for i in range(1, 8)
    ]
    numbered, states = [], [INITIAL_STATE]
    for seq, event in enumerate(events, start=1):
        numbered.append(msgspec.structs.replace(event, seq=seq))
        states.append(reduce(states[-1], numbered[-1])[0])
    blocker = tmp_path / "var"
    blocker.write_text("")  # where the log's folder should be: every write fails
    registry = CollectorRegistry()
    log = CapturedLog()
    appender = LogAppender(
        SegmentedFile(blocker / "events.jsonl", "event log", max_segment_bytes=1 << 20),
        log=log,
        write_errors=Counter("write_errors", "", registry=registry),
        dropped=Counter("dropped", "", registry=registry),
        backlog_limit=3,
        head=segment_head,
        batch_seconds=0.01,
    )

    def submit(first: int, last: int) -> None:  # the events numbered first..last
        for seq in range(first, last + 1):
            appender.submit(encode_event(numbered[seq - 1]), base=states[seq - 1])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(appender.run)
        submit(1, 3)
        with trio.fail_after(60):
            while not registry.get_sample_value("write_errors_total"):
                await trio.sleep(0.01)
        submit(4, 5)  # the backlog is full: dropped
        blocker.unlink()
        with trio.fail_after(60):
            while "event log write recovered" not in log.messages():
                await trio.sleep(0.01)
        submit(6, 8)
        nursery.cancel_scope.cancel()
    await appender.aclose()

    assert registry.get_sample_value("dropped_total") == 2
    first, second = list_segments(blocker / "events.jsonl")
    assert [event.seq for event in read_events([first])] == [1, 2, 3]
    assert list(read_events([second])) == [Checkpoint.of(states[5]), *numbered[5:]]
    warnings: list[str] = []
    result = replay([blocker / "events.jsonl"], warn=warnings.append)
    assert warnings == ["events 4-5 are missing from the log; the checkpoint at seq 5 restores the state"]
    assert encode_state(result.state) == encode_state(states[-1])


def test_retention_by_age_removes_segments_last_written_too_long_ago(tmp_path):
    """When a segment is started, those last written before the age bound are removed, oldest
    first, and never the one being written; by size, the oldest go until the rest fit."""
    log = tmp_path / "decisions.jsonl"
    now = [T0]
    file = SegmentedFile(log, "decision log", max_segment_bytes=10, retain_seconds=3600, clock=lambda: now[0])
    for number in range(3):
        file.write(b'{"n":%d}\n' % number, new_segment=True)
    first, second, third = list_segments(log)
    os.utime(first, (T0 - 7200, T0 - 7200))
    os.utime(second, (T0 - 60, T0 - 60))
    os.utime(third, (T0 - 7200, T0 - 7200))  # old too, but after a recent one: segments go in order
    notes = file.write(b'{"n":3}\n', new_segment=True)
    assert [(note.msg, note.path) for note in notes] == [("decision log segment removed by retention", first)]
    assert list_segments(log)[:2] == [second, third]
    file.retain_bytes = 20  # two segments of 8 bytes fit, with the new one being written
    file.write(b'{"n":4}\n', new_segment=True)
    assert [segment.read_bytes() for segment in list_segments(log)] == [b'{"n":3}\n', b'{"n":4}\n']
    file.close()

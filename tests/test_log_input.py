"""Logs nobody should trust: a line nested too deep to decode, and a log larger than memory
should be, read by the real `interlock` command (a subprocess) and by `serve` at start-up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from controlplane.effects.replay import replay
from events.log import decode_event, encode_event
from events.types import Checkpoint
from fixtures import scenarios
from journal.segments import list_segments

from harness import PROJECT_ROOT, node_specs, nodes_and_gateway

SCENARIO = scenarios.SCENARIO_PATH
DECISIONS = scenarios.DECISIONS_PATH
DEEP_ARRAY = b"[" * 100_000
"""Not an event (an array), and not a torn line either: the gateway never writes one this deep."""
DEEP_MEMBER = b'{"type":"run_stopped","at":1,"seq":1,"x":' + DEEP_ARRAY
"""An event with a member nested deeper than msgspec's recursion limit: not even skipped."""
NESTED_TOO_DEEP = "JSON is nested too deep"


def interlock(*argv: object, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "interlock.cli", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=PROJECT_ROOT,
    )


def with_line(folder: Path, source: Path, number: int | None, line: bytes | None) -> Path:
    """A copy of `source` in `folder` with line `number` replaced by `line` (number None: `line`
    appended last; line None: the line left out)."""
    lines = source.read_bytes().splitlines(keepends=True)
    if number is None:
        lines.append(line + b"\n" if line is not None else b"")
    else:
        lines[number - 1] = line + b"\n" if line is not None else b""
    folder.mkdir(exist_ok=True)
    copy = folder / source.name
    copy.write_bytes(b"".join(lines))
    return copy


def commands(events: Path, decisions: Path, folder: Path) -> dict[str, list[object]]:
    """Every command that reads an event log, by name."""
    return {
        "replay": ["replay", events],
        "audit": ["audit", events],
        "explain": ["explain", events, "--model", scenarios.MODEL_7B],
        "explain --request-id": ["explain", events, "--request-id", "req-00001", "--decisions", decisions],
        "whatif": ["whatif", events, "--decisions", decisions],
        "timeline": ["timeline", events, "--decisions", decisions, "-o", folder / "timeline.html"],
    }


COMMANDS = list(commands(SCENARIO, DECISIONS, Path()))
READING_THE_WHOLE_LOG = ["replay", "audit", "explain", "timeline"]
"""The others stop at the last seq a decision record names."""


def assert_stopped_at(finished: subprocess.CompletedProcess, command: str, path: Path, number: int, error: str) -> None:
    """`interlock COMMAND` exited 2 with nothing on stdout and one line on stderr: path:number: error."""
    assert (finished.returncode, finished.stdout) == (2, "")
    assert "Traceback" not in finished.stderr
    prog = command.split()[0]
    assert finished.stderr.splitlines() == [f"interlock {prog}: error: {path}:{number}: {error}"]


# --- a line nested too deep ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "where", "line", "error"),
    [
        *[(command, 10, DEEP_MEMBER, NESTED_TOO_DEEP) for command in COMMANDS],
        *[(command, None, DEEP_MEMBER, NESTED_TOO_DEEP) for command in READING_THE_WHOLE_LOG],
        *[(command, None, DEEP_ARRAY, "Expected `object`, got `array`") for command in READING_THE_WHOLE_LOG],
    ],
)
def test_a_deeply_nested_event_line_is_an_error_naming_file_and_line(tmp_path, command, where, line, error):
    """In the middle, or last: not a torn last line either."""
    events = with_line(tmp_path, SCENARIO, where, line)
    finished = interlock(*commands(events, DECISIONS, tmp_path)[command])
    assert_stopped_at(finished, command, events, where or 279, error)


@pytest.mark.parametrize("command", ["explain --request-id", "whatif", "timeline"])
@pytest.mark.parametrize("where", [2, None], ids=["in the middle", "last"])
def test_a_deeply_nested_decision_line_is_an_error_naming_file_and_line(tmp_path, command, where):
    decisions = with_line(tmp_path, DECISIONS, where, DEEP_MEMBER)
    finished = interlock(*commands(SCENARIO, decisions, tmp_path)[command])
    assert_stopped_at(finished, command, decisions, where or 433, NESTED_TOO_DEEP)


@pytest.mark.parametrize(
    ("command", "where"),
    [
        *[(command, 10) for command in COMMANDS if command != "timeline"],  # line 10: a gpu_scrape
        *[(command, None) for command in READING_THE_WHOLE_LOG if command != "timeline"],
    ],
)
def test_skip_invalid_skips_a_deeply_nested_line_and_says_where(tmp_path, command, where):
    """The output is the log's without that line."""
    events = with_line(tmp_path / "damaged", SCENARIO, where, DEEP_MEMBER)
    finished = interlock(*commands(events, DECISIONS, tmp_path)[command], "--skip-invalid")
    without = with_line(tmp_path / "without", SCENARIO, where, None)
    intact = interlock(*commands(without, DECISIONS, tmp_path)[command])
    assert "Traceback" not in finished.stderr
    assert (finished.returncode, finished.stdout) == (intact.returncode, intact.stdout)
    prog = command.split()[0]
    skipped = f"interlock {prog}: warning: {events}:{where or 279}: skipping invalid line ({NESTED_TOO_DEEP})"
    assert skipped in finished.stderr.splitlines()


async def test_serve_starts_after_a_deeply_nested_last_line_and_numbers_on_from_the_last_good_one(tmp_path):
    log = tmp_path / "var" / "events.jsonl"
    log.parent.mkdir()
    with_line(log.parent, SCENARIO, None, DEEP_MEMBER).rename(log.with_name("events.000001.jsonl"))
    async with nodes_and_gateway(tmp_path, node_specs(1), event_log=str(log)) as (_, gateway):
        await gateway.discovered()
        assert gateway.control_plane.view.snapshot.seq > 278
    newest = list_segments(log)[-1]
    assert newest.name == "events.000002.jsonl"
    assert decode_event(newest.read_bytes().split(b"\n")[0]).seq == 279


# --- a large log, in bounded memory ----------------------------------------------------------


def gpu_scrapes(run_started: bytes, count: int) -> bytes:
    """A log: `run_started`, then `count` GPU scrapes of eight GPUs (about 1 KB a line; they
    change no transition, so what replay keeps does not grow with them)."""
    gpus = ",".join(
        f'{{"uuid":"GPU-001-{index}","memory_used":22000000000,"memory_total":25757220864,'
        f'"utilization":20,"temperature":57}}'
        for index in range(8)
    )
    at = scenarios.START
    lines = [run_started]
    scrape = '{{"type":"gpu_scrape","node":"10.0.0.1","gpus":[{gpus}],"error":"","at":{at},"seq":{seq}}}\n'
    lines += [scrape.format(gpus=gpus, at=at + seq / 1000, seq=seq).encode() for seq in range(2, count + 2)]
    return b"".join(lines)


MEASURED = """
import resource, subprocess, sys
code = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL)
print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""
"""Runs its arguments and prints their exit code and peak resident memory in bytes. A child's
peak starts at its parent's (fork copies the parent's memory, and exec keeps the peak), so the
command runs under this small process rather than straight under the test's."""


def peak_rss(argv: list[object]) -> tuple[int, int]:
    """The exit code of `interlock *argv` and the peak resident memory of its process, in bytes."""
    command = [sys.executable, "-m", "interlock.cli", *map(str, argv)]
    measured = subprocess.run(
        [sys.executable, "-c", MEASURED, *command], capture_output=True, text=True, timeout=300, cwd=PROJECT_ROOT
    )
    assert "Traceback" not in measured.stderr
    code, peak = measured.stdout.split()
    return int(code), int(peak)


@pytest.mark.parametrize("command", ["replay", "audit"])
def test_a_large_log_is_read_in_memory_that_does_not_grow_with_its_size(tmp_path, command):
    """What the command holds beyond a small log's run is a small share of the file's size
    (reading the file whole held it twice over: its bytes and its lines)."""
    run_started = SCENARIO.read_bytes().split(b"\n")[0] + b"\n"
    small, large = tmp_path / "small.jsonl", tmp_path / "large.jsonl"
    small.write_bytes(gpu_scrapes(run_started, 10))
    large.write_bytes(gpu_scrapes(run_started, 32_000))
    size = large.stat().st_size
    assert size > 30_000_000
    small_code, small_peak = peak_rss([command, small])
    large_code, large_peak = peak_rss([command, large])
    assert (small_code, large_code) == (0, 0)
    assert large_peak - small_peak < size / 8, f"{(large_peak - small_peak) / size:.2f} of the file's size"


# --- a forged checkpoint of many nodes -------------------------------------------------------


def forged_checkpoint(folder: Path, count: int) -> Path:
    """The scenario from seq 13 on, after a checkpoint of seq 12 with `count` more nodes (copies
    of 10.0.0.1, not configured: the state holds them, as a forged log may)."""
    state = replay([SCENARIO], until_seq=12).state
    template = state.nodes["10.0.0.1"]
    forged = [
        msgspec.structs.replace(template, ip=f"10.1.{i >> 8}.{i & 255}", name=f"forged-{i}") for i in range(count)
    ]
    checkpoint = msgspec.structs.replace(Checkpoint.of(state), nodes=(*state.nodes.values(), *forged))
    lines = SCENARIO.read_bytes().splitlines(keepends=True)
    log = folder / "forged.jsonl"
    log.write_bytes(encode_event(checkpoint) + b"".join(lines[12:]))
    return log


def test_whatif_says_how_far_it_has_come(tmp_path):
    """Each request walks every node of its pool: a checkpoint of many nodes takes long, and the
    command says where it is (here at every step: --progress 0, which a pipe gets too; by default
    every 5 s once it has run 5 s, on a terminal only)."""
    log = forged_checkpoint(tmp_path, 2000)
    quiet = interlock("whatif", log, "--decisions", DECISIONS, "--progress", "1000")
    told = interlock("whatif", log, "--decisions", DECISIONS, "--progress", "0")
    assert (told.returncode, told.stdout) == (quiet.returncode, quiet.stdout) == (0, quiet.stdout)
    checkpoint_warning = (
        "interlock whatif: warning: the log starts at the checkpoint of seq 12 (its older segments are gone)"
    )
    assert quiet.stderr.splitlines() == [checkpoint_warning]
    progress = [line for line in told.stderr.splitlines() if line != checkpoint_warning]
    assert progress[0] == "interlock whatif: request 1 of 432, event log read to seq 0 (a state of 0 nodes)"
    assert "interlock whatif: request 1 of 432, event log read to seq 12 (a state of 2004 nodes)" in progress
    assert progress[-1].startswith("interlock whatif: request 432 of 432, event log read to seq ")
    assert all(line.startswith("interlock whatif: request ") for line in progress)

"""The benchmark's results: the targets they are judged against, the printed table, and the
JSON file under bench/results/ (with the machine's details, so figures can be compared later).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

import msgspec

PROJECT_ROOT = Path(__file__).resolve().parent.parent
RESULTS_FOLDER = PROJECT_ROOT / "bench" / "results"
MIB = 1024 * 1024
PACKAGES = ("interlock", "trio", "httpx", "h11", "hypercorn", "quart", "quart-trio", "msgspec", "prometheus-client")
ROWS = ("direct", "floor", "asgi-floor", "nginx", "interlock", "interlock-x2")
ROW_NOTES = {
    "direct": "the bench upstream itself, no proxy",
    "floor": "quart-trio + hypercorn answering with the same canned bytes",
    "asgi-floor": "a plain ASGI app (no Quart) on hypercorn answering the same",
    "nginx": "nginx reverse proxy to the upstream (1 worker, keep-alive, no buffering)",
    "interlock": "interlock serve: 1 node (the upstream), probes every 1 s, metrics, event log",
    "interlock-x2": "interlock serve --workers 2: leader and 2 workers on every core, the load too",
}

# --- targets (issue 5) -------------------------------------------------------------------------

MAX_CPU_PER_REQUEST_VS_FLOOR = 1.5
MAX_CPU_PER_CHUNK_US = 100.0
MIN_PACED_STREAMS = 64
MAX_ADDED_DELAY_MS = 20.0
MIN_REPLAY_EVENTS_PER_SECOND = 200_000
MAX_CONTROL_PLANE_CORE_PERCENT = 25.0
CONTROL_PLANE_NODES = 1000
MAX_RSS_BYTES = 80 * MIB
RSS_NODES = 100
MIN_WORKERS_THROUGHPUT_RATIO = 1.6
MAX_WORKERS_CPU_RATIO = 1.15
MIN_WORKERS_PACED_RATIO = 2.0
MAX_WORKERS_P50_RATIO = 1.1
"""Two workers against one process (issue 10): requests/s, CPU per request, paced streams held,
and added p50 latency ("unchanged": within 10 %)."""
MIN_UPSTREAM_HEADROOM = 5.0
"""The direct row must do at least this many times the gateway's requests/s."""
KEPT_UP_FRACTION = 0.9
"""A control plane that applied fewer than this share of the expected events fell behind."""


def paced_streams_held(levels: list[dict]) -> int:
    """The highest concurrency reached before the p99 added delay first passed the limit (0: the
    lowest level already passed it, or a level had errors)."""
    held = 0
    for level in levels:
        p99 = level["added_delay_p99_ms"]
        if level["errors"] or p99 is None or p99 > MAX_ADDED_DELAY_MS:
            break
        held = level["concurrency"]
    return held


def evaluate_targets(results: dict) -> list[dict]:
    """Each target with what was measured and PASS, MISS, or n/a (not measured)."""
    rows = results["rows"]
    interlock = rows.get("interlock", {})
    floor = rows.get("floor", {})
    targets = []

    def add(name: str, passed: bool | None, measured: str) -> None:
        targets.append({"target": name, "verdict": "n/a" if passed is None else ("PASS" if passed else "MISS"), "measured": measured})

    ours, theirs = _get(interlock, "requests", "cpu_per_request_us"), _get(floor, "requests", "cpu_per_request_us")
    if ours and theirs:
        ratio = ours / theirs
        add(
            f"non-streaming CPU/request <= {MAX_CPU_PER_REQUEST_VS_FLOOR}x floor",
            ratio <= MAX_CPU_PER_REQUEST_VS_FLOOR,
            f"{ours:,.0f} us = {ratio:.2f}x floor ({theirs:,.0f} us)",
        )
    else:
        add(f"non-streaming CPU/request <= {MAX_CPU_PER_REQUEST_VS_FLOOR}x floor", None, "not measured")

    per_chunk = _get(interlock, "sse", "cpu_per_chunk_us")
    add(
        f"CPU per relayed SSE chunk <= {MAX_CPU_PER_CHUNK_US:.0f} us (64-chunk streams)",
        None if per_chunk is None else per_chunk <= MAX_CPU_PER_CHUNK_US,
        "not measured" if per_chunk is None else f"{per_chunk:,.0f} us",
    )

    levels = interlock.get("paced")
    if levels:
        held = paced_streams_held(levels)
        passed_at = next((level["concurrency"] for level in levels if level["concurrency"] > held), None)
        add(
            f">= {MIN_PACED_STREAMS} streams at 50 chunks/s before p99 added delay > {MAX_ADDED_DELAY_MS:.0f} ms",
            held >= MIN_PACED_STREAMS,
            f"held {held}" + (f", passed at {passed_at}" if passed_at else ", never passed"),
        )
    else:
        add(f">= {MIN_PACED_STREAMS} streams at 50 chunks/s before p99 added delay > {MAX_ADDED_DELAY_MS:.0f} ms", None, "not measured")

    replay = results.get("replay")
    add(
        f"replay >= {MIN_REPLAY_EVENTS_PER_SECOND:,} events/s",
        None if not replay else replay["events_per_second"] >= MIN_REPLAY_EVENTS_PER_SECOND,
        "not measured" if not replay else f"{replay['events_per_second']:,.0f} events/s",
    )

    by_nodes = {run["nodes"]: run for run in results.get("control_plane", []) if "core_percent" in run}
    large = by_nodes.get(CONTROL_PLANE_NODES)
    if large:
        kept_up = large["events_per_second"] >= KEPT_UP_FRACTION * large["expected_events_per_second"]
        measured = f"{large['core_percent']:.0f} % of a core"
        if not kept_up:
            measured += f" and fell behind ({large['events_per_second']:,.0f} of {large['expected_events_per_second']:,} events/s)"
        add(
            f"control plane, {CONTROL_PLANE_NODES:,} nodes probed every 1 s: <= {MAX_CONTROL_PLANE_CORE_PERCENT:.0f} % of one core",
            kept_up and large["core_percent"] <= MAX_CONTROL_PLANE_CORE_PERCENT,
            measured,
        )
    else:
        add(f"control plane, {CONTROL_PLANE_NODES:,} nodes probed every 1 s: <= {MAX_CONTROL_PLANE_CORE_PERCENT:.0f} % of one core", None, "not measured")

    small = by_nodes.get(RSS_NODES)
    add(
        f"control plane RSS <= {MAX_RSS_BYTES // MIB} MiB with {RSS_NODES} nodes configured",
        None if not small else small["peak_rss_bytes"] <= MAX_RSS_BYTES,
        "not measured" if not small else f"{small['peak_rss_bytes'] / MIB:.1f} MiB",
    )
    targets.extend(_worker_targets(interlock, rows.get("interlock-x2", {})))
    return targets


def _worker_targets(one: dict, two: dict) -> list[dict]:
    """`interlock-x2` against `interlock` (issue 10)."""

    def target(name: str, ours: float | None, theirs: float | None, passes, unit: str = "x") -> dict:
        if not ours or not theirs:
            return {"target": name, "verdict": "n/a", "measured": "not measured"}
        ratio = ours / theirs
        verdict = "PASS" if passes(ratio) else "MISS"
        return {"target": name, "verdict": verdict, "measured": f"{ours:,.1f} vs {theirs:,.1f}: {ratio:.2f}{unit}"}

    held_one = paced_streams_held(one["paced"]) if one.get("paced") else None
    held_two = paced_streams_held(two["paced"]) if two.get("paced") else None
    return [
        target(
            f"2 workers: small requests/s >= {MIN_WORKERS_THROUGHPUT_RATIO}x one process",
            _get(two, "requests", "requests_per_second"),
            _get(one, "requests", "requests_per_second"),
            lambda ratio: ratio >= MIN_WORKERS_THROUGHPUT_RATIO,
        ),
        target(
            f"2 workers: CPU per request <= {MAX_WORKERS_CPU_RATIO}x one process",
            _get(two, "requests", "cpu_per_request_us"),
            _get(one, "requests", "cpu_per_request_us"),
            lambda ratio: ratio <= MAX_WORKERS_CPU_RATIO,
        ),
        target(
            f"2 workers: paced streams held >= {MIN_WORKERS_PACED_RATIO}x one process",
            held_two,
            held_one,
            lambda ratio: ratio >= MIN_WORKERS_PACED_RATIO,
        ),
        target(
            f"2 workers: p50 latency <= {MAX_WORKERS_P50_RATIO}x one process (at 16 connections)",
            _get(two, "requests", "p50_ms"),
            _get(one, "requests", "p50_ms"),
            lambda ratio: ratio <= MAX_WORKERS_P50_RATIO,
        ),
    ]


def _get(row: dict, section: str, key: str) -> float | None:
    measured = row.get(section)
    return measured.get(key) if measured else None


def _ratio(ours: float, reference: float | None) -> str:
    return f"{ours / reference:.2f}x" if reference else "-"


# --- the table -----------------------------------------------------------------------------------


def render(results: dict) -> str:
    settings, machine = results["settings"], results["machine"]
    lines = [
        f"Interlock benchmark, {results['started_at']}",
        f"{machine['cpu_model']}, {machine['cores_available']} cores available, Linux {machine['kernel']}, "
        f"Python {machine['python']}; interlock at {_code_version(machine)}",
        f"{settings['cores']}; {settings['duration']:g} s per load point after {settings['warm_up']:g} s warm-up; "
        f"load average {machine['load_average_at_start']} at start, {results.get('load_average_at_end', '?')} at end",
    ]
    for note in results["notes"]:
        lines.append(f"note: {note}")
    rows = {name: row for name, row in results["rows"].items()}
    lines += ["", "Rows:"] + [f"  {name:<12} {ROW_NOTES[name]}" for name in rows]
    for name, row in rows.items():
        if row.get("error"):
            lines.append(f"  {name} failed: {row['error']}")

    if any(row.get("requests") for row in rows.values()):
        floor_cpu = _get(rows.get("floor", {}), "requests", "cpu_per_request_us")
        asgi_cpu = _get(rows.get("asgi-floor", {}), "requests", "cpu_per_request_us")
        lines += ["", f"Small POST /v1/chat/completions (wrk, {settings['connections']} connections)"]
        lines.append(
            _columns("row", "req/s", "p50 ms", "p99 ms", "CPU us/req", "vs floor", "vs asgi", "peak RSS MiB", "errors")
        )
        for name, row in rows.items():
            measured = row.get("requests")
            if measured:
                lines.append(
                    _columns(
                        name,
                        f"{measured['requests_per_second']:,.0f}",
                        f"{measured['p50_ms']:.2f}",
                        f"{measured['p99_ms']:.2f}",
                        f"{measured['cpu_per_request_us']:,.0f}",
                        _ratio(measured["cpu_per_request_us"], floor_cpu),
                        _ratio(measured["cpu_per_request_us"], asgi_cpu),
                        _mib(row.get("peak_rss_bytes")),
                        f"{measured['errors']:,}",
                    )
                )
        headroom = results.get("upstream_headroom")
        if headroom is not None:
            verdict = "ok" if headroom >= MIN_UPSTREAM_HEADROOM else f"TOO LOW, must be >= {MIN_UPSTREAM_HEADROOM:g}x"
            lines.append(f"  upstream headroom: direct does {headroom:,.1f}x interlock's requests/s ({verdict})")

    if any(row.get("sse") for row in rows.values()):
        lines += ["", f"SSE, {settings['sse_chunks']} chunks per response, unpaced (wrk, {settings['connections']} connections)"]
        asgi_chunk = _get(rows.get("asgi-floor", {}), "sse", "cpu_per_chunk_us")
        lines.append(_columns("row", "streams/s", "chunks/s", "p50 ms", "p99 ms", "CPU us/chunk", "vs asgi", "errors"))
        for name, row in rows.items():
            measured = row.get("sse")
            if measured:
                lines.append(
                    _columns(
                        name,
                        f"{measured['responses_per_second']:,.0f}",
                        f"{measured['chunks_per_second']:,.0f}",
                        f"{measured['p50_ms']:.2f}",
                        f"{measured['p99_ms']:.2f}",
                        f"{measured['cpu_per_chunk_us']:,.1f}",
                        _ratio(measured["cpu_per_chunk_us"], asgi_chunk),
                        f"{measured['errors']:,}",
                    )
                )

    if any(row.get("paced") for row in rows.values()):
        levels = settings["paced_concurrency"]
        interval = settings["paced_interval"]
        lines += [
            "",
            f"Paced SSE streams, {1 / interval:g} chunks/s each ({settings['paced_chunks']} chunks per stream), by concurrent streams",
            "  p99 added inter-chunk delay, ms (gap minus the pacing; levels above the first that passes "
            f"{MAX_ADDED_DELAY_MS:g} ms are not run)",
        ]
        lines.append(_columns("row", *(str(level) for level in levels), "held", width=8))
        for name, row in rows.items():
            if row.get("paced"):
                by_level = {level["concurrency"]: level for level in row["paced"]}
                cells = [_delay_cell(by_level.get(level)) for level in levels]
                lines.append(_columns(name, *cells, str(paced_streams_held(row["paced"])), width=8))
        lines.append("  CPU us per relayed chunk")
        lines.append(_columns("row", *(str(level) for level in levels), width=8))
        for name, row in rows.items():
            if row.get("paced"):
                by_level = {level["concurrency"]: level for level in row["paced"]}
                cells = [_cpu_cell(by_level.get(level)) for level in levels]
                lines.append(_columns(name, *cells, width=8))

    replay = results.get("replay")
    if replay:
        lines += [
            "",
            f"Replay: {replay['events']:,} events in {replay['median_seconds']:.2f} s (median of {len(replay['seconds'])}): "
            f"{replay['events_per_second']:,.0f} events/s",
        ]
    control_plane = results.get("control_plane")
    if control_plane:
        lines += ["", "Control plane alone, nodes probed every 1 s (health + GPU scrape + model listing), event log on"]
        lines.append(_columns("nodes", "ready", "CPU % core", "events/s", "expected/s", "peak RSS MiB", "nodes proc %"))
        for run in control_plane:
            if "error" in run:
                lines.append(f"  {run['nodes']:>5}  failed: {run['error']}")
                continue
            nodes_percent = run.get("nodes_process_core_percent")
            lines.append(
                _columns(
                    str(run["nodes"]),
                    str(run["ready_nodes"]),
                    f"{run['core_percent']:.1f}",
                    f"{run['events_per_second']:,.0f}",
                    f"{run['expected_events_per_second']:,}",
                    _mib(run["peak_rss_bytes"]),
                    "-" if nodes_percent is None else f"{nodes_percent:.0f}",
                )
            )

    lines += ["", "Targets"]
    for target in results["targets"]:
        lines.append(f"  {target['verdict']:<4}  {target['target']:<78} {target['measured']}")
    return "\n".join(lines)


def _code_version(machine: dict) -> str:
    commit = (machine.get("git_commit") or "?")[:7]
    changed = machine.get("git_changed_files")
    return f"{commit} + {changed} changed files" if changed else commit


def _columns(first: str, *cells: str, width: int = 14) -> str:
    return f"  {first:<12}" + "".join(f"{cell:>{width}}" for cell in cells)


def _mib(size: int | None) -> str:
    return "-" if not size else f"{size / MIB:.1f}"


def _delay_cell(level: dict | None) -> str:
    if level is None:
        return "-"
    if level["errors"]:
        return f"{level['errors']}err"
    p99 = level["added_delay_p99_ms"]
    return "-" if p99 is None else f"{p99:.1f}"


def _cpu_cell(level: dict | None) -> str:
    if level is None or level.get("cpu_per_chunk_us") is None:
        return "-"
    return f"{level['cpu_per_chunk_us']:.0f}"


# --- the machine and the file --------------------------------------------------------------------


def machine_details(wrk: str | None, nginx: str | None) -> dict:
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_available": len(os.sched_getaffinity(0)),
        "memory_bytes": _meminfo_total(),
        "kernel": platform.release(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "packages": {name: _package_version(name) for name in PACKAGES},
        "git_commit": _command_output(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT),
        "git_changed_files": _changed_files(),
        "wrk": _command_output([wrk, "-v"]).splitlines()[0] if wrk else None,
        "nginx": _command_output([nginx, "-v"]) if nginx else None,
        "load_average_at_start": load_average(),
    }


BUSY_LOAD_AVERAGE = 0.5


def busy_note(load_average_text: str) -> str | None:
    """A warning when something else was using the machine as the run started."""
    try:
        one_minute = float(load_average_text.split()[0])
    except (ValueError, IndexError):
        return None
    if one_minute <= BUSY_LOAD_AVERAGE:
        return None
    return f"the machine was busy at the start (load average {one_minute:.2f}): other processes share the cores, figures are noisy"


def load_average() -> str:
    """The 1, 5 and 15 minute load averages: above about 0.5, something else was running."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _meminfo_total() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _changed_files() -> int | None:
    """Files that differ from the commit (modified or untracked): the code measured is not
    exactly `git_commit` when this is not 0."""
    try:
        completed = subprocess.run(
            ["git", "--no-optional-locks", "status", "--porcelain"], capture_output=True, text=True, timeout=10, cwd=PROJECT_ROOT
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return len(completed.stdout.splitlines()) if completed.returncode == 0 else None


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _command_output(argv: list[str], cwd: Path | None = None) -> str:
    """What a version command prints (wrk and nginx print theirs on stderr), or ""."""
    try:
        completed = subprocess.run(argv, capture_output=True, text=True, timeout=10, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (completed.stdout or completed.stderr).strip()


def write_results(results: dict, folder: Path = RESULTS_FOLDER, kind: str = "") -> Path:
    """Write `results` as `<folder>/<UTC timestamp>[-kind].json` (never over an earlier file)."""
    folder.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H-%M-%SZ") + (f"-{kind}" if kind else "")
    path = folder / f"{stamp}.json"
    suffix = 1
    while path.exists():
        suffix += 1
        path = folder / f"{stamp}-{suffix}.json"
    path.write_bytes(msgspec.json.format(msgspec.json.encode(results), indent=2) + b"\n")
    return path


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def command_line() -> str:
    return " ".join(["python -m bench", *sys.argv[1:]])

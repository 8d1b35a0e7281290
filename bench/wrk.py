"""Closed-loop HTTP load with wrk: requests/s and latency percentiles of one POST, repeated.

A small Lua script sets the method, body and headers, and prints wrk's summary as one JSON line
when the run is done, so nothing has to be scraped from wrk's human-readable output.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

_SCRIPT = """\
wrk.method = "POST"
wrk.body = {body}
wrk.headers["Content-Type"] = "application/json"

done = function(summary, latency, requests)
  local errors = summary.errors
  io.write(string.format(
    '\\n{{"requests": %d, "duration_us": %d, "connect_errors": %d, "read_errors": %d, "write_errors": %d, '
    .. '"status_errors": %d, "timeouts": %d, "p50_us": %d, "p99_us": %d}}\\n',
    summary.requests, summary.duration, errors.connect, errors.read, errors.write,
    errors.status, errors.timeout, latency:percentile(50), latency:percentile(99)))
end
"""


@dataclass(frozen=True)
class WrkResult:
    requests: int
    """Responses completed (any status)."""
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int
    """Connect, read and write errors, timeouts, and responses with a status >= 400."""

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.seconds


def wrk_path() -> str | None:
    return shutil.which("wrk")


def run_wrk(
    url: str, body: bytes, *, connections: int, seconds: float, cores: frozenset[int] | None, folder: Path
) -> WrkResult:
    """Run wrk against `url` for `seconds` (one thread per load core, at most 4)."""
    script = folder / "wrk-post.lua"
    script.write_text(_SCRIPT.format(body=_lua_string(body.decode())))
    threads = min(4, len(cores)) if cores else 1
    argv = [
        wrk_path(), "-t", str(threads), "-c", str(max(connections, threads)), "-d", f"{seconds:g}s",
        "--timeout", "10s", "-s", str(script), url,
    ]
    completed = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=seconds + 30,
        preexec_fn=None if cores is None else lambda: os.sched_setaffinity(0, cores),
    )
    summary_line = next((line for line in reversed(completed.stdout.splitlines()) if line.startswith("{")), None)
    if completed.returncode != 0 or summary_line is None:
        raise RuntimeError(f"wrk failed (exit code {completed.returncode}): {completed.stderr.strip() or completed.stdout.strip()}")
    summary = json.loads(summary_line)
    errors = sum(summary[key] for key in ("connect_errors", "read_errors", "write_errors", "status_errors", "timeouts"))
    return WrkResult(
        requests=summary["requests"],
        seconds=summary["duration_us"] / 1e6,
        p50_ms=summary["p50_us"] / 1000,
        p99_ms=summary["p99_us"] / 1000,
        errors=errors,
    )


def _lua_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'

"""The processes of a benchmark run: started pinned to cores, each in its own process group,
measured through /proc, and all stopped at the end (Linux only).

Every process is started with `start_new_session`, so it leads its own process group and
everything it forks (nginx's worker) goes with it: stopping a group is SIGTERM to the group,
then SIGKILL to whatever is still there a few seconds later.
"""

from __future__ import annotations

import http.client
import json
import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
STOP_SECONDS = 15.0


@dataclass(frozen=True)
class CorePlan:
    """Which cores the process under test and the load (generator, upstream behind a proxy) use.

    None: not pinned (a machine with a single core to offer)."""

    server: frozenset[int] | None
    load: frozenset[int] | None

    @property
    def every(self) -> frozenset[int] | None:
        """Every core: for a server that uses more than one (the load shares them)."""
        return None if self.server is None else self.server | self.load

    def describe(self) -> str:
        if self.server is None:
            return "not pinned (a single core available)"
        return f"server on core {_cores_text(self.server)}, load on core {_cores_text(self.load)}"


def _cores_text(cores: frozenset[int]) -> str:
    return ",".join(str(core) for core in sorted(cores))


def plan_cores() -> CorePlan:
    """The first available core for the process under test, the rest for the load."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return CorePlan(server=None, load=None)
    return CorePlan(server=frozenset(cores[:1]), load=frozenset(cores[1:]))


def pin(pid: int, cores: frozenset[int] | None) -> None:
    """Move every thread of process `pid` onto `cores` (threads it starts later inherit it)."""
    if cores is None:
        return
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except ProcessLookupError:
            pass  # a thread that just ended


class NamedProcess(subprocess.Popen):
    """A started process, with the name of its log file (and of it, in error messages)."""

    def __init__(self, name: str, argv: Sequence[str], **options) -> None:
        super().__init__(argv, **options)
        self.name = name


class Processes:
    """Starts processes and guarantees they are all stopped when the block ends."""

    def __init__(self, log_folder: Path) -> None:
        self.log_folder = log_folder
        self._started: list[NamedProcess] = []
        self.groups: list[int] = []
        """Every process group started, stopped or not."""

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for process in reversed(self._started):
            self.stop(process)

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        cores: frozenset[int] | None,
        cwd: Path | None = None,
        stdout: int | None = None,
    ) -> NamedProcess:
        """Start `argv` in its own process group, pinned to `cores`; its output (and, unless
        `stdout` is given, standard output) goes to `<log folder>/<name>.log`."""
        log = open(self.log_folder / f"{name}.log", "ab")
        try:
            process = NamedProcess(
                name,
                argv,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log if stdout is None else stdout,
                stderr=log,
                start_new_session=True,
                preexec_fn=None if cores is None else lambda: os.sched_setaffinity(0, cores),
            )
        finally:
            log.close()
        self._started.append(process)
        self.groups.append(process.pid)
        return process

    def stop(self, process: NamedProcess) -> None:
        """SIGTERM the process's group, SIGKILL it if it lingers, and reap the process."""
        if process not in self._started:
            return
        self._started.remove(process)
        _signal_group(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_SECONDS
        while group_pids(process.pid) and time.monotonic() < deadline:
            process.poll()
            time.sleep(0.05)
        _signal_group(process.pid, signal.SIGKILL)
        try:
            process.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        if process.stdout is not None:
            process.stdout.close()

    def leftovers(self) -> list[int]:
        """Processes still alive in any group started (none, once the block has ended)."""
        return [pid for pgid in self.groups for pid in group_pids(pgid)]

    def log_tail(self, name: str, lines: int = 20) -> str:
        """The last lines a process started as `name` wrote to its log."""
        path = self.log_folder / f"{name}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (zombies left out)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None and int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name: fields[0] is the state, [11] utime, [12] stime."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU time these processes have used so far (all their threads)."""
    ticks = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / CLOCK_TICKS


def peak_rss_bytes(pids: Sequence[int]) -> int:
    """The sum of these processes' peak resident set sizes (VmHWM)."""
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1]) * 1024
    return total


def read_json_line(process: NamedProcess, timeout: float) -> dict | list:
    """The next line of a process started with `stdout=subprocess.PIPE`, decoded as JSON."""
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    line = process.stdout.readline() if ready else b""
    if not line:
        raise RuntimeError(f"{process.name} printed nothing within {timeout:g} s (exit code {process.poll()})")
    return json.loads(line)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def wait_until_healthy(
    host: str, port: int, process: NamedProcess, *, path: str = "/health", timeout: float = 30.0,
    accept=lambda status, body: status == 200,
) -> None:
    """Poll `GET path` until `accept(status, body)`; raise RuntimeError if the process exits or
    the time runs out."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.name} exited with code {process.returncode}")
        connection = http.client.HTTPConnection(host, port, timeout=2)
        try:
            connection.request("GET", path)
            response = connection.getresponse()
            body = response.read()
            if accept(response.status, body):
                return
            last = f"status {response.status}"
        except OSError as error:
            last = str(error)
        finally:
            connection.close()
        time.sleep(0.1)
    raise RuntimeError(f"{process.name} not ready on {host}:{port}{path} after {timeout:g} s ({last})")

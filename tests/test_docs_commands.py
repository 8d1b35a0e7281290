"""Every command docs/explaining.md shows, run as written on the shipped sample run.

The page gives each tool's synopsis: its optional parts in brackets, the recorded logs of one's
own gateway as `var/events.jsonl` and `var/decisions.jsonl…`. Each is run with the brackets left
out and those logs replaced by the sample run's (`fixtures/logs/`), and each bracketed flag is
looked up in the verb's `--help`: a flag the page names that the CLI no longer takes, or a tool
that fails on the sample, fails here.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[1]
PAGE = PROJECT_ROOT / "docs" / "explaining.md"
SAMPLE_EVENTS = "fixtures/logs/scenario.jsonl"
SAMPLE_DECISIONS = "fixtures/logs/scenario-decisions.jsonl"
INTERLOCK = ".venv/bin/interlock "


def page_commands() -> list[str]:
    """The `interlock` commands of the page's shell blocks, continuation lines joined and
    comments dropped."""
    blocks = re.findall(r"```sh\n(.*?)```", PAGE.read_text(), flags=re.DOTALL)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    commands = [line.split("  #", 1)[0].strip() for line in lines]
    return [command for command in commands if command.startswith(INTERLOCK)]


def as_run_on_the_sample(command: str, tmp_path: Path) -> list[str]:
    """`command` without its optional parts, on the sample run's logs, writing into `tmp_path`."""
    command = re.sub(r"\[[^\]]*\]", "", command)
    command = command.replace("var/decisions.jsonl…", SAMPLE_DECISIONS).replace("var/events.jsonl", SAMPLE_EVENTS)
    command = command.replace("new.toml", "config/gateway.toml")
    command = command.replace("-o timeline.html", f"-o {tmp_path / 'timeline.html'}")
    return [sys.executable, "-m", "interlock.cli", *command.removeprefix(INTERLOCK).split()]


def test_the_page_shows_every_offline_tool():
    verbs = {command.removeprefix(INTERLOCK).split()[0] for command in page_commands()}
    assert verbs == {"replay", "explain", "audit", "whatif", "check-config", "verify", "timeline"}


@pytest.mark.parametrize("command", page_commands())
def test_the_pages_command_runs_on_the_sample(command, tmp_path):
    argv = as_run_on_the_sample(command, tmp_path)
    ran = subprocess.run(argv, capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=300, check=False)
    assert ran.returncode == 0, (argv, ran.stdout[-2000:], ran.stderr[-2000:])
    assert "Traceback" not in ran.stderr
    assert ran.stdout or (tmp_path / "timeline.html").stat().st_size > 0


@pytest.mark.parametrize("command", page_commands())
def test_the_pages_optional_flags_are_the_verbs(command):
    verb = command.removeprefix(INTERLOCK).split()[0]
    optional = re.findall(r"--[a-z-]+", " ".join(re.findall(r"\[([^\]]*)\]", command)))
    help_text = subprocess.run(
        [sys.executable, "-m", "interlock.cli", verb, "--help"],
        capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert [flag for flag in optional if flag not in help_text] == []

"""The README's fleet walkthrough, run as written: its shell block, with free ports and a
temporary directory in place of the fixed ones, and waits where a reader would wait (for a
server to listen, for the replicas to be ready, for a decision record to reach the stream).
Its replicas' configs have no decision log (the walkthrough deletes the `_log` keys), and
`explain --request-id` still explains the request from the fleet's export."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

import trio

from harness import PROJECT_ROOT, free_port, required_program
from test_cli_serve import readme_block

WAIT_SECONDS = 60
"""How long each wait of the script lasts at most (generous: the machine is shared)."""


def wait_for_port(port: int) -> str:
    return f"wait_until 'exec 3<>/dev/tcp/127.0.0.1/{port}'\n"


def runnable(block: str, tmp: str, ports: dict[str, int], demo: str) -> str:
    """The README's block with this test's ports, directory and interpreter, and waits."""
    python = f"{sys.executable}"
    interlock = f"{sys.executable} -m interlock.cli"
    block = (
        block.replace("/tmp/", f"{tmp}/")
        .replace("config/demo.toml", demo)
        .replace(".venv/bin/python", python)
        .replace(".venv/bin/interlock", interlock)
        .replace("4222", str(ports["nats"]))
        .replace("800$r", "${API[$r]}")
        .replace("900$r", "${METRICS[$r]}")
        .replace("8001", str(ports["api1"]))
        .replace("8002", str(ports["api2"]))
    )
    lines = block.splitlines(keepends=True)
    script = [
        "set -u\n",
        "trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT\n",
        f"API=(0 {ports['api1']} {ports['api2']}); METRICS=(0 {ports['metrics1']} {ports['metrics2']})\n",
        f"wait_until() {{ local end=$((SECONDS + {WAIT_SECONDS})); while ((SECONDS < end)); do"
        " (eval \"$1\") >/dev/null 2>&1 && return; sleep 0.1; done; echo \"never: $1\" >&2; exit 1; }\n",
    ]
    export_at = next(index for index, line in enumerate(lines) if " fleet export " in line)
    for line in lines[:export_at]:
        script.append(line)
        if line.startswith("nats-server"):
            script.append(wait_for_port(ports["nats"]))
        elif line.startswith("done"):
            for api in ("api1", "api2"):
                script.append(f"wait_until 'curl -sf 127.0.0.1:{ports[api]}/ready'\n")
    # export, replay and explain until the record has reached the stream (sent every 0.1 s)
    tail = "".join(lines[export_at:])
    script.append(f"wait_until {shell_quote(' && '.join(line for line in tail.splitlines() if line))}\n")
    script.append(tail)
    return "".join(script)


def shell_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


async def test_the_readmes_fleet_walkthrough_runs_as_written_and_explains_the_request(tmp_path):
    required_program("nats-server", "apt-get install nats-server")
    required_program("curl", "apt-get install curl")
    block = readme_block("### Fleet: replicas on several hosts", "sh")
    node_port, node_metrics = free_port(), free_port()
    demo = (PROJECT_ROOT / "config" / "demo.toml").read_text()
    demo_path = tmp_path / "demo.toml"
    demo_path.write_text(demo.replace("vllm_port = 18000", f"vllm_port = {node_port}").replace("19100", str(node_metrics)))
    ports = {name: free_port() for name in ("nats", "api1", "api2", "metrics1", "metrics2")}
    script = runnable(block, str(tmp_path), ports, str(demo_path))
    output, errors = tmp_path / "stdout", tmp_path / "stderr"
    with output.open("wb") as stdout, errors.open("wb") as stderr:
        process = await trio.lowlevel.open_process(
            ["bash", "-c", script], stdout=stdout, stderr=stderr, cwd=PROJECT_ROOT, start_new_session=True
        )
    try:
        with trio.fail_after(5 * WAIT_SECONDS):
            await process.wait()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # what the script's own trap left
    text = output.read_text()
    assert process.returncode == 0, (text[-3000:], errors.read_text()[-3000:])
    assert '"ready":true' in text.replace(" ", "")
    assert "chat.completion" in text  # the request through r2 was answered
    assert "wrote 0 decision records" not in text
    assert "via-r2" in text and "r2" in text.split("via-r2", 1)[1]  # explain names the request and its replica

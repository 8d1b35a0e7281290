"""`interlock demo` end to end: a real subprocess, simulated nodes and the gateway, one request."""

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx

from harness import decision_records

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_CONFIG = REPO_ROOT / "config" / "demo.toml"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def demo_config_on_free_ports(tmp_path: Path) -> Path:
    """The bundled demo config, moved to free ports."""
    text = DEMO_CONFIG.read_text()
    text = text.replace('"127.0.0.1:8080"', f'"127.0.0.1:{free_port()}"')
    text = text.replace('"127.0.0.1:9090"', f'"127.0.0.1:{free_port()}"')
    text = text.replace("vllm_port = 18000", f"vllm_port = {free_port()}")
    text = text.replace("metrics_port = 19100", f"metrics_port = {free_port()}")
    path = tmp_path / "demo.toml"
    path.write_text(text)
    return path


def test_demo_answers_first_writes_its_files_in_its_directory_and_stops_cleanly(tmp_path):
    config = demo_config_on_free_ports(tmp_path)
    elsewhere, demo_dir = tmp_path / "elsewhere", tmp_path / "demo"
    elsewhere.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "interlock.cli", "demo", "--config", str(config), "--once", "--dir", str(demo_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=elsewhere,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},  # this checkout's code, wherever it is installed from
        check=False,
    )
    assert (result.returncode, result.stderr) == (0, "")
    out = result.stdout
    assert out.splitlines()[:2] == [
        f"demo files: {demo_dir}/gateway.log, {demo_dir}/events.jsonl, {demo_dir}/decisions.jsonl",
        "  (events.jsonl and decisions.jsonl written as numbered segments: events.000001.jsonl, …)",
    ]
    assert (demo_dir / "events.000001.jsonl").is_file() and (demo_dir / "decisions.000001.jsonl").is_file()
    assert re.search(r"^< Hello from gpu-node-[12]\.", out, re.MULTILINE), out
    assert re.search(r"served by gpu-node-[12], request id \w+", out)
    # The gateway has stopped: nothing to curl, but the recorded run to explain.
    assert "curl" not in out and "Try it yourself" not in out
    assert f"explain {demo_dir}/events.jsonl --model Qwen/Qwen2.5-7B-Instruct" in out
    assert list(elsewhere.iterdir()) == []
    # The gateway's log went to its file: it discovered the models and shut down cleanly.
    messages = [json.loads(line)["msg"] for line in (demo_dir / "gateway.log").read_text().splitlines()]
    assert "models discovered" in messages and messages[-1] == "gateway stopped"
    # The run was recorded, and the recorded log explains the demo's routing.
    explained = subprocess.run(
        [sys.executable, "-m", "interlock.cli", "explain", str(demo_dir / "events.jsonl"),
         "--model", "Qwen/Qwen2.5-7B-Instruct"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )  # fmt: skip
    assert explained.returncode == 0, explained.stderr
    assert "gpu-node-3" in explained.stdout and "not in ring" in explained.stdout
    assert len(decision_records(demo_dir / "decisions.jsonl")) == 1


def test_demo_log_to_stderr_puts_the_gateways_log_on_stderr(tmp_path):
    config = demo_config_on_free_ports(tmp_path)
    demo_dir = tmp_path / "demo"
    command = [sys.executable, "-m", "interlock.cli", "demo", "--config", str(config), "--once", "--dir", str(demo_dir)]
    result = subprocess.run([*command, "--log-to-stderr"], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"demo files: {demo_dir}/events.jsonl, {demo_dir}/decisions.jsonl\n")
    assert '"msg":"models discovered"' in result.stderr and '"msg":"gateway stopped"' in result.stderr
    assert not (demo_dir / "gateway.log").exists()


def test_a_serving_demo_offers_commands_that_work_until_ctrl_c(tmp_path):
    config = demo_config_on_free_ports(tmp_path)
    command = [sys.executable, "-m", "interlock.cli", "demo", "--config", str(config), "--dir", str(tmp_path / "demo")]
    demo = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not (lines and lines[-1].startswith("  tail -f ")):
            line = demo.stdout.readline()
            assert line, "".join(lines) + demo.stderr.read()
            lines.append(line)
        [health] = [line.split()[-1] for line in lines if line.startswith("  curl -s ") and line.endswith("/health\n")]
        assert httpx.get(health, trust_env=False).status_code == 200  # the server it offers is up
        [chat] = [line.strip() for line in lines if line.startswith("  curl -s ") and "/v1/chat/completions" in line]
        assert '"model":"Qwen/Qwen2.5-7B-Instruct"' in chat
        streamed = subprocess.run(shlex.split(chat), capture_output=True, text=True, timeout=30, check=True)
        assert streamed.stdout.startswith("data: {") and streamed.stdout.endswith("data: [DONE]\n\n")
        assert '"model":"Qwen/Qwen2.5-7B-Instruct"' in streamed.stdout
        assert lines[-1] == f"  tail -f {tmp_path}/demo/gateway.log    # the gateway's log\n"
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=30) == 0
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        demo.stdout.close()
        demo.stderr.close()



def test_a_demo_whose_port_is_taken_says_why_on_the_terminal_and_another_port_works(tmp_path):
    config = demo_config_on_free_ports(tmp_path)
    api_port = int(re.search(r'listen = "127\.0\.0\.1:(\d+)"', config.read_text()).group(1))
    command = [sys.executable, "-m", "interlock.cli", "demo", "--config", str(config), "--once", "--dir", str(tmp_path)]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", api_port))
        taken.listen()
        refused = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        served = subprocess.run(
            [*command, "--port", str(free_port()), "--metrics-port", str(free_port())],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    assert refused.returncode == 1
    assert f"demo: the gateway did not start: server error: cannot listen on 127.0.0.1:{api_port}" in refused.stderr
    assert "`interlock demo --port N --metrics-port M`" in refused.stderr
    assert f"demo: the gateway's log: {tmp_path}/gateway.log" in refused.stderr
    assert (served.returncode, served.stderr) == (0, "")
    assert re.search(r"^< Hello from gpu-node-[12]\.", served.stdout, re.MULTILINE), served.stdout


def test_the_readmes_two_commands_are_the_makefiles_demo_and_test():
    """`make demo` and `make test` (the README's quick start), as make would run them: the demo
    with the ports the README says move it, the test run as CI's. Run as a user runs them: not as
    a sub-make of the `make test` that runs this suite (which would add make's directory lines)."""

    def dry_run(*arguments: str) -> str:
        environment = {name: value for name, value in os.environ.items() if name not in {"MAKELEVEL", "MAKEFLAGS", "MFLAGS"}}
        return subprocess.run(
            ["make", "-n", *arguments], cwd=REPO_ROOT, env=environment, capture_output=True, text=True, timeout=60,
            check=True,
        ).stdout  # fmt: skip

    assert dry_run("demo", "PORT=8081", "METRICS_PORT=9091").splitlines()[-1] == (
        ".venv/bin/interlock demo --port 8081 --metrics-port 9091"
    )
    assert dry_run("test").splitlines()[-1] == ".venv/bin/python -m pytest -q"
    readme = (REPO_ROOT / "README.md").read_text()
    assert "make demo PORT=8081 METRICS_PORT=9091" in readme and "\nmake demo " in readme and "\nmake test " in readme


def test_the_wheel_leaves_the_simulated_nodes_out(tmp_path):
    # `fixtures` is the name of a PyPI testing library: the wheel must not install a package of that name.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(tmp_path), str(REPO_ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = tmp_path.glob("interlock-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        top_level = {name.split("/")[0] for name in archive.namelist()}
    assert "fixtures" not in top_level
    assert {"interlock", "journal", "transport"} <= top_level
    # Nor does the editable install of the checkout: from elsewhere, `fixtures` is not importable.
    imported = subprocess.run(
        [sys.executable, "-c", "import fixtures"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert imported.returncode == 1 and "No module named 'fixtures'" in imported.stderr

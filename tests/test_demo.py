"""`interlock demo` end to end: a real subprocess, simulated nodes and the gateway, one request."""

import re
import socket
import subprocess
import sys
from pathlib import Path

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "config" / "demo.toml"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def demo_config_on_free_ports(tmp_path: Path) -> Path:
    """The bundled demo config, moved to free ports and a temporary event log."""
    text = DEMO_CONFIG.read_text()
    text = text.replace('"127.0.0.1:8080"', f'"127.0.0.1:{free_port()}"')
    text = text.replace('"127.0.0.1:9090"', f'"127.0.0.1:{free_port()}"')
    text = text.replace("vllm_port = 18000", f"vllm_port = {free_port()}")
    text = text.replace("metrics_port = 19100", f"metrics_port = {free_port()}")
    text = text.replace('"var/demo/', f'"{tmp_path}/')
    path = tmp_path / "demo.toml"
    path.write_text(text)
    return path


def test_demo_sends_a_request_through_the_gateway_and_stops_cleanly(tmp_path):
    config = demo_config_on_free_ports(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "interlock.cli", "demo", "--config", str(config), "--once"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"^< Hello from gpu-node-[12]\.", result.stdout, re.MULTILINE), result.stdout
    assert re.search(r"served by gpu-node-[12], request id \w+", result.stdout)
    assert "curl -s http://127.0.0.1:" in result.stdout
    # The gateway's JSON log goes to stderr: it discovered the models and shut down cleanly.
    assert '"msg":"models discovered"' in result.stderr
    assert '"msg":"gateway stopped"' in result.stderr
    # The run was recorded, and the recorded log explains the demo's routing.
    explained = subprocess.run(
        [sys.executable, "-m", "interlock.cli", "explain", str(tmp_path / "events.jsonl"),
         "--model", "Qwen/Qwen2.5-7B-Instruct"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert explained.returncode == 0, explained.stderr
    assert "gpu-node-3" in explained.stdout and "not in ring" in explained.stdout

"""Fixtures shared by the integration tests: a fast clock, gateway config files, a captured log."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from trio.testing import MockClock

from controlplane.logs import JsonLog
from fixtures.node import SimulatedNode

FAST_CLOCK_RATE = 10
"""Virtual seconds per real second under `fast_clock`."""


@pytest.fixture
def fast_clock() -> MockClock:
    """Requesting this runs the test under a MockClock that runs FAST_CLOCK_RATE times faster
    than real time (pytest-trio passes any Clock fixture to trio.run): a 1 s health interval
    takes 0.1 s, while real sockets keep working. Every trio deadline and sleep follows it."""
    return MockClock(rate=FAST_CLOCK_RATE)


ConfigWriter = Callable[..., Path]


@pytest.fixture
def gateway_config(tmp_path: Path) -> ConfigWriter:
    """`gateway_config(nodes, models=(), default="", **gateway) -> path` writes (or rewrites)
    `tmp_path/gateway.toml` with one [[nodes]] per simulated node (ip = its host, name, both
    ports) and the given [gateway] keys, written as TOML values (durations as strings: "1s").
    `models` are (name, ring) pairs for [[models.available]]."""

    def write(
        nodes: Sequence[SimulatedNode], *, models: Sequence[tuple[str, str]] = (), default: str = "", **gateway: Any
    ) -> Path:
        lines = ["[gateway]"]
        lines += [f"{key} = {_toml_value(value)}" for key, value in gateway.items()]
        for node in nodes:
            lines += [
                "",
                "[[nodes]]",
                f"ip = {_toml_value(node.host)}",
                f"name = {_toml_value(node.name)}",
                f"vllm_port = {node.vllm_port}",
                f"metrics_port = {node.metrics_port or 0}",
            ]
        lines += ["", "[models]", f"default = {_toml_value(default)}"]
        for name, ring in models:
            lines += ["", "[[models.available]]", f"name = {_toml_value(name)}", f"ring = {_toml_value(ring)}"]
        path = tmp_path / "gateway.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    return write


def _toml_value(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string for anything a test writes
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class CapturedLog(JsonLog):
    """A JsonLog writing to memory; `records()` parses what was written so far."""

    def __init__(self) -> None:
        super().__init__(io.StringIO())

    def lines(self) -> list[str]:
        return self.stream.getvalue().splitlines()

    def records(self) -> list[dict[str, str]]:
        return [json.loads(line) for line in self.lines()]

    def messages(self, node: str | None = None) -> list[str]:
        return [record["msg"] for record in self.records() if node is None or record.get("node") == node]


@pytest.fixture
def json_log() -> CapturedLog:
    """A JsonLog to pass as `log=`, whose lines the test can read back."""
    return CapturedLog()

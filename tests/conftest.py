"""Fixtures shared by the integration tests: a fast clock, gateway config files, a captured log.
The helpers behind them, and those the tests import directly, are in harness.py."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from trio.testing import MockClock

from fixtures.node import SimulatedNode
from harness import CapturedLog, write_config

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
    """`gateway_config(nodes, models=(), **keywords) -> path` writes (or rewrites)
    `tmp_path/gateway.toml` for the simulated nodes: `harness.config_text`, with no models
    configured unless given."""

    def write(nodes: Sequence[SimulatedNode], *, models: Sequence[tuple[str, str]] = (), **keywords: object) -> Path:
        return write_config(tmp_path, nodes, models=models, **keywords)

    return write


@pytest.fixture
def json_log() -> CapturedLog:
    """A JsonLog to pass as `log=`, whose lines the test can read back."""
    return CapturedLog()

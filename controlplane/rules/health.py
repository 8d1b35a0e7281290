"""Health: a node's status from its consecutive probe failures, and the lines that say so (plinth §2).

The rule and its transition log live together here; the reducer only dispatches the events.
"""

from __future__ import annotations

import msgspec

from controlplane.rules.transitions import HEALTH, StepBuilder
from events.config import Config
from events.state import Health, NodeState
from events.types import GpuScraped, HealthProbed, ProbeCrashed

_STATUS_LEVEL = {Health.DEAD: "error", Health.DEGRADED: "warn"}


def compute_status(failures: int, threshold: int) -> Health:
    """plinth's computeStatus: dead at the threshold, degraded from half of it (at least 1)."""
    if failures >= threshold:
        return Health.DEAD
    if failures >= max(1, threshold // 2):
        return Health.DEGRADED
    return Health.HEALTHY


def health_probed(node: NodeState, event: HealthProbed, config: Config, out: StepBuilder) -> NodeState:
    failures = 0 if event.ok else node.consecutive_failures + 1
    status = compute_status(failures, config.gateway.health_fail_threshold)
    if status != node.status:
        detail = {} if event.ok else {"error": _probe_error(event)}
        out.log(
            HEALTH,
            _STATUS_LEVEL.get(status, "info"),
            "node health changed",
            node=node.ip,
            **{"from": node.status, "to": status, "failures": failures},
            **detail,
        )
    return msgspec.structs.replace(node, status=status, consecutive_failures=failures, last_check=event.at)


def _probe_error(event: HealthProbed) -> str:
    return event.error or f"health endpoint returned status {event.status}"


def probe_crashed(node: NodeState, event: ProbeCrashed, config: Config, out: StepBuilder) -> NodeState:
    out.log(HEALTH, "error", "health check panicked", node=node.ip, panic=event.error)
    return node


def gpu_scraped(node: NodeState, event: GpuScraped, config: Config, out: StepBuilder) -> NodeState:
    """The health round's GPU scrape: telemetry only, it never changes the status."""
    if not event.gpus:
        return node  # plinth keeps the previous GPUs when a scrape gives no result
    return msgspec.structs.replace(node, gpus=event.gpus)

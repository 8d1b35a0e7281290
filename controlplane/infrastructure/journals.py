"""The gateway's two journals (the event log, the decision log) opened as its config says."""

from __future__ import annotations

from events.config import GatewayConfig
from journal.writer import SegmentedFile


def open_configured_log(gateway: GatewayConfig, key: str, what: str) -> SegmentedFile:
    """The log at `gateway.<key>` (`event_log`, `decision_log`) with the segment size and
    retention of its `<key>_max_bytes`, `_retain_bytes` and `_retain_age`, its lock claimed
    (`SegmentedFile.claim`: LogInUse when another gateway holds it)."""
    file = SegmentedFile(
        getattr(gateway, key),
        what,
        max_segment_bytes=getattr(gateway, f"{key}_max_bytes"),
        retain_bytes=getattr(gateway, f"{key}_retain_bytes"),
        retain_seconds=getattr(gateway, f"{key}_retain_age"),
    )
    file.claim()
    return file


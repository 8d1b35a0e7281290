"""What admission adds to a request's own work, in one process: the ticket (tenant, priority,
fairness id), the limits taken (a limited tenant: a request per minute), the settlement at the
end and the record's admission field, for a request of a tenant without limits (every request
of a gateway without `[[tenants]]`) and of a limited one.

    python -m bench.admission_path [--requests 20000]

The HTTP path around it is measured by `python -m bench` (its `interlock` row).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import trio
from prometheus_client import CollectorRegistry

from controlplane.infrastructure.config import load_config
from dataplane.admission.limits import Limits
from dataplane.admission.quota import LocalQuota
from dataplane.exchange import Exchange
from dataplane.metrics import RequestMetrics
from dataplane.views import ConfigView, SnapshotView
from events.state import ClusterState

CONFIG = """
[[nodes]]
ip = "10.0.0.1"
[[tenants]]
name = "limited"
api_keys = ["key"]
requests_per_minute = 1000000000
"""
HEADERS = [
    (b"content-type", b"application/json"),
    (b"user-agent", b"bench"),
    (b"x-forwarded-for", b"127.0.0.1"),
    (b"x-request-id", b"bench"),
]


async def _per_request(view: SnapshotView, tenant: str, requests: int) -> float:
    limits = Limits(LocalQuota(), RequestMetrics(CollectorRegistry()))
    exchange = Exchange(
        request_id="bench",
        path="/v1/chat/completions",
        model="m",
        stream=False,
        body=b'{"model":"m","messages":[{"role":"user","content":"hi"}]}',
        headers=HEADERS,
        view=view,
        at=0.0,
        started=0.0,
        tenant=tenant,
    )
    started = time.perf_counter()
    for _ in range(requests):
        ticket = limits.ticket(exchange)
        if not ticket.tenant.limited or isinstance(await limits.take(ticket, exchange), bytes):
            limits.counted(ticket)
        ticket.end(200)
        ticket.record()
    return (time.perf_counter() - started) / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "gateway.toml"
        path.write_text(CONFIG)
        config = load_config(path)
    view = SnapshotView(ClusterState(config=config), ConfigView(config, {}))
    for tenant in ("default", "limited"):
        seconds = trio.run(_per_request, view, tenant, args.requests)
        print(f"{tenant:>8}: {seconds * 1e6:.1f} us of admission per request")


if __name__ == "__main__":
    main()

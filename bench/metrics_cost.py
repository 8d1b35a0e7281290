"""What a request-metric increment and a scrape cost, in one process and in prometheus_client's
multiprocess mode (what `serve --workers N` uses: each worker writes its samples to memory-mapped
files, the leader's /metrics merges them).

    python -m bench.metrics_cost [--models 10] [--workers 2]

Each mode runs in a fresh interpreter (the mode is chosen when prometheus_client is imported).
Increments: a counter child and a histogram, as `dataplane.metrics.RequestMetrics` counts one
request; and what one attempt adds by node (in flight up and down, a counter, a histogram).
Scrape: rendering /metrics after `--models` models x 3 statuses were counted by each of
`--workers` processes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, os, sys, time
from prometheus_client import CollectorRegistry, generate_latest
from dataplane.metrics import RequestMetrics
models, mode = int(sys.argv[1]), sys.argv[2]
registry = CollectorRegistry()
metrics = RequestMetrics(registry)
n = 200_000
start = time.process_time()
for i in range(n):
    metrics.request_done("m0", "/v1/chat/completions", 200, 0.01)
increment = (time.process_time() - start) / n
start = time.process_time()
for i in range(n):
    metrics.node_attempt_started("10.0.0.1")
    metrics.node_attempt_ended("10.0.0.1")
    metrics.node_attempt("10.0.0.1", 200, 0.01)
node_attempt = (time.process_time() - start) / n
for model in range(models):
    for status in (200, 503, 502):
        metrics.request_done(f"m{model}", "/v1/chat/completions", status, 0.01)
if mode == "multiprocess":
    from prometheus_client.multiprocess import MultiProcessCollector
    scrape_registry = CollectorRegistry()
    MultiProcessCollector(scrape_registry)
else:
    scrape_registry = registry
rounds = 200
start = time.process_time()
for _ in range(rounds):
    page = generate_latest(scrape_registry)
scrape = (time.process_time() - start) / rounds
figures = {"increment_us": increment * 1e6, "node_attempt_us": node_attempt * 1e6, "scrape_ms": scrape * 1e3}
print(json.dumps({**figures, "bytes": len(page)}))
"""


def run(mode: str, models: int, workers: int) -> dict:
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as folder:
        if mode == "multiprocess":
            env["PROMETHEUS_MULTIPROC_DIR"] = folder
            for _ in range(workers - 1):  # the other workers, each leaving its files in the folder
                subprocess.run([sys.executable, "-c", _CHILD, str(models), "single"], env=env, check=True,
                               capture_output=True)  # fmt: skip
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, str(models), mode], env=env, check=True, capture_output=True
        ).stdout
    return json.loads(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    for mode in ("single", "multiprocess"):
        figures = run(mode, args.models, args.workers)
        print(
            f"{mode:>12}: one request counted {figures['increment_us']:.2f} us of CPU, "
            f"its attempt by node {figures['node_attempt_us']:.2f} us; "
            f"a scrape {figures['scrape_ms']:.2f} ms ({figures['bytes']:,} bytes)"
        )


if __name__ == "__main__":
    main()

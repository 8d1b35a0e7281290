"""How fast `replay()` applies a recorded event log (events per second, median of 3 runs).

    python -m bench.replay_speed --events 1000000 [--nodes 10] [--out PATH]

Generates a realistic log first: rounds of model listings, health probes and GPU scrapes for
every node, with occasional incidents (failing health, failing or empty listings, a node the
data plane cannot reach) and a SIGHUP reload now and then; written with the real SegmentedFile
(so in 64 MiB segments) to a temporary directory, or to --out (kept). Not part of the test run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import msgspec

from controlplane.effects.replay import replay
from events.config import DEFAULT_EVENT_LOG_MAX_BYTES, Config, ModelEntry, ModelsConfig, NodeConfig
from events.log import encode_event
from events.types import (
    ConfigReloaded,
    Event,
    GpuSample,
    GpuScraped,
    HealthProbed,
    ModelsListed,
    RunStarted,
    RunStopped,
    UpstreamFailed,
    UpstreamRecovered,
)
from journal.segments import list_segments
from journal.writer import SegmentedFile

START = 1767323045.0
ROUND_SECONDS = 3.0
INCIDENT_CHANCE = 0.003
"""Per node and round: the chance an incident starts."""
RELOAD_EVERY_EVENTS = 50_000
STANDALONE_MODEL = "Qwen/Qwen2.5-7B-Instruct"


def cluster_config(node_count: int) -> Config:
    """Half the nodes standalone, the rest in rings of two, each ring with its own model."""
    standalone = (node_count + 1) // 2
    nodes = []
    for index in range(node_count):
        ring = "" if index < standalone else f"ring-{(index - standalone) // 2}"
        nodes.append(NodeConfig(ip=f"10.0.{index // 250}.{index % 250 + 1}", name=f"gpu-node-{index + 1}", ring=ring))
    rings = sorted({node.ring for node in nodes if node.ring})
    models = [ModelEntry(name=STANDALONE_MODEL, pipeline_stages=1)]
    models += [ModelEntry(name=f"Qwen/Qwen2.5-72B-{ring}", pipeline_stages=2, ring=ring) for ring in rings]
    return Config(nodes=tuple(nodes), models=ModelsConfig(default=STANDALONE_MODEL, available=tuple(models)))


class ClusterSimulation:
    """Produces the events a live gateway would record for the cluster, round after round."""

    def __init__(self, config: Config, seed: int = 1):
        self.config = config
        self.nodes = config.nodes
        """The nodes being probed: the last one is drained and restored by alternate reloads."""
        self.random = random.Random(seed)
        self.at = START
        self.incidents: dict[str, tuple[str, int]] = {}
        """IP → (kind, rounds left)."""
        self.unreachable: set[str] = set()
        """Nodes the data plane marked offline and has not reached since."""

    def tick(self, seconds: float) -> float:
        self.at += seconds
        return self.at

    def run_started(self) -> RunStarted:
        return RunStarted(at=self.at, version="bench", config_path="bench.toml", config=self.config)

    def reload(self) -> ConfigReloaded:
        self.nodes = self.config.nodes[:-1] if self.nodes == self.config.nodes else self.config.nodes
        config = Config(nodes=self.nodes, models=self.config.models)
        return ConfigReloaded(at=self.tick(0.01), config_path="bench.toml", config=config)

    def round(self) -> list[Event]:
        """One health round: every node listed, probed and scraped, plus the data plane's observations."""
        events: list[Event] = []
        self.tick(ROUND_SECONDS)
        for node in self.nodes:
            incident = self._incident(node.ip)
            at = self.tick(0.002)
            if incident == "listing":
                events.append(ModelsListed(at=at, node=node.ip, error="models endpoint returned status 500"))
            else:
                served = (f"Qwen/Qwen2.5-72B-{node.ring}",) if node.ring else (STANDALONE_MODEL,)
                events.append(ModelsListed(at=at, node=node.ip, models=() if incident == "empty" else served))
            healthy = incident != "health"
            latency = round(self.random.uniform(0.001, 0.02), 4)
            status = 200 if healthy else 503
            events.append(HealthProbed(at=self.tick(latency), node=node.ip, ok=healthy, status=status, latency=latency))
            events.append(GpuScraped(at=self.tick(0.003), node=node.ip, gpus=self._gpus(node.ip)))
            if incident == "unreachable":
                error = f"connect to {node.ip}:8000: [Errno 111] Connection refused"
                events.append(UpstreamFailed(at=self.tick(0.001), node=node.ip, error=error))
                self.unreachable.add(node.ip)
            elif node.ip in self.unreachable:
                events.append(UpstreamRecovered(at=self.tick(0.001), node=node.ip))
                self.unreachable.discard(node.ip)
        return events

    def _gpus(self, ip: str) -> tuple[GpuSample, ...]:
        return tuple(
            GpuSample(
                uuid=f"GPU-{ip}-{gpu}",
                memory_used=self.random.randrange(10_000_000_000, 24_000_000_000),
                memory_total=25_757_220_864,
                utilization=self.random.randrange(100),
                temperature=self.random.randrange(40, 85),
            )
            for gpu in range(2)
        )

    def _incident(self, ip: str) -> str | None:
        """The incident a node is in this round, if any (starting one now and then)."""
        kind, rounds_left = self.incidents.get(ip, ("", 0))
        if rounds_left == 0 and self.random.random() < INCIDENT_CHANCE:
            kind = self.random.choice(["health", "listing", "empty", "unreachable"])
            rounds_left = self.random.randint(1, 6)
        if rounds_left == 0:
            self.incidents.pop(ip, None)
            return None
        self.incidents[ip] = (kind, rounds_left - 1)
        return kind


def generate_log(log_path: Path, event_count: int, node_count: int) -> None:
    """Write one run of `event_count` numbered events to the log at `log_path`."""
    simulation = ClusterSimulation(cluster_config(node_count))
    writer = SegmentedFile(log_path, "event log", max_segment_bytes=DEFAULT_EVENT_LOG_MAX_BYTES)
    batch: list[bytes] = []
    seq = 0

    def record(event: Event) -> None:
        nonlocal seq
        seq += 1
        batch.append(encode_event(msgspec.structs.replace(event, seq=seq)))
        if len(batch) >= 10_000:
            writer.write(b"".join(batch))
            batch.clear()

    record(simulation.run_started())
    next_reload = RELOAD_EVERY_EVENTS
    while seq < event_count - 1:
        if seq >= next_reload:
            record(simulation.reload())
            next_reload += RELOAD_EVERY_EVENTS
        for event in simulation.round():
            if seq < event_count - 1:
                record(event)
    record(RunStopped(at=simulation.tick(1.0)))
    writer.write(b"".join(batch))
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.replay_speed", description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000, help="events to generate (default 1000000)")
    parser.add_argument("--nodes", type=int, default=10, help="nodes in the cluster (default 10)")
    parser.add_argument("--out", type=Path, help="the log to write (kept); default: a temporary directory")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="interlock-replay-bench-") as folder:
        log_path = args.out or Path(folder) / "events.jsonl"
        if list_segments(log_path):
            parser.error(f"{log_path}: the log already has segments; choose another --out")
        started = time.perf_counter()
        generate_log(log_path, args.events, args.nodes)
        generation_seconds = time.perf_counter() - started
        segments = list_segments(log_path)
        size = sum(segment.stat().st_size for segment in segments)
        print(
            f"generated {args.events:,} events for {args.nodes} nodes in {generation_seconds:.1f} s: "
            f"{len(segments)} segment(s), {size / 1e6:.1f} MB ({size / args.events:.0f} bytes/event) at {log_path}"
        )

        timings = []
        for run in range(3):
            started = time.perf_counter()
            result = replay([log_path])
            timings.append(time.perf_counter() - started)
            print(
                f"  run {run + 1}: {timings[-1]:.2f} s, {result.event_count:,} events, "
                f"{len(result.transitions):,} transitions"
            )
        median = statistics.median(timings)
        print(f"replay: {result.event_count / median:,.0f} events/s (median of 3 runs: {median:.2f} s)")


if __name__ == "__main__":
    main()

"""What the durable logs cost: the writer per batch, and the checkpoint each event-log segment opens with.

    python -m bench.log_files [--batches 2000] [--rounds 7] [--nodes 1000]

- writer: the CPU of one 100-event batch write, as the appender's worker thread does it. `plain`
  is the writer before the log files were hardened (an unbuffered append of the batch, with the
  segment size check); `segmented` is `journal.writer.SegmentedFile.write` (whole lines
  or nothing, the check that the segment is still there, the lock held). The two alternate,
  round by round, on the same disk; medians of the rounds and their ratio are printed.
- checkpoint: a state of `--nodes` nodes, each with its models, GPUs and health known: the
  encoded checkpoint's size, the time to make and encode it (`segment_head`, once per new
  segment) and to decode it back into a state (what a replay of the remaining segments does
  first).

It prints the figures; on a busy machine run it more than once and compare medians.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import msgspec

from controlplane.rules.reducer import INITIAL_STATE, reduce
from controlplane.effects.control_plane import segment_head
from events.config import Config, ModelEntry, ModelsConfig, NodeConfig
from events.log import decode_event, encode_event
from events.state import ClusterState, GpuSample
from events.types import Event, GpuScraped, HealthProbed, ModelsListed, RunStarted
from journal.writer import SegmentedFile

BATCH_EVENTS = 100
T0 = 1_767_323_045.0


def probe_lines(count: int) -> list[bytes]:
    """Encoded events as a busy gateway writes them: health probes and model listings."""
    lines = []
    for seq in range(1, count + 1):
        node = f"10.0.{seq % 250}.{seq % 200 + 1}"
        if seq % 3:
            event: Event = HealthProbed(at=T0 + seq / 100, seq=seq, node=node, ok=True, status=200, latency=0.0012)
        else:
            event = ModelsListed(at=T0 + seq / 100, seq=seq, node=node, models=("Qwen/Qwen2.5-7B-Instruct",))
        lines.append(encode_event(event))
    return lines


class PlainWriter:
    """The writer before: append a batch to an unbuffered file, a new segment when full."""

    def __init__(self, path: Path, max_segment_bytes: int) -> None:
        self._path = path
        self._max = max_segment_bytes
        self._file = open(path, "ab", buffering=0)  # noqa: SIM115 (closed in close())
        self._size = 0

    def write(self, lines: bytes) -> None:
        if self._size and self._size + len(lines) > self._max:
            self._file.close()
            self._file = open(self._path, "wb", buffering=0)  # noqa: SIM115
            self._size = 0
        self._file.write(lines)
        self._size += len(lines)

    def close(self) -> None:
        self._file.close()


def time_batches(write, batches: list[bytes]) -> float:
    """CPU seconds per batch (thread time: what the worker thread spends)."""
    started = time.thread_time()
    for batch in batches:
        write(batch)
    return (time.thread_time() - started) / len(batches)


def measure_writer(batch_count: int, rounds: int) -> dict[str, float]:
    lines = probe_lines(BATCH_EVENTS)
    batch = b"".join(lines)
    batches = [batch] * batch_count
    max_segment = 64 * 1024 * 1024
    plain_runs, segmented_runs = [], []
    with tempfile.TemporaryDirectory(prefix="interlock-bench-logs-") as folder:
        for round_number in range(rounds):
            plain = PlainWriter(Path(folder) / f"plain-{round_number}.jsonl", max_segment)
            plain_runs.append(time_batches(plain.write, batches))
            plain.close()
            segmented = SegmentedFile(
                Path(folder) / f"events-{round_number}.jsonl", "event log", max_segment_bytes=max_segment
            )
            segmented.write(batch)  # the lock and the first segment, as at a run's start
            segmented_runs.append(time_batches(segmented.write, batches))
            segmented.close()
    plain_median, segmented_median = statistics.median(plain_runs), statistics.median(segmented_runs)
    return {
        "batch_bytes": len(batch),
        "plain_us": plain_median * 1e6,
        "segmented_us": segmented_median * 1e6,
        "ratio": segmented_median / plain_median,
    }


def cluster_state(node_count: int) -> ClusterState:
    """A state of `node_count` nodes in 10 rings, each with its models listed, a healthy probe
    and two GPUs scraped."""
    nodes = tuple(
        NodeConfig(ip=f"10.1.{i // 250}.{i % 250 + 1}", name=f"gpu-node-{i:04d}", ring=f"ring-{i % 10}")
        for i in range(node_count)
    )
    models = tuple(ModelEntry(name=f"org/model-{ring}-70B-Instruct", ring=f"ring-{ring}") for ring in range(10))
    config = Config(nodes=nodes, models=ModelsConfig(default=models[0].name, available=models))
    events: list[Event] = [RunStarted(at=T0, version="bench", config_path="gateway.toml", config=config)]
    for index, node in enumerate(nodes):
        at = T0 + 1 + index / 1000
        events.append(ModelsListed(at=at, node=node.ip, models=(models[index % 10].name,)))
        events.append(HealthProbed(at=at, node=node.ip, ok=True, status=200, latency=0.002))
        gpus = tuple(
            GpuSample(
                uuid=f"GPU-{index:04d}-{gpu}",
                memory_used=40 << 30,
                memory_total=80 << 30,
                utilization=87,
                temperature=64,
            )
            for gpu in range(2)
        )
        events.append(GpuScraped(at=at, node=node.ip, gpus=gpus))
    state = INITIAL_STATE
    for seq, event in enumerate(events, start=1):
        state, _ = reduce(state, msgspec.structs.replace(event, seq=seq))
    return state


def measure_checkpoint(node_count: int, rounds: int) -> dict[str, float]:
    state = cluster_state(node_count)
    encode_times, decode_times = [], []
    line = b""
    for _ in range(rounds):
        started = time.perf_counter()
        line = segment_head(state)
        encode_times.append(time.perf_counter() - started)
        started = time.perf_counter()
        decode_event(line).state()
        decode_times.append(time.perf_counter() - started)
    return {
        "nodes": node_count,
        "kib": len(line) / 1024,
        "encode_ms": statistics.median(encode_times) * 1e3,
        "decode_ms": statistics.median(decode_times) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=2000, help="batches per round (default 2000)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds, alternating the writers (default 7)")
    parser.add_argument("--nodes", type=int, default=1000, help="nodes in the checkpointed state (default 1000)")
    args = parser.parse_args()
    writer = measure_writer(args.batches, args.rounds)
    print(
        f"writer, per {BATCH_EVENTS}-event batch ({writer['batch_bytes']} bytes), median of {args.rounds} rounds: "
        f"plain {writer['plain_us']:.1f} µs, segmented {writer['segmented_us']:.1f} µs "
        f"(x{writer['ratio']:.2f})"
    )
    checkpoint = measure_checkpoint(args.nodes, args.rounds)
    print(
        f"checkpoint at {checkpoint['nodes']} nodes: {checkpoint['kib']:.0f} KiB, "
        f"make and encode {checkpoint['encode_ms']:.2f} ms, decode into a state {checkpoint['decode_ms']:.2f} ms"
    )


if __name__ == "__main__":
    main()

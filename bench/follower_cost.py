"""What following the leader costs a worker: CPU per event to decode and apply it (median of runs).

    python -m bench.follower_cost [--nodes 1000] [--rounds 20] [--runs 5]

A worker (`interlock serve --workers N`) receives every numbered event as a JSON line and applies
it with `controlplane.effects.follower.Follower` (the same `reduce` as the leader). The events are the
rounds a live leader records (`bench.replay_speed.ClusterSimulation`: a model listing, a health
probe and a GPU scrape per node, with occasional incidents), numbered and encoded as the leader
sends them; the follower starts from the leader's RunStarted and decodes and applies the rest.
Only that loop is timed (process CPU time). Not part of the test run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import msgspec

from bench.replay_speed import ClusterSimulation, cluster_config
from controlplane.effects.follower import Follower
from events.log import decode_event, encode_event


def leader_lines(node_count: int, rounds: int) -> list[bytes]:
    """The numbered, encoded events of `rounds` probe rounds of a `node_count`-node cluster."""
    simulation = ClusterSimulation(cluster_config(node_count))
    events = [simulation.run_started()]
    for _ in range(rounds):
        events.extend(simulation.round())
    return [encode_event(msgspec.structs.replace(event, seq=seq)) for seq, event in enumerate(events, start=1)]


def follow_once(lines: list[bytes]) -> float:
    """CPU seconds to decode and apply every line after the first (RunStarted, applied untimed)."""
    follower = Follower(lambda event: None)
    follower.apply(decode_event(lines[0]))
    rest = lines[1:]
    started = time.process_time()
    for line in rest:
        follower.apply(decode_event(line))
    return time.process_time() - started


def measure(node_count: int, rounds: int, runs: int) -> dict:
    lines = leader_lines(node_count, rounds)
    seconds = statistics.median(follow_once(lines) for _ in range(runs))
    events = len(lines) - 1
    return {
        "nodes": node_count,
        "events": events,
        "runs": runs,
        "cpu_seconds": seconds,
        "us_per_event": seconds / events * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.follower_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000, help="nodes in the cluster (default 1000)")
    parser.add_argument("--rounds", type=int, default=20, help="probe rounds of events (default 20)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs; the median is reported (default 5)")
    args = parser.parse_args()
    print(json.dumps(measure(args.nodes, args.rounds, args.runs), indent=2))


if __name__ == "__main__":
    main()

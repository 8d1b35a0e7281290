"""How fast `interlock verify` makes recorded decisions again (decisions per minute, one core,
median of 3 runs; the target is 100,000 a minute).

    python -m bench.verify_speed [--decisions 200000] [--nodes 10] [--events-per-decision 0.5] [--runs 3]
                                 [--keep DIR]

Generates a run first: `bench.replay_speed`'s event log (probes, listings, incidents, reloads),
and for it a decision log of `--decisions` records, each routed on the state after a random
event by the data plane's own functions (`routing.Route`, `pick_pool`, the `Balancer`) under
the four policies in turn, two workers, with in-flight counts and prefixes, and recorded as the
data plane's ledger records it, each worker numbering its records. Then times `verify` over both
logs: reading, folding the event log, making every decision again and checking the rest of each
record and the records' numbers; and says the process's peak memory. `--keep DIR` writes the
logs to DIR and keeps them, for `interlock verify` of another checkout to be timed on the same
logs (alternate the trees: `/usr/bin/time -v python -m interlock.cli verify DIR/events.jsonl
--decisions DIR/decisions.jsonl` gives the time and the peak memory). Not part of the test run.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path

import msgspec

from bench.replay_speed import STANDALONE_MODEL, generate_log
from controlplane.rules.balancer import Balancer
from controlplane.effects.replay import replay_steps
from controlplane.rules.routing import Route, pick_pool
from events.config import DEFAULT_LOAD_BOUND, POLICIES
from events.decisions import AttemptOutcome, AttemptRecord, Decision, Exclusion, read_decisions_with_gaps
from interlock.verify import verify

WORKERS = 2
PREFIXES = 64


def generate_decisions(events: Path, path: Path, count: int, event_count: int, seed: int = 1) -> int:
    """Write `count` decision records for the run of `events` (see the module docstring); the
    number written (fewer when the log is too short)."""
    rng = random.Random(seed)
    balancers = [Balancer() for _ in range(WORKERS)]
    numbers = [0] * WORKERS
    per_event = count / event_count
    written = 0
    carry = 0.0
    encode = msgspec.json.Encoder().encode
    with open(path, "wb") as out:
        for event, state, _ in replay_steps([events]):
            carry += per_event
            models = [STANDALONE_MODEL] + [m.name for m in state.config.models.available[1:]] if state.config else []
            while carry >= 1 and written < count and models:
                carry -= 1
                model = models[written % 3 % len(models)]
                worker = written % WORKERS
                balancer = balancers[worker]
                route = Route(state, model)
                passed: list[Exclusion] = []
                pool = pick_pool(
                    route.candidates, event.at, passed_over=lambda ip, reason: passed.append(Exclusion(ip, reason))
                )
                request_id = f"req-{written:08d}"
                prefix = f"{rng.randrange(PREFIXES):016x}"
                policy = POLICIES[written % len(POLICIES)]
                choice, rotation = None, balancer.rotation
                if pool:
                    choice = balancer.select(
                        pool, policy, scored=True, request_id=request_id, prefix=prefix, load_bound=DEFAULT_LOAD_BOUND
                    )
                    in_flight = balancer.in_flight
                    in_flight[choice.node.ip] = in_flight.get(choice.node.ip, 0) + 1
                    if rng.random() < 0.5:  # the in-flight counts of the next picks
                        in_flight[choice.node.ip] -= 1
                attempts = (AttemptRecord(choice.node.ip, AttemptOutcome.COMPLETED, 200),) if choice else ()
                numbers[worker] += 1
                decision = Decision(
                    request_id=request_id, at=event.at, path="/v1/chat/completions", model=model, stream=False,
                    seq=state.seq, ring=route.ring, ring_pool=route.ring_pool, excluded=route.excluded + tuple(passed),
                    attempts=attempts, status=200 if choice else 503, duration=0.5, worker=worker, replica="bench",
                    policy=policy, prefix=prefix, rotation=rotation, candidates=choice.candidates if choice else (),
                    margin=choice.margin if choice else None, remembered=choice.remembered if choice else "",
                    number=numbers[worker],
                )  # fmt: skip
                out.write(encode(decision) + b"\n")
                written += 1
    return written


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.verify_speed", description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=200_000, help="decision records (default 200000)")
    parser.add_argument("--nodes", type=int, default=10, help="nodes in the cluster (default 10)")
    parser.add_argument(
        "--events-per-decision", type=float, default=0.5, help="event log length per decision (default 0.5)"
    )
    parser.add_argument("--runs", type=int, default=3, help="timed runs of verify (default 3)")
    parser.add_argument("--keep", metavar="DIR", help="write the logs to DIR and keep them")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="interlock-verify-bench-") as scratch:
        folder = Path(args.keep or scratch)
        folder.mkdir(parents=True, exist_ok=True)
        events, decisions = folder / "events.jsonl", folder / "decisions.jsonl"
        event_count = max(1000, int(args.decisions * args.events_per_decision))
        generate_log(events, event_count, args.nodes)
        written = generate_decisions(events, decisions, args.decisions, event_count)
        print(f"generated {event_count:,} events for {args.nodes} nodes and {written:,} decision records")
        timings = []
        for run in range(args.runs):
            started = time.perf_counter()
            report = verify([events], read_decisions_with_gaps([decisions]))
            timings.append(time.perf_counter() - started)
            print(
                f"  run {run + 1}: {timings[-1]:.2f} s, {report.verified:,} of {report.decisions:,} verified, "
                f"{report.divergent} differ"
            )
            if not report.passed:
                raise SystemExit(f"verify found differences in the generated run: {report.divergences[:3]}")
        median = statistics.median(timings)
        rate = written / median * 60
        print(f"verify: {rate:,.0f} decisions/minute (median of {args.runs} runs: {median:.2f} s; target 100,000)")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"peak memory of this process (generating and verifying): {peak:,.0f} MiB")


if __name__ == "__main__":
    main()

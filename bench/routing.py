"""Routing policies compared on one workload: time to first token, prefix-cache hits, node load.

    python -m bench.routing [--policies round_robin,least_load,power_of_two,prefix_affinity]
        [--duration 40] [--rate 7] [--prompts 24] [--load-bound F] [--seed 1] [--logs DIR] [--out DIR]

Three simulated nodes (`fixtures.node`, each its own process) with the load model: at most
NODE_LOAD["max_running"] requests in the batch and a queue behind it, tokens slower in a fuller
batch, prefill by prompt size cut short by a prefix-cache hit (an LRU of a few prefixes); the
third node is 3× slower. For each policy in turn, fresh nodes (empty caches) and a fresh
`interlock serve` (load scraped every 0.5 s, event and decision logs on) get the same seeded
workload: chat sessions, each opening with one of `--prompts` system prompts (about 2 KiB each),
arriving at random (Poisson) at `--rate` per second for `--duration` seconds, streamed. Measured
per policy: time to first token at the client (p50, p99), the nodes' prefix-cache hit rate (their
own counters), each node's share of the requests and its mean load (running + waiting, sampled
from its /metrics), and the requests that failed.

Targets (issue 12): least_load's p99 time to first token at most half round robin's;
prefix_affinity's hit rate at least twice round robin's, with the busiest node's mean load at
most 1.3× the nodes' mean; and `interlock whatif` on the round-robin run's logs predicts each
node's share of the least_load run within WHAT_IF_SHARE_TOLERANCE (the what-if scales a moved
request's recorded duration by the two nodes' speeds but simulates no queue, and the two runs'
arrivals meet different queues, so the shares cannot match exactly). prefix_affinity runs with
`[routing] load_bound` = `--load-bound` (PREFIX_LOAD_BOUND unless given): the bound trades
cache hits for balance, and the target lets the busiest node reach 1.3× the mean, more than the
gateway's cautious default leaves it. The logs of each run are kept under `--logs` (default: a new
folder in the system's temporary directory), for `interlock whatif` and `explain`.

Prints a table, writes bench/results/<UTC time>-routing.json. Takes about (duration + 8 s) per policy.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import trio

from bench.processes import Processes
from bench.report import busy_note, load_average, machine_details, utc_now, write_results
from bench.servers import SimulatedNodeProcess, start_gateway, start_simulated_nodes
from controlplane.rules.policies import KV_AWARE, LEAST_LOAD, POLICIES, PREFIX_AFFINITY, ROUND_ROBIN
from controlplane.effects.probes import ProbeError, parse_vllm_load
from events.decisions import read_decisions
from interlock.whatif import what_if

MODEL = "routing-model"
NODE_LOAD = {
    "max_running": 4,
    "batch_slowdown": 0.15,
    "prefill_per_kib": 0.1,
    "prefix_cache_entries": 6,
    "prefill_hit_factor": 0.1,
    "kv_cache_metric": "both",
}
SLOW_NODE = {"slowness": 3.0}
"""The third node's own setting: every time of it 3× longer."""
TTFT, TPOT, TOKENS = 0.02, 0.02, 16
LOAD_SAMPLE_INTERVAL = 0.25

PREFIX_LOAD_BOUND = 1.75
"""prefix_affinity's `load_bound` here unless `--load-bound` is given."""

MAX_LEAST_LOAD_P99_RATIO = 0.5
MIN_PREFIX_HIT_RATIO = 2.0
MAX_BUSIEST_LOAD_RATIO = 1.3
WHAT_IF_SHARE_TOLERANCE = 0.10
"""Each node's predicted share of the requests within this much (10 percentage points) of the run's."""


# --- the workload -----------------------------------------------------------------------------


def system_prompt(number: int) -> str:
    """About 2 KiB of instructions, one text per number."""
    words = random.Random(f"system prompt {number}").choices(
        ["answer", "briefly", "cite", "sources", "politely", "in", "English", "with", "care", "and", "tables"], k=330
    )
    return f"You are assistant {number}. " + " ".join(words)


def workload(seed: int, rate: float, duration: float, prompts: int) -> list[tuple[float, str, dict]]:
    """(seconds from the start, request id, body) for every request: Poisson arrivals, each a
    session with one of the system prompts and a question of its own."""
    draw = random.Random(seed)
    texts = [system_prompt(number) for number in range(prompts)]
    requests = []
    at = draw.expovariate(rate)
    while at < duration:
        number = len(requests)
        messages = [
            {"role": "system", "content": draw.choice(texts)},
            {"role": "user", "content": f"Question {number}: what is {draw.randint(1, 10**6)}?"},
        ]
        body = {"model": MODEL, "messages": messages, "stream": True, "max_tokens": TOKENS}
        requests.append((at, f"bench-{seed}-{number}", body))
        at += draw.expovariate(rate)
    return requests


# --- one run ----------------------------------------------------------------------------------


async def drive(url: str, requests: list[tuple[float, str, dict]], nodes: list[SimulatedNodeProcess]) -> dict:
    """Send `requests` on schedule; sample the nodes' load meanwhile. Per request: the node that
    served it, the time to its first body bytes, its status."""
    outcomes: list[dict] = []
    samples: dict[str, list[float]] = {node.name: [] for node in nodes}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=120, trust_env=False, limits=limits) as http:

        async def send(at: float, request_id: str, body: dict, started: float) -> None:
            await trio.sleep_until(started + at)
            sent = trio.current_time()
            outcome = {"id": request_id, "node": None, "ttft": None, "status": None}
            try:
                async with http.stream("POST", url, json=body, headers={"X-Request-Id": request_id}) as response:
                    outcome["status"] = response.status_code
                    outcome["node"] = response.headers.get("x-interlock-node")
                    async for _ in response.aiter_raw():
                        if outcome["ttft"] is None:
                            outcome["ttft"] = trio.current_time() - sent
            except httpx.HTTPError as error:
                outcome["error"] = type(error).__name__
            outcomes.append(outcome)

        stop = trio.Event()
        async with trio.open_nursery() as sampler:
            sampler.start_soon(sample_load, http, nodes, samples, stop)
            started = trio.current_time()
            async with trio.open_nursery() as senders:
                for at, request_id, body in requests:
                    senders.start_soon(send, at, request_id, body, started)
            stop.set()
        hits = queries = 0.0
        for node in nodes:
            counters = _counters((await http.get(node.url + "/metrics")).text)
            hits += counters.get("vllm:prefix_cache_hits_total", 0.0)
            queries += counters.get("vllm:prefix_cache_queries_total", 0.0)
    return {"outcomes": outcomes, "load_samples": samples, "prefix_hits": hits, "prefix_queries": queries}


async def sample_load(
    http: httpx.AsyncClient, nodes: list[SimulatedNodeProcess], samples: dict[str, list[float]], stop: trio.Event
) -> None:
    """Until `stop`, each node's load (running + waiting, from its /metrics) into its samples."""
    while not stop.is_set():
        for node in nodes:
            try:
                load = parse_vllm_load((await http.get(node.url + "/metrics")).content)
                samples[node.name].append(load.running + load.waiting)
            except (httpx.HTTPError, ProbeError):
                pass
        with trio.move_on_after(LOAD_SAMPLE_INTERVAL):
            await stop.wait()


def _counters(page: str) -> dict[str, float]:
    """Each series of a node's /metrics page summed over its labels."""
    totals: Counter[str] = Counter()
    for line in page.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            totals[series.split("{")[0]] += float(value)
    return dict(totals)


def run_policy(policy: str, requests: list, logs: Path, processes: Processes, load_bound: float) -> dict:
    """Fresh nodes and a fresh gateway under `policy`, the workload through them."""
    folder = logs / policy
    folder.mkdir(parents=True, exist_ok=True)
    nodes = start_simulated_nodes(processes, 3, MODEL, ttft=TTFT, tpot=TPOT, tokens=TOKENS)
    try:
        for index, node in enumerate(nodes):
            behaviour = NODE_LOAD | (SLOW_NODE if index == 2 else {})
            httpx.post(node.url + "/_control", json=behaviour, trust_env=False).raise_for_status()
        settings = {
            "health_interval": "1s",
            "event_log": str(folder / "events.jsonl"),
            "decision_log": str(folder / "decisions.jsonl"),
        }
        routing = {"policy": policy, "load_scrape_interval": "0.5s", "load_bound": load_bound}
        gateway = start_gateway(processes, folder, nodes, MODEL, gateway=settings, routing=routing)
        try:
            measured = trio.run(drive, gateway.url, requests, nodes)
        finally:
            processes.stop(gateway.process)  # SIGTERM: the logs are written out
    finally:
        for node in nodes:
            processes.stop(node.process)
    return summarize(policy, measured, [node.name for node in nodes])


def summarize(policy: str, measured: dict, names: list[str]) -> dict:
    outcomes = measured["outcomes"]
    served = [outcome for outcome in outcomes if outcome["status"] == 200 and outcome["ttft"] is not None]
    ttfts = sorted(outcome["ttft"] for outcome in served)
    shares = Counter(outcome["node"] for outcome in served)
    loads = {name: statistics.fmean(samples) if samples else 0.0 for name, samples in measured["load_samples"].items()}
    mean_load = statistics.fmean(loads.values())
    return {
        "policy": policy,
        "requests": len(outcomes),
        "failed": len(outcomes) - len(served),
        "ttft_p50_ms": round(1000 * percentile(ttfts, 0.50), 1) if ttfts else None,
        "ttft_p99_ms": round(1000 * percentile(ttfts, 0.99), 1) if ttfts else None,
        "prefix_hit_rate": round(measured["prefix_hits"] / measured["prefix_queries"], 3) if measured["prefix_queries"] else None,
        "share": {name: round(shares[name] / len(served), 3) if served else 0.0 for name in names},
        "mean_load": {name: round(load, 2) for name, load in loads.items()},
        "busiest_load_vs_mean": round(max(loads.values()) / mean_load, 2) if mean_load else None,
    }


def percentile(ordered: list[float], fraction: float) -> float:
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


# --- targets and output -----------------------------------------------------------------------


def predict(logs: Path, runs: dict[str, dict]) -> dict | None:
    """`interlock whatif` on the round-robin run's logs under least_load, against the least_load
    run's shares; None unless both ran."""
    if ROUND_ROBIN not in runs or LEAST_LOAD not in runs:
        return None
    folder = logs / ROUND_ROBIN
    report = what_if([folder / "events.jsonl"], read_decisions(folder / "decisions.jsonl"), policy=LEAST_LOAD)
    predicted = {report.nodes[ip]: round(count / report.routed_again, 3) for ip, count in report.after.items()}
    measured = runs[LEAST_LOAD]["share"]
    names = sorted(set(predicted) | set(measured))
    difference = max(abs(predicted.get(name, 0.0) - measured.get(name, 0.0)) for name in names)
    return {"predicted_share": predicted, "measured_share": measured, "max_difference": round(difference, 3)}


def evaluate(runs: dict[str, dict], prediction: dict | None) -> list[dict]:
    """The issue's targets, each PASS, MISS, or n/a (a policy it compares was not run)."""
    base = runs.get(ROUND_ROBIN)
    targets = []

    def add(target: str, passed: bool | None, measured: str = "not measured") -> None:
        verdict = "n/a" if passed is None else "PASS" if passed else "MISS"
        targets.append({"target": target, "verdict": verdict, "measured": measured})

    least = runs.get(LEAST_LOAD)
    name = f"least_load p99 TTFT <= {MAX_LEAST_LOAD_P99_RATIO}x round robin"
    if base and least and base["ttft_p99_ms"] and least["ttft_p99_ms"]:
        ratio = least["ttft_p99_ms"] / base["ttft_p99_ms"]
        add(name, ratio <= MAX_LEAST_LOAD_P99_RATIO, f"{least['ttft_p99_ms']:.0f} vs {base['ttft_p99_ms']:.0f} ms: {ratio:.2f}x")
    else:
        add(name, None)
    affinity = runs.get(PREFIX_AFFINITY)
    name = (
        f"prefix_affinity hit rate >= {MIN_PREFIX_HIT_RATIO}x round robin,"
        f" busiest node <= {MAX_BUSIEST_LOAD_RATIO}x mean load"
    )
    if base and affinity and base["prefix_hit_rate"] and affinity["prefix_hit_rate"] is not None:
        ratio = affinity["prefix_hit_rate"] / base["prefix_hit_rate"]
        busiest = affinity["busiest_load_vs_mean"] or 0.0
        measured = (
            f"hit rate {affinity['prefix_hit_rate']:.2f} vs {base['prefix_hit_rate']:.2f}: {ratio:.2f}x;"
            f" busiest node {busiest:.2f}x the mean load"
        )
        add(name, ratio >= MIN_PREFIX_HIT_RATIO and busiest <= MAX_BUSIEST_LOAD_RATIO, measured)
    else:
        add(name, None)
    name = f"whatif on the round-robin logs predicts least_load's shares within {100 * WHAT_IF_SHARE_TOLERANCE:.0f} points"
    if prediction:
        difference = prediction["max_difference"]
        measured = (
            f"shares within {100 * difference:.1f} points (predicted {_shares(prediction['predicted_share'])};"
            f" run {_shares(prediction['measured_share'])})"
        )
        add(name, difference <= WHAT_IF_SHARE_TOLERANCE, measured)
    else:
        add(name, None)
    return targets


def _shares(shares: dict[str, float]) -> str:
    return " ".join(f"{name} {share:.0%}" for name, share in sorted(shares.items()))


def render(runs: dict[str, dict], targets: list[dict]) -> str:
    lines = render_runs(runs, "prefix_hit_rate")
    lines += [""] + [f"{target['verdict']:5} {target['target']}: {target['measured']}" for target in targets]
    return "\n".join(lines)


def render_runs(runs: dict[str, dict], hits: str) -> list[str]:
    """A line per policy's run: requests, failures, TTFT, the hit rate under key `hits`, shares."""
    lines = [f"{'policy':17}{'requests':>9}{'failed':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'hits':>7}  share (mean load)"]
    for run in runs.values():
        shares = "  ".join(f"{name} {share:.0%} ({run['mean_load'][name]:.1f})" for name, share in run["share"].items())
        lines.append(
            f"{run['policy']:17}{run['requests']:>9}{run['failed']:>8}{_ms(run['ttft_p50_ms']):>10}"
            f"{_ms(run['ttft_p99_ms']):>10}{_rate(run[hits]):>7}  {shares}"
        )
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add(
        "--policies",
        default=",".join(policy for policy in POLICIES if policy != KV_AWARE),
        help="policies to run, in order (default: all but kv_aware, which needs KV events: bench.kv)",
    )
    add("--duration", type=float, default=40.0, help="seconds of arrivals per policy (default: 40)")
    add("--rate", type=float, default=7.0, help="requests per second, on average (default: 7)")
    add("--prompts", type=int, default=24, help="distinct system prompts (default: 24)")
    add("--load-bound", type=float, default=PREFIX_LOAD_BOUND, help="[routing] load_bound (default: %(default)s)")
    add("--seed", type=int, default=1)
    add("--logs", type=Path, help="where each policy's event and decision logs go (default: a new temporary folder)")
    add("--out", type=Path, help="results folder (default: bench/results)")
    args = parser.parse_args(argv)
    policies = args.policies.split(",")
    unknown = [policy for policy in policies if policy not in POLICIES]
    if unknown:
        parser.error(f"--policies: unknown {', '.join(unknown)} (known: {', '.join(POLICIES)})")
    if args.duration <= 0 or args.rate <= 0 or args.prompts < 1:
        parser.error("--duration and --rate must be positive, --prompts at least 1")
    logs = args.logs or Path(tempfile.mkdtemp(prefix="interlock-routing-"))
    requests = workload(args.seed, args.rate, args.duration, args.prompts)
    results: dict = {"command": "python -m bench.routing " + " ".join(sys.argv[1:] if argv is None else argv)}
    results |= {"started_at": utc_now(), "machine": machine_details(None, None), "logs": str(logs)}
    results["settings"] = {
        "node_load": NODE_LOAD,
        "slow_node": {"n3": SLOW_NODE},
        "ttft": TTFT,
        "tpot": TPOT,
        "tokens": TOKENS,
    } | {key: value for key, value in vars(args).items() if key not in ("logs", "out")}
    results["notes"] = [note for note in [busy_note(results["machine"]["load_average_at_start"])] if note]
    runs: dict[str, dict] = {}
    with Processes(logs) as processes:
        for policy in policies:
            runs[policy] = run_policy(policy, requests, logs, processes, args.load_bound)
            print(f"{policy}: done", file=sys.stderr, flush=True)
    results["runs"] = list(runs.values())
    results["whatif"] = predict(logs, runs)
    results["targets"] = evaluate(runs, results["whatif"])
    results |= {"load_average_at_end": load_average(), "finished_at": utc_now()}
    print(render(runs, results["targets"]))
    path = write_results(results, **({"folder": args.out} if args.out else {}), kind="routing")
    print(f"\nresults: {path}\nlogs: {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

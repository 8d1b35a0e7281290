"""Routing by the nodes' real prefix caches (issue 35): hit ratio, TTFT, balance, gateway CPU.

    python -m bench.kv [--policies round_robin,least_load,prefix_affinity,kv_aware]
        [--duration 60] [--rate 1.5] [--systems 4] [--turns 6] [--cpu-requests 100] [--seed 1]
        [--logs DIR] [--out DIR]

Four simulated nodes (`fixtures.node` processes) with vLLM's block prefix cache: the prompts
tokenized with a small model directory (`fixtures.tokenizer_dir`), blocks of BLOCK_SIZE tokens,
CAPACITY_BLOCKS blocks a node (least recently used evicted first; the four caches together
cannot hold the working set), the prefill taking NODE_LOAD["prefill_per_token"] per prompt token
not in the cache, at most NODE_LOAD["max_running"] requests in the batch and a queue behind it.
The nodes publish their KV events over ZeroMQ (vLLM's format); only a kv_aware gateway is told
where. Each policy gets fresh nodes (empty caches), a fresh `interlock serve` (load scraped
every 0.5 s, event and decision logs on) and the same seeded workload: conversations arriving at
random (Poisson) at `--rate` per second for `--duration` seconds, each opening with one of
`--systems` shared system prompts (a few popular, most rare), then `--turns` turns, each a
streamed request whose prompt is the previous one with the node's answer and a new question
appended, a pause between turns. Midway one node restarts its cache (`POST
/_control/kv/restart`: AllBlocksCleared, its sequence numbers from 0).

Measured per policy: the nodes' own cache hit ratio (blocks served from their cache / the
prompts' full blocks, from `GET /_control/kv`), time to first token at the client (p50, p99),
each node's share and mean load (running + waiting from its /metrics), the busiest node's mean
load against the nodes' mean, failed requests. Then the gateway's CPU per request (its
process's CPU time over `--cpu-requests` requests, four at a time, whole answers) with 1k- and
8k-token prompts, under prefix_affinity and kv_aware (tokenizing and matching are kv_aware's
part of it), on nodes without prefill time.

Targets (issue 35 item 6): kv_aware's hit ratio at least 1.25× prefix_affinity's, its TTFT p99
at most 0.8× prefix_affinity's, its busiest node within 1.25× the mean load; the CPU figures are
reported against prefix_affinity's, without a target. A policy the gateway does not know yet is
skipped and said so.

Prints a table, writes bench/results/<UTC time>-kv.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import trio
from tokenizers import Tokenizer

from bench.processes import Processes, cpu_seconds
from bench.report import busy_note, load_average, machine_details, utc_now, write_results
from bench.routing import percentile, render_runs, sample_load
from bench.servers import Server, SimulatedNodeProcess, start_gateway, start_simulated_nodes
from controlplane.rules.policies import POLICIES, PREFIX_AFFINITY
from fixtures.tokenizer_dir import write_tokenizer_dir

MODEL = "kv-model"
KV_AWARE = "kv_aware"
NODES = 4
BLOCK_SIZE = 16
CAPACITY_BLOCKS = 320
NODE_LOAD = {"max_running": 4, "batch_slowdown": 0.1, "prefill_per_token": 0.0004, "kv_cache_metric": "both"}
TTFT, TPOT, TOKENS = 0.01, 0.01, 24
RESTARTED_NODE = "n2"
THINK_SECONDS = 1.0
"""The mean pause between a conversation's turns (exponential)."""
SYSTEM_WORDS = 300
QUESTION_WORDS = 40
CPU_PROMPT_TOKENS = (1000, 8000)
CPU_CONCURRENCY = 4

MIN_HIT_RATIO_VS_AFFINITY = 1.25
MAX_P99_VS_AFFINITY = 0.8
MAX_BUSIEST_VS_MEAN = 1.25

_WORDS = (
    "the gateway routes each request to a node whose prefix cache holds prompt blocks tokens answer question "
    "user assistant system rules briefly precisely summarise document sentences explain hash table tree "
    "choice poem sea wind lighthouse keeper translate weather nice today quick brown fox lazy dog river "
    "bank numbers code main return valid customer support order arrived status check conversation turn"
).split()


# --- the workload -----------------------------------------------------------------------------


def text(draw: random.Random, words: int) -> str:
    return " ".join(draw.choices(_WORDS, k=words)).capitalize() + "."


def workload(seed: int, rate: float, duration: float, systems: int, turns: int) -> list[dict]:
    """The conversations: when each starts, its system prompt, its questions, its pauses."""
    draw = random.Random(seed)
    prompts = [f"You are assistant {number}. " + text(draw, SYSTEM_WORDS) for number in range(systems)]
    popularity = [1 / (rank + 1) for rank in range(systems)]  # Zipf: a few popular, most rare
    conversations = []
    at = draw.expovariate(rate)
    while at < duration:
        conversations.append(
            {
                "id": f"c{len(conversations)}",
                "at": at,
                "system": draw.choices(prompts, popularity)[0],
                "questions": [text(draw, QUESTION_WORDS) for _ in range(turns)],
                "pauses": [draw.expovariate(1 / THINK_SECONDS) for _ in range(turns)],
            }
        )
        at += draw.expovariate(rate)
    return conversations


# --- one run ----------------------------------------------------------------------------------


async def converse(http: httpx.AsyncClient, url: str, conversation: dict, started: float, outcomes: list) -> None:
    """One conversation's turns, each prompt the previous one with the answer and a question."""
    await trio.sleep_until(started + conversation["at"])
    messages = [{"role": "system", "content": conversation["system"]}]
    for turn, (question, pause) in enumerate(zip(conversation["questions"], conversation["pauses"])):
        messages.append({"role": "user", "content": question})
        body = {"model": MODEL, "messages": messages, "stream": True, "max_tokens": TOKENS}
        outcome = {"id": f"{conversation['id']}-{turn}", "node": None, "ttft": None, "status": None}
        answer: list[str] = []
        sent = trio.current_time()
        try:
            async with http.stream("POST", url, json=body, headers={"X-Request-Id": outcome["id"]}) as response:
                outcome["status"] = response.status_code
                outcome["node"] = response.headers.get("x-interlock-node")
                async for line in response.aiter_lines():
                    if outcome["ttft"] is None and line.startswith("data: "):
                        outcome["ttft"] = trio.current_time() - sent
                    if line.startswith("data: {"):
                        for choice in json.loads(line[len("data: ") :]).get("choices", []):
                            answer.append(choice.get("delta", {}).get("content") or "")
        except httpx.HTTPError as error:
            outcome["error"] = type(error).__name__
        outcomes.append(outcome)
        if outcome["status"] != 200:
            return
        messages.append({"role": "assistant", "content": "".join(answer)})
        await trio.sleep(pause)


async def drive(url: str, conversations: list[dict], nodes: list[SimulatedNodeProcess], restart_at: float) -> dict:
    """Run the conversations; restart one node's cache at `restart_at`; sample the nodes' load."""
    outcomes: list[dict] = []
    samples: dict[str, list[float]] = {node.name: [] for node in nodes}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=300, trust_env=False, limits=limits) as http:

        async def restart(started: float) -> None:
            await trio.sleep_until(started + restart_at)
            node = next(node for node in nodes if node.name == RESTARTED_NODE)
            (await http.post(node.url + "/_control/kv/restart")).raise_for_status()

        stop = trio.Event()
        async with trio.open_nursery() as sampler:
            sampler.start_soon(sample_load, http, nodes, samples, stop)
            started = trio.current_time()
            async with trio.open_nursery() as senders:
                senders.start_soon(restart, started)
                for conversation in conversations:
                    senders.start_soon(converse, http, url, conversation, started, outcomes)
            stop.set()
        caches = {node.name: (await http.get(node.url + "/_control/kv")).json() for node in nodes}
    return {"outcomes": outcomes, "load_samples": samples, "caches": caches}


def start_nodes(processes: Processes, tokenizer: Path, load: dict) -> list[SimulatedNodeProcess]:
    """Four nodes with the block cache and KV events, `load` their behaviour."""
    options = ["--tokenizer", str(tokenizer), "--kv-block-size", str(BLOCK_SIZE),
               "--kv-capacity-blocks", str(CAPACITY_BLOCKS), "--kv-events-base-port", "0"]  # fmt: skip
    nodes = start_simulated_nodes(processes, NODES, MODEL, ttft=TTFT, tpot=TPOT, tokens=TOKENS, options=options)
    for node in nodes:
        httpx.post(node.url + "/_control", json=load, trust_env=False).raise_for_status()
    return nodes


def gateway_for(processes: Processes, folder: Path, nodes: list, policy: str, tokenizer: Path):
    """`interlock serve` under `policy`; kv_aware is told where each node's events are and
    the model's tokenizer."""
    settings = {"health_interval": "1s", "event_log": str(folder / "events.jsonl")}
    settings["decision_log"] = str(folder / "decisions.jsonl")
    routing = {"policy": policy, "load_scrape_interval": "0.5s"}
    keys_of_node, model_keys = [], {}
    if policy == KV_AWARE:
        for node in nodes:
            cache = httpx.get(node.url + "/_control/kv", trust_env=False).json()
            keys_of_node.append({"kv_events": cache["kv_events"], "kv_events_replay": cache["kv_events_replay"]})
        model_keys = {"tokenizer": str(tokenizer)}
    return start_gateway(
        processes, folder, nodes, MODEL, gateway=settings, routing=routing, keys_of_node=keys_of_node,
        model_keys=model_keys,
    )  # fmt: skip


@contextmanager
def cluster(processes: Processes, folder: Path, policy: str, load: dict) -> Iterator[tuple[list, Server]]:
    """Fresh nodes with `load` and a fresh gateway under `policy`; both stopped at the end (the
    gateway first, so that its logs are written out)."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = folder.parent / "tokenizer"
    nodes = start_nodes(processes, tokenizer, load)
    try:
        gateway = gateway_for(processes, folder, nodes, policy, tokenizer)
        try:
            yield nodes, gateway
        finally:
            processes.stop(gateway.process)
    finally:
        for node in nodes:
            processes.stop(node.process)


def run_policy(policy: str, conversations: list, duration: float, logs: Path, processes: Processes) -> dict:
    with cluster(processes, logs / policy, policy, NODE_LOAD) as (nodes, gateway):
        measured = trio.run(drive, gateway.url, conversations, nodes, duration / 2)
    return summarize(policy, measured)


def summarize(policy: str, measured: dict) -> dict:
    outcomes = measured["outcomes"]
    served = [outcome for outcome in outcomes if outcome["status"] == 200 and outcome["ttft"] is not None]
    ttfts = sorted(outcome["ttft"] for outcome in served)
    caches = measured["caches"]
    prompt_blocks = sum(cache["prompt_blocks"] for cache in caches.values())
    hit_blocks = sum(cache["hit_blocks"] for cache in caches.values())
    loads = {name: statistics.fmean(samples) if samples else 0.0 for name, samples in measured["load_samples"].items()}
    mean_load = statistics.fmean(loads.values())
    shares = Counter(outcome["node"] for outcome in served)
    return {
        "policy": policy,
        "requests": len(outcomes),
        "failed": len(outcomes) - len(served),
        "ttft_p50_ms": round(1000 * percentile(ttfts, 0.50), 1) if ttfts else None,
        "ttft_p99_ms": round(1000 * percentile(ttfts, 0.99), 1) if ttfts else None,
        "hit_ratio": round(hit_blocks / prompt_blocks, 3) if prompt_blocks else None,
        "prompt_blocks": prompt_blocks,
        "hit_blocks": hit_blocks,
        "share": {name: round(shares[name] / len(served), 3) if served else 0.0 for name in sorted(loads)},
        "mean_load": {name: round(load, 2) for name, load in loads.items()},
        "busiest_load_vs_mean": round(max(loads.values()) / mean_load, 2) if mean_load else None,
    }


# --- the gateway's CPU per request ------------------------------------------------------------


def sized_prompt(tokenizer: Tokenizer, tokens: int, draw: random.Random) -> str:
    """A question of about `tokens` tokens (under the chat template's few)."""
    words: list[str] = []
    while (missing := tokens - len(tokenizer.encode(" ".join(words)).ids)) > 0:
        words += draw.choices(_WORDS, k=max(1, missing // 2))
    return " ".join(words)


async def send_all(url: str, bodies: list[dict]) -> int:
    """Send `bodies`, CPU_CONCURRENCY at a time; the failures."""
    failures = 0
    queue = list(reversed(bodies))
    async with httpx.AsyncClient(timeout=300, trust_env=False) as http:

        async def sender() -> None:
            nonlocal failures
            while queue:
                response = await http.post(url, json=queue.pop())
                failures += response.status_code != 200

        async with trio.open_nursery() as nursery:
            for _ in range(CPU_CONCURRENCY):
                nursery.start_soon(sender)
    return failures


def cpu_per_request(policy: str, requests: int, logs: Path, processes: Processes, seed: int) -> dict:
    """The gateway's CPU per request under `policy` at each of CPU_PROMPT_TOKENS."""
    tokenizer = Tokenizer.from_file(str(logs / "tokenizer" / "tokenizer.json"))
    draw = random.Random(seed)
    row: dict = {"policy": policy}
    with cluster(processes, logs / f"cpu-{policy}", policy, {"prefill_per_token": 0.0}) as (_, gateway):
        for size in CPU_PROMPT_TOKENS:
            system = sized_prompt(tokenizer, size // 2, draw)
            bodies = [
                {"model": MODEL, "max_tokens": 4, "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": sized_prompt(tokenizer, size // 2, draw)},
                ]}
                for _ in range(requests + CPU_CONCURRENCY)
            ]  # fmt: skip
            trio.run(send_all, gateway.url, bodies[:CPU_CONCURRENCY])  # warm up
            before = cpu_seconds(gateway.pids())
            failures = trio.run(send_all, gateway.url, bodies[CPU_CONCURRENCY:])
            spent = cpu_seconds(gateway.pids()) - before
            row[str(size)] = {"cpu_us_per_request": round(spent / requests * 1e6), "failures": failures}
    return row


# --- targets and output -----------------------------------------------------------------------


def evaluate(runs: dict[str, dict], cpu: dict[str, dict]) -> list[dict]:
    """The issue's targets, each PASS, MISS, or n/a (a policy it compares was not run); the CPU
    figures as rows without a verdict."""
    targets = []

    def add(target: str, passed: bool | None, measured: str = "not measured") -> None:
        verdict = "n/a" if passed is None else "PASS" if passed else "MISS"
        targets.append({"target": target, "verdict": verdict, "measured": measured})

    ours, affinity = runs.get(KV_AWARE), runs.get(PREFIX_AFFINITY)
    compared = ours and affinity and not ours["failed"] and not affinity["failed"]
    name = f"kv_aware hit ratio >= {MIN_HIT_RATIO_VS_AFFINITY}x prefix_affinity"
    if compared and affinity["hit_ratio"]:
        ratio = ours["hit_ratio"] / affinity["hit_ratio"]
        add(name, ratio >= MIN_HIT_RATIO_VS_AFFINITY, f"{ours['hit_ratio']:.2f} vs {affinity['hit_ratio']:.2f}: {ratio:.2f}x")
    else:
        add(name, None)
    name = f"kv_aware TTFT p99 <= {MAX_P99_VS_AFFINITY}x prefix_affinity"
    if compared and affinity["ttft_p99_ms"]:
        ratio = ours["ttft_p99_ms"] / affinity["ttft_p99_ms"]
        add(name, ratio <= MAX_P99_VS_AFFINITY, f"{ours['ttft_p99_ms']:.0f} vs {affinity['ttft_p99_ms']:.0f} ms: {ratio:.2f}x")
    else:
        add(name, None)
    name = f"kv_aware busiest node <= {MAX_BUSIEST_VS_MEAN}x mean load"
    if ours and ours["busiest_load_vs_mean"] is not None:
        busiest = ours["busiest_load_vs_mean"]
        add(name, busiest <= MAX_BUSIEST_VS_MEAN, f"{busiest:.2f}x")
    else:
        add(name, None)
    for size in CPU_PROMPT_TOKENS:
        key = str(size)
        base = cpu.get(PREFIX_AFFINITY, {}).get(key)
        mine = cpu.get(KV_AWARE, {}).get(key)
        name = f"gateway CPU per request, {size} prompt tokens, kv_aware vs prefix_affinity"
        if base and mine and base["cpu_us_per_request"]:
            measured = (
                f"{mine['cpu_us_per_request']} vs {base['cpu_us_per_request']} us:"
                f" {mine['cpu_us_per_request'] / base['cpu_us_per_request']:.2f}x"
            )
            targets.append({"target": name, "verdict": "", "measured": measured})
        elif base:
            measured = f"prefix_affinity {base['cpu_us_per_request']} us (kv_aware not run)"
            targets.append({"target": name, "verdict": "", "measured": measured})
    return targets


def render(runs: dict[str, dict], targets: list[dict], skipped: list[str]) -> str:
    lines = render_runs(runs, "hit_ratio")
    lines += [f"skipped {policy}: the gateway does not have it" for policy in skipped]
    lines += [""] + [f"{target['verdict'] or '-':5} {target['target']}: {target['measured']}" for target in targets]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    known = (*POLICIES, KV_AWARE) if KV_AWARE not in POLICIES else POLICIES
    default = ("round_robin", "least_load", PREFIX_AFFINITY, KV_AWARE)
    parser = argparse.ArgumentParser(prog="python -m bench.kv", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--policies", default=",".join(default), help="policies to run, in order (default: %(default)s)")
    add("--duration", type=float, default=60.0, help="seconds of conversation arrivals per policy (default: 60)")
    add("--rate", type=float, default=1.5, help="conversations starting a second, on average (default: 1.5)")
    add("--systems", type=int, default=4, help="distinct system prompts (default: 4)")
    add("--turns", type=int, default=6, help="turns of each conversation (default: 6)")
    add("--cpu-requests", type=int, default=100, help="requests per CPU measurement; 0: none (default: 100)")
    add("--seed", type=int, default=1)
    add("--logs", type=Path, help="where each policy's logs go (default: a new temporary folder)")
    add("--out", type=Path, help="results folder (default: bench/results)")
    args = parser.parse_args(argv)
    policies = args.policies.split(",")
    unknown = [policy for policy in policies if policy not in known]
    if unknown:
        parser.error(f"--policies: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    if args.duration <= 0 or args.rate <= 0 or args.systems < 1 or args.turns < 1 or args.cpu_requests < 0:
        parser.error("--duration and --rate must be positive, --systems and --turns at least 1, --cpu-requests >= 0")
    skipped = [policy for policy in policies if policy not in POLICIES]
    policies = [policy for policy in policies if policy in POLICIES]
    logs = args.logs or Path(tempfile.mkdtemp(prefix="interlock-kv-"))
    write_tokenizer_dir(logs / "tokenizer")
    conversations = workload(args.seed, args.rate, args.duration, args.systems, args.turns)
    results: dict = {"command": "python -m bench.kv " + " ".join(sys.argv[1:] if argv is None else argv)}
    results |= {"started_at": utc_now(), "machine": machine_details(None, None), "logs": str(logs)}
    results["settings"] = {
        "nodes": NODES,
        "block_size": BLOCK_SIZE,
        "capacity_blocks": CAPACITY_BLOCKS,
        "node_load": NODE_LOAD,
        "ttft": TTFT,
        "tpot": TPOT,
        "tokens": TOKENS,
        "restarted_node": RESTARTED_NODE,
        "conversations": len(conversations),
    } | {key: value for key, value in vars(args).items() if key not in ("logs", "out")}
    results["notes"] = [note for note in [busy_note(results["machine"]["load_average_at_start"])] if note]
    results["notes"] += [f"{policy} skipped: the gateway does not have it" for policy in skipped]
    runs: dict[str, dict] = {}
    cpu: dict[str, dict] = {}
    with Processes(logs) as processes:
        for policy in policies:
            runs[policy] = run_policy(policy, conversations, args.duration, logs, processes)
            print(f"{policy}: done", file=sys.stderr, flush=True)
        for policy in (PREFIX_AFFINITY, KV_AWARE):
            if args.cpu_requests and policy in policies:
                cpu[policy] = cpu_per_request(policy, args.cpu_requests, logs, processes, args.seed)
                print(f"{policy}: CPU measured", file=sys.stderr, flush=True)
    results["runs"] = list(runs.values())
    results["cpu"] = list(cpu.values())
    results["targets"] = evaluate(runs, cpu)
    results |= {"load_average_at_end": load_average(), "finished_at": utc_now()}
    print(render(runs, results["targets"], skipped))
    path = write_results(results, **({"folder": args.out} if args.out else {}), kind="kv")
    print(f"\nresults: {path}\nlogs: {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

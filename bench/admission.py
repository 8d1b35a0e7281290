"""Admission under a flood: does one tenant flooding the cluster raise another's time to first token?

    python -m bench.admission [--duration 20] [--idle-duration 8] [--grace 8] [--nodes 2]
        [--token-window 60] [--only TEXT] [--seed 1] [--out DIR]

Simulated nodes (`fixtures.node`, each its own process) with the load model: at most
NODE_LOAD["max_running"] requests in the batch, the others in the node's queue (vLLM's). The
cluster's capacity follows from it (nodes × batch / the time a request takes). Tenant A floods
at A_LOAD × that capacity, tenant B sends B_LOAD × it, both streamed chat completions arriving
at random (Poisson) for `--duration` seconds; whatever has not ended `--grace` seconds later is
cut. Each run has a fresh `interlock serve` (load scraped every LOAD_SCRAPE):

- `idle`: B alone, without admission: B's time to first token on an idle cluster;
- `no admission`: today, every request goes to a node at once;
- `admission, equal priorities` and `admission, B above A`: `[admission]` (the queue; nodes'
  `max_in_flight` = their batch + 1), A and B as two `[[tenants]]` (keys `bench-key-a`,
  `bench-key-b`), of one priority, then B's above A's;
- `admission, B above A, headroom N`, for each N of HEADROOMS: B above A with `[admission]
  priority_headroom = N`, so A, below the top priority, fills at most `max_in_flight` - N places
  of a node and B's requests find a place free at once rather than after the next request ends.
  Its tokens served against the run without admission's is what the headroom costs.
- `admission, equal priorities, node priority scheduling` and `admission, B above A, node
  priority scheduling`: no headroom, the nodes run with vLLM's `--scheduling-policy priority`
  and `scheduling = "priority"` in the gateway's `[[nodes]]`: each request carries its rank to
  the node (its tenant's priority; within one priority, ahead when its tenant holds less than its
  fair share of the requests in flight, as B does), whose scheduler runs B's first and preempts
  one of A's for it when the batch is full; the gateway lets B's requests through to a node full
  of A's (`controlplane.rules.saturation`).

Per run and tenant: TTFT p50/p99 at the client (of the streams that began), completed streams,
the gateway's refusals (429 `rate_limit_exceeded`, 503 `queue_timeout`), other failures (a node
error: a 502, another 503, a stream cut short or failed), streams cut at the end, tokens served
(content chunks the clients received), in all and while the flood lasted. Targets (issue 22):
with admission, B's TTFT p99 at most 2× its idle p99 (today's ratio beside it); A gets only
429/503 from the gateway, never a node error; tokens served while the flood lasted at least 95%
of the run without admission's. The flood's span is what compares the two: after it, the run
without admission still serves the backlog its nodes' queues hold (streams that waited longer
than the flood), which a bounded queue with deadlines refused at the time, by design.

Then `token limit, two workers`: `serve --workers 2`, tenant A with `tokens_per_minute` =
TOKEN_LIMIT, sending non-streamed requests at TOKEN_RATE × what the limit lets through. Once
the bucket (full at the start) is spent, at A's first 429, a window of `--token-window` seconds
begins: the tokens the nodes reported (`usage`) for the requests sent in it, against the limit
over that window. Target: within ±10% (`--token-window 0` skips the run).

Prints a table, writes bench/results/<UTC time>-admission.json. Takes about idle + runs ×
(duration + grace + 3 s), plus the token run's drain and window.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import msgspec
import trio

from bench.processes import Processes
from bench.report import busy_note, load_average, machine_details, utc_now, write_results
from bench.servers import SimulatedNodeProcess, start_gateway, start_simulated_nodes
from controlplane.effects.probes import ProbeError, parse_vllm_load

MODEL = "admission-model"
TTFT, TPOT, TOKENS = 0.05, 0.04, 24
NODE_LOAD = {"max_running": 4}
A_LOAD, B_LOAD = 3.0, 0.2
"""Each tenant's arrival rate, as a multiple of the cluster's capacity."""
LOAD_SCRAPE = "100ms"
ADMISSION = {"max_queue_seconds": 5, "queue_size": 256, "tenant_queue_size": 64}
KEYS = {"A": "bench-key-a", "B": "bench-key-b"}
HEADROOMS = (1, 2)
"""`priority_headroom` of the headroom runs. With `max_in_flight` = batch + 1: 1 lets A fill a
node's batch, and B's request waits in the node's queue only until a slot frees (A's requests
between the end of one and the next's start leave gaps); 2 keeps the batch one short of full
for B, whose load (B_LOAD of the batches on average) fits in that place."""

MAX_B_TTFT_RATIO = 2.0
MIN_TOKENS_SHARE = 0.95
TOKEN_LIMIT = 9000
"""Tenant A's tokens_per_minute in the token run: about half the cluster's capacity."""
TOKEN_RATE = 5.0
"""The token run's arrivals, as a multiple of the requests the limit lets through."""
TOKEN_TOLERANCE = 0.10

def capacity(nodes: int) -> float:
    """Requests per second the cluster completes with every batch full (no batch slowdown)."""
    seconds = TTFT + (TOKENS - 1) * TPOT
    return nodes * NODE_LOAD["max_running"] / seconds


def arrivals(seed: int, rates: dict[str, float], duration: float) -> list[tuple[float, str]]:
    """(seconds from the start, tenant) of every request: Poisson arrivals per tenant."""
    draw = random.Random(seed)
    requests = []
    for tenant, rate in rates.items():
        at = draw.expovariate(rate)
        while at < duration:
            requests.append((at, tenant))
            at += draw.expovariate(rate)
    return sorted(requests)


# --- one run ----------------------------------------------------------------------------------


async def drive(url: str, requests: list[tuple[float, str]], window: float, cut_after: float) -> list[dict]:
    """Send `requests` on schedule (each tenant with its key), streamed; cut whatever has not
    ended `cut_after` seconds after the start. One outcome per request, its tokens counted in
    all and within the first `window` seconds."""
    outcomes: list[dict] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": TOKENS}
    async with httpx.AsyncClient(timeout=60, trust_env=False, limits=limits) as http:

        async def send(at: float, tenant: str, started: float) -> None:
            await trio.sleep_until(started + at)
            sent = trio.current_time()
            outcome = {"tenant": tenant, "at": at, "status": None, "code": "", "ttft": None, "kind": "cut"}
            outcome |= {"tokens": 0, "window_tokens": 0}
            outcomes.append(outcome)
            received = b""
            headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
            try:
                async with http.stream("POST", url, json=body, headers=headers) as response:
                    outcome["status"] = response.status_code
                    async for chunk in response.aiter_raw():
                        if outcome["ttft"] is None:
                            outcome["ttft"] = trio.current_time() - sent
                        received += chunk
                        outcome["tokens"] = received.count(b'"content":')
                        if trio.current_time() < started + window:
                            outcome["window_tokens"] = outcome["tokens"]
                outcome["kind"] = classify(response.status_code, received)
                if response.status_code != 200:
                    outcome["code"] = _error_code(received)
            except httpx.HTTPError as error:
                outcome["kind"], outcome["code"] = "node_error", type(error).__name__

        started = trio.current_time()
        with trio.move_on_at(started + cut_after):
            async with trio.open_nursery() as senders:
                for at, tenant in requests:
                    senders.start_soon(send, at, tenant, started)
    return outcomes


def classify(status: int, body: bytes) -> str:
    """`completed`, the gateway's refusals (`refused_429`, `refused_503`), or `node_error`."""
    if status == 200:
        return "completed" if b"data: [DONE]" in body and b'"error"' not in body else "node_error"
    code = _error_code(body)
    if status == 429 and code == "rate_limit_exceeded":
        return "refused_429"
    if status == 503 and code == "queue_timeout":
        return "refused_503"
    return "node_error"


def _error_code(body: bytes) -> str:
    try:
        return str(msgspec.json.decode(body)["error"]["code"])
    except (msgspec.DecodeError, KeyError, TypeError):
        return ""


def wait_until_idle(nodes: list[SimulatedNodeProcess], timeout: float = 30.0) -> None:
    """Until no node runs or queues a request (a run's leftovers), so that runs start alike."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        try:
            loads = [parse_vllm_load(httpx.get(node.url + "/metrics", trust_env=False).content) for node in nodes]
        except (httpx.HTTPError, ProbeError):
            loads = []
        if loads and all(load.running + load.waiting == 0 for load in loads):
            return
        time.sleep(0.2)
    raise RuntimeError("the nodes were still busy with the previous run's requests")


def tenants_table(priorities: dict[str, int]) -> str:
    return "".join(
        f'[[tenants]]\nname = "{tenant}"\napi_keys = ["{KEYS[tenant]}"]\npriority = {priority}\n'
        for tenant, priority in priorities.items()
    )


def run(
    name: str,
    requests: list[tuple[float, str]],
    window: float,
    cut_after: float,
    nodes: list[SimulatedNodeProcess],
    processes: Processes,
    folder: Path,
    *,
    priorities: dict[str, int] | None = None,
    headroom: int = 0,
    scheduling: str = "fcfs",
) -> dict:
    """A fresh gateway over the nodes, `requests` through it: with `priorities`, A and B are
    tenants of those priorities and the queue is on (with `headroom` as its `priority_headroom`);
    without, every request goes to a node at once."""
    wait_until_idle(nodes)
    tables = ""
    node_keys = None
    if priorities is not None:
        table = ADMISSION | ({"priority_headroom": headroom} if headroom else {})
        tables = "[admission]\n" + "".join(f"{key} = {value}\n" for key, value in table.items())
        tables += tenants_table(priorities)
        node_keys = {"max_in_flight": NODE_LOAD["max_running"] + 1, "scheduling": scheduling}
    gateway = start_gateway(
        processes,
        folder,
        nodes,
        MODEL,
        gateway={"health_interval": "1s"},
        routing={"load_scrape_interval": LOAD_SCRAPE},
        name=name.replace(" ", "-").replace(",", ""),
        node_keys=node_keys,
        tables=tables,
    )
    try:
        outcomes = trio.run(drive, gateway.url, requests, window, cut_after)
    finally:
        processes.stop(gateway.process)
    return {"run": name, "tenants": {tenant: summarize(outcomes, tenant) for tenant in ("A", "B")}}


async def drive_tokens(url: str, rate: float, window: float, give_up: float) -> tuple[list[dict], float | None]:
    """Poisson arrivals of tenant A's non-streamed requests at `rate` a second until `window`
    seconds after the first 429 (or `give_up` seconds in all): each request's send time, status
    and the tokens its `usage` reported; and the first 429's send time."""
    sent: list[dict] = []
    first_refusal: list[float] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": TOKENS}
    headers = {"Authorization": f"Bearer {KEYS['A']}"}
    draw = random.Random(1)
    async with httpx.AsyncClient(timeout=60, trust_env=False, limits=limits) as http:

        async def send(at: float) -> None:
            outcome = {"at": at, "status": None, "tokens": 0}
            sent.append(outcome)
            try:
                response = await http.post(url, json=body, headers=headers)
            except httpx.HTTPError:
                return
            outcome["status"] = response.status_code
            if response.status_code == 429 and not first_refusal:
                first_refusal.append(at)
            elif response.status_code == 200:
                outcome["tokens"] = response.json()["usage"]["total_tokens"]

        started = trio.current_time()
        async with trio.open_nursery() as senders:
            while (now := trio.current_time() - started) < give_up:
                if first_refusal and now >= first_refusal[0] + window:
                    break
                senders.start_soon(send, now)
                await trio.sleep(draw.expovariate(rate))
    return sent, first_refusal[0] if first_refusal else None


def token_run(
    window: float, nodes: list[SimulatedNodeProcess], processes: Processes, folder: Path
) -> dict:
    """`serve --workers 2` with tenant A limited to TOKEN_LIMIT tokens a minute: the tokens
    admitted over `window` seconds once its bucket is spent, against the limit."""
    wait_until_idle(nodes)
    tables = tenants_table({"A": 0}) + f"tokens_per_minute = {TOKEN_LIMIT}\n"
    gateway = start_gateway(
        processes,
        folder,
        nodes,
        MODEL,
        gateway={"health_interval": "1s"},
        name="token-limit",
        tables=tables,
        workers=2,
    )
    per_request = TOKENS + 10  # the completion and a short prompt, about
    rate = TOKEN_RATE * TOKEN_LIMIT / 60 / per_request
    drain = TOKEN_LIMIT / (rate * per_request - TOKEN_LIMIT / 60)
    try:
        sent, opened = trio.run(drive_tokens, gateway.url, rate, window, 3 * drain + window + 10)
    finally:
        processes.stop(gateway.process)
    expected = TOKEN_LIMIT * window / 60
    inside = [outcome for outcome in sent if opened is not None and opened <= outcome["at"] < opened + window]
    tokens = sum(outcome["tokens"] for outcome in inside)
    return {
        "run": "token limit, two workers",
        "tokens_per_minute": TOKEN_LIMIT,
        "rate_per_second": round(rate, 2),
        "window_seconds": window,
        "window_opened_at_seconds": None if opened is None else round(opened, 2),
        "sent_in_window": len(inside),
        "admitted_in_window": sum(outcome["status"] == 200 for outcome in inside),
        "refused_in_window": sum(outcome["status"] == 429 for outcome in inside),
        "tokens_in_window": tokens,
        "expected_tokens": round(expected),
        "ratio": round(tokens / expected, 3) if opened is not None else None,
    }


def summarize(outcomes: list[dict], tenant: str) -> dict:
    mine = [outcome for outcome in outcomes if outcome["tenant"] == tenant]
    ttfts = sorted(outcome["ttft"] for outcome in mine if outcome["status"] == 200 and outcome["ttft"] is not None)
    kinds = {kind: sum(outcome["kind"] == kind for outcome in mine) for kind in KINDS}
    errors: dict[str, int] = {}
    for outcome in mine:
        if outcome["kind"] == "node_error":
            label = f"{outcome['status']} {outcome['code']}".strip()
            errors[label] = errors.get(label, 0) + 1
    return {
        "requests": len(mine),
        "ttft_p50_ms": _ms(ttfts, 0.50),
        "ttft_p99_ms": _ms(ttfts, 0.99),
        **kinds,
        "node_errors_by_kind": errors,
        "tokens": sum(outcome["tokens"] for outcome in mine),
        "window_tokens": sum(outcome["window_tokens"] for outcome in mine),
    }


KINDS = ("completed", "refused_429", "refused_503", "node_error", "cut")


def _ms(ordered: list[float], fraction: float) -> float | None:
    if not ordered:
        return None
    return round(1000 * ordered[min(len(ordered) - 1, int(fraction * len(ordered)))], 1)


# --- targets and output -----------------------------------------------------------------------


def start_nodes(processes: Processes, count: int, scheduling: str) -> list[SimulatedNodeProcess]:
    """The run's simulated nodes with the load model, of vLLM's `scheduling` policy."""
    nodes = start_simulated_nodes(
        processes, count, MODEL, ttft=TTFT, tpot=TPOT, tokens=TOKENS, scheduling_policy=scheduling
    )
    for node in nodes:
        httpx.post(node.url + "/_control", json=NODE_LOAD, trust_env=False).raise_for_status()
    return nodes


def evaluate(runs: dict[str, dict]) -> list[dict]:
    """The issue's targets for each admission run, PASS or MISS."""
    idle = runs["idle"]["tenants"]["B"]["ttft_p99_ms"]
    today = runs["no admission"]
    today_ratio = _ratio(today["tenants"]["B"]["ttft_p99_ms"], idle)
    today_tokens = today["tenants"]["A"]["window_tokens"] + today["tenants"]["B"]["window_tokens"]
    targets = []
    for name, result in runs.items():
        if not name.startswith("admission"):
            continue
        tenants = result["tenants"]
        ratio = _ratio(tenants["B"]["ttft_p99_ms"], idle)
        verdict = _verdict(ratio is not None and ratio <= MAX_B_TTFT_RATIO)
        targets.append(
            {
                "run": name,
                "target": f"B's TTFT p99 <= {MAX_B_TTFT_RATIO:g}x idle",
                "verdict": verdict,
                "measured": f"{_x(ratio)} (today {_x(today_ratio)}; idle p99 {idle} ms)",
            }
        )
        errors = tenants["A"]["node_error"]
        targets.append(
            {
                "run": name,
                "target": "A gets only 429/503 from the gateway, never a node error",
                "verdict": _verdict(errors == 0),
                "measured": f"{errors} node errors {tenants['A']['node_errors_by_kind'] or ''}".strip(),
            }
        )
        tokens = tenants["A"]["window_tokens"] + tenants["B"]["window_tokens"]
        share = tokens / today_tokens if today_tokens else None
        targets.append(
            {
                "run": name,
                "target": f"tokens served during the flood >= {MIN_TOKENS_SHARE:.0%} of the run without admission",
                "verdict": _verdict(share is not None and share >= MIN_TOKENS_SHARE),
                "measured": f"{tokens} vs {today_tokens}: {share:.0%}" if share is not None else "no tokens today",
            }
        )
    return targets


def _ratio(value: float | None, reference: float | None) -> float | None:
    return round(value / reference, 2) if value is not None and reference else None


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _verdict(passed: bool) -> str:
    return "PASS" if passed else "MISS"


def render(runs: dict[str, dict], targets: list[dict]) -> str:
    heading = f"{'run':36}{'tenant':>7}{'sent':>6}{'p50':>9}{'p99':>9}{'done':>6}{'429':>5}{'503':>5}{'node err':>9}"
    lines = [heading + f"{'cut':>5}{'tokens':>8}{'in flood':>9}"]
    for result in runs.values():
        for tenant, row in result["tenants"].items():
            if not row["requests"]:
                continue
            lines.append(
                f"{result['run']:36}{tenant:>7}{row['requests']:>6}{_ms_cell(row['ttft_p50_ms']):>9}"
                f"{_ms_cell(row['ttft_p99_ms']):>9}{row['completed']:>6}{row['refused_429']:>5}{row['refused_503']:>5}"
                f"{row['node_error']:>9}{row['cut']:>5}{row['tokens']:>8}{row['window_tokens']:>9}"
            )
    lines.append("")
    lines += [f"{target['verdict']:5} {target['run']}: {target['target']}: {target['measured']}" for target in targets]
    return "\n".join(lines)


def _ms_cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.admission", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--duration", type=float, default=20.0, help="seconds of arrivals per flooded run (default: 20)")
    add("--idle-duration", type=float, default=8.0, help="seconds of B alone (default: 8)")
    add("--grace", type=float, default=8.0, help="seconds after the arrivals before the rest is cut (default: 8)")
    add("--nodes", type=int, default=2, help="simulated nodes (default: 2)")
    add("--token-window", type=float, default=60.0, help="seconds of the token run's window (default: 60; 0: no run)")
    add(
        "--only",
        metavar="TEXT",
        help="of the admission runs, only those whose name contains TEXT (idle and no admission always run)",
    )
    add("--seed", type=int, default=1)
    add("--out", type=Path, help="results folder (default: bench/results)")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.idle_duration <= 0 or args.grace < 0 or args.nodes < 1:
        parser.error("--duration and --idle-duration must be positive, --grace not negative, --nodes at least 1")
    cluster = capacity(args.nodes)
    rates = {"A": A_LOAD * cluster, "B": B_LOAD * cluster}
    flood = arrivals(args.seed, rates, args.duration)
    alone = arrivals(args.seed, {"B": rates["B"]}, args.idle_duration)
    logs = Path(tempfile.mkdtemp(prefix="interlock-admission-"))
    results: dict = {"command": "python -m bench.admission " + " ".join(sys.argv[1:] if argv is None else argv)}
    results |= {"started_at": utc_now(), "machine": machine_details(None, None)}
    results["settings"] = {
        "node_load": NODE_LOAD,
        "ttft": TTFT,
        "tpot": TPOT,
        "tokens": TOKENS,
        "capacity_per_second": round(cluster, 2),
        "rates_per_second": {tenant: round(rate, 2) for tenant, rate in rates.items()},
        "admission": ADMISSION | {"max_in_flight": NODE_LOAD["max_running"] + 1},
        "priority_headroom": HEADROOMS,
    } | {key: value for key, value in vars(args).items() if key != "out"}
    notes = [busy_note(results["machine"]["load_average_at_start"])]
    results["notes"] = [note for note in notes if note]
    runs: dict[str, dict] = {}
    with Processes(logs) as processes:
        node_scheduling = "fcfs"
        nodes = start_nodes(processes, args.nodes, node_scheduling)
        plan: list[tuple[str, list, dict[str, int] | None, int, str]] = [
            ("idle", alone, None, 0, "fcfs"),
            ("no admission", flood, None, 0, "fcfs"),
            ("admission, equal priorities", flood, {"A": 0, "B": 0}, 0, "fcfs"),
            ("admission, B above A", flood, {"A": 0, "B": 1}, 0, "fcfs"),
        ]
        plan += [(f"admission, B above A, headroom {n}", flood, {"A": 0, "B": 1}, n, "fcfs") for n in HEADROOMS]
        plan.append(("admission, equal priorities, node priority scheduling", flood, {"A": 0, "B": 0}, 0, "priority"))
        plan.append(("admission, B above A, node priority scheduling", flood, {"A": 0, "B": 1}, 0, "priority"))
        if args.only:
            plan = [step for step in plan if not step[0].startswith("admission") or args.only in step[0]]
        for name, requests, priorities, headroom, scheduling in plan:
            if scheduling != node_scheduling:
                for node in nodes:
                    processes.stop(node.process)
                node_scheduling = scheduling
                nodes = start_nodes(processes, args.nodes, node_scheduling)
            duration = args.idle_duration if name == "idle" else args.duration
            runs[name] = run(
                name,
                requests,
                duration,
                duration + args.grace,
                nodes,
                processes,
                logs,
                priorities=priorities,
                headroom=headroom,
                scheduling=scheduling,
            )
            print(f"{name}: done", file=sys.stderr, flush=True)
        token = token_run(args.token_window, nodes, processes, logs) if args.token_window > 0 else None
        for node in nodes:
            processes.stop(node.process)
    results["runs"] = list(runs.values())
    results["targets"] = evaluate(runs)
    if token is not None:
        results["token_run"] = token
        ratio = token["ratio"]
        results["targets"].append(
            {
                "run": token["run"],
                "target": f"tokens admitted over the window within ±{TOKEN_TOLERANCE:.0%} of the limit",
                "verdict": _verdict(ratio is not None and abs(ratio - 1) <= TOKEN_TOLERANCE),
                "measured": f"{token['tokens_in_window']} vs {token['expected_tokens']} over {token['window_seconds']:g} s"
                + (f": {ratio:.1%}" if ratio is not None else ": the bucket was never spent"),
            }
        )
    results |= {"load_average_at_end": load_average(), "finished_at": utc_now()}
    print(render(runs, results["targets"]))
    path = write_results(results, **({"folder": args.out} if args.out else {}), kind="admission")
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

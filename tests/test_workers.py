"""`serve --workers N`: worker processes that serve the API and follow the leader's events.

The leader runs in this process (real hypercorn, real signals sent to this process) except where
the test kills it; the workers are real processes (`interlock.worker`). A worker names itself and
the state it routes on in its `/health` headers; the leader's states are recorded as it applies
each event, so "every worker holds the leader's state at the same seq" is checked exactly.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import httpx
import trio

from controlplane.effects.replay import replay
from events.config import DEFAULT_SHUTDOWN_GRACE
from events.decisions import read_decisions
from events.types import Checkpoint
from fixtures.node import serve_nodes

from harness import Gateway, chat, config_text, decision_records, node_specs, nodes_and_gateway, sse_events

CHAT = "/v1/chat/completions"
FAST = {"health_interval": "0.1s"}


def record_leader_digests(gateway: Gateway) -> dict[int, str]:
    """The leader's state digest at every seq from now on (and at the current one)."""
    digests = {gateway.control_plane.view.snapshot.seq: Checkpoint.of(gateway.control_plane.view.snapshot).digest()}
    gateway.control_plane.applier.add_listener(lambda event, state, step: digests.__setitem__(state.seq, Checkpoint.of(state).digest()))
    return digests


async def health_by_worker(url: str, workers: Iterable[int], attempts: int = 300) -> dict[int, httpx.Response]:
    """One `/health` answer from each of `workers`, on new connections (the kernel hands each to
    whichever worker accepts it first)."""
    wanted = set(workers)
    answers: dict[int, httpx.Response] = {}
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        for _ in range(attempts):
            response = await http.get(url + "/health", headers={"Connection": "close"})
            worker = int(response.headers["x-interlock-worker"])
            answers.setdefault(worker, response)
            if wanted <= answers.keys():
                return answers
    raise AssertionError(f"only workers {sorted(answers)} of {sorted(wanted)} answered")


async def workers_agree_with_leader(gateway: Gateway, digests: dict[int, str], workers: Iterable[int]) -> None:
    for worker, response in (await health_by_worker(gateway.url, workers)).items():
        seq = int(response.headers["x-interlock-seq"])
        assert response.headers["x-interlock-state-digest"] == digests[seq], f"worker {worker} at seq {seq}"


async def routed_by_every_worker(gateway: Gateway, decisions: Path, *, to: str, workers: Iterable[int]) -> None:
    """Send requests on new connections until each of `workers` has recorded an attempt on node
    `to` (every request must succeed)."""
    wanted = {(worker, to) for worker in workers}
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        for _ in range(300):
            response = await http.post(gateway.url + CHAT, json=chat(), headers={"Connection": "close"})
            assert response.status_code == 200
            await trio.sleep(0.01)  # the records reach the leader's log in batches
            records = decision_records(decisions)
            if wanted <= {(record.worker, attempt.node) for record in records for attempt in record.attempts}:
                return
    raise AssertionError(f"not every worker of {sorted(workers)} routed to {to}")


async def test_every_worker_holds_the_leaders_state_after_a_fault_sequence(tmp_path):
    specs = node_specs(3)
    async with nodes_and_gateway(tmp_path, specs, workers=3, **FAST) as (nodes, gateway):
        digests = record_leader_digests(gateway)
        await gateway.discovered()
        nodes[1].behaviour.health = "fail"
        nodes[2].behaviour.models = "empty"
        await gateway.wait_for(
            lambda: gateway.node(nodes[1].host).status == "dead" and gateway.node(nodes[2].host).models.state == "known_empty"
        )
        nodes[1].behaviour.health = "ok"
        await gateway.wait_for(lambda: gateway.node(nodes[1].host).status == "healthy")
        await workers_agree_with_leader(gateway, digests, workers=(1, 2, 3))
        answers = (await health_by_worker(gateway.url, (1, 2, 3))).values()
        assert {answer.json()["details"][1]["status"] for answer in answers} == {"healthy"}


async def test_every_worker_follows_the_load_the_leader_scrapes(tmp_path):
    routing = {"load_scrape_interval": "0.1s"}
    async with nodes_and_gateway(tmp_path, node_specs(2), workers=2, routing=routing, **FAST) as (nodes, gateway):
        digests = record_leader_digests(gateway)
        nodes[1].behaviour.refuse = True
        await gateway.wait_for(
            lambda: gateway.node(nodes[0].host).load.known and gateway.node(nodes[1].host).load.fails >= 2
        )
        nodes[1].behaviour.refuse = False
        await gateway.wait_for(lambda: gateway.node(nodes[1].host).load.known)
        await workers_agree_with_leader(gateway, digests, workers=(1, 2))
        answers = (await health_by_worker(gateway.url, (1, 2))).values()
        assert all("load" in entry for answer in answers for entry in answer.json()["details"])


async def test_a_node_that_dies_under_load_is_avoided_by_every_worker_and_no_request_fails(tmp_path):
    specs = node_specs(3)
    decisions = tmp_path / "decisions.jsonl"
    config = {"workers": 2, "decision_log": str(decisions), "retry_unanswered": True, **FAST}
    async with nodes_and_gateway(tmp_path, specs, **config) as (nodes, gateway):
        await gateway.discovered()
        dying = nodes[1].host
        statuses: list[int] = []

        async def client(count: int) -> None:
            async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
                for _ in range(count):
                    statuses.append((await http.post(gateway.url + CHAT, json=chat())).status_code)

        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(client, 40)
            await trio.sleep(0.3)
            nodes[1].behaviour.refuse = True
            await gateway.wait_for(lambda: gateway.node(dying).status == "dead")
        dead_at = next(
            int(line["seq"]) for line in gateway.logged("node health changed") if line["node"] == dying and line["to"] == "dead"
        )
        # New connections until both workers have routed requests since the node died (the kernel
        # hands each connection to whichever worker accepts it first).
        async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
            for _ in range(300):
                response = await http.post(gateway.url + CHAT, json=chat(), headers={"Connection": "close"})
                statuses.append(response.status_code)
                await trio.sleep(0.01)  # the records reach the leader's log in batches
                after = [record for record in decision_records(decisions) if record.seq >= dead_at]
                if {record.worker for record in after} == {1, 2}:
                    break
        await gateway.wait_for(lambda: len(decision_records(decisions)) == len(statuses))
    records = list(read_decisions(decisions))
    after = [record for record in records if record.seq >= dead_at]
    assert {record.worker for record in after} == {1, 2}
    assert all(attempt.node != dying for record in after for attempt in record.attempts)
    assert statuses.count(200) == len(statuses)


async def test_a_killed_worker_is_started_again_and_catches_up(tmp_path):
    decisions = tmp_path / "decisions.jsonl"
    async with nodes_and_gateway(tmp_path, node_specs(2), workers=2, decision_log=str(decisions), **FAST) as (nodes, gateway):
        digests = record_leader_digests(gateway)
        await gateway.discovered()
        [first] = [line for line in gateway.logged("worker started") if line["worker"] == "1"]
        os.kill(int(first["pid"]), signal.SIGKILL)
        await gateway.wait_for(lambda: len([line for line in gateway.logged("worker started") if line["worker"] == "1"]) == 2)
        assert [line["worker"] for line in gateway.logged("worker exited; starting it again")] == ["1"]
        assert await gateway.metric("interlock_worker_restarts_total") == 1
        nodes[0].behaviour.models = "empty"  # news the new worker must learn from the stream
        await gateway.wait_for(lambda: gateway.node(nodes[0].host).models.state == "known_empty")
        await workers_agree_with_leader(gateway, digests, workers=(1, 2))
        async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
            with trio.fail_after(60):
                while True:
                    response = await http.post(gateway.url + CHAT, json=chat(), headers={"Connection": "close"})
                    assert response.status_code == 200
                    await trio.sleep(0.15)  # the decision reaches the leader's log in batches
                    records = decision_records(decisions)
                    if any(record.worker == 1 for record in records[-1:]):
                        break


async def test_sighup_reaches_every_worker_and_an_invalid_reload_is_rejected_once(tmp_path):
    specs = node_specs(3)
    decisions = tmp_path / "decisions.jsonl"
    async with serve_nodes(specs[2:]) as [added]:
        async with nodes_and_gateway(tmp_path, specs[:2], workers=2, decision_log=str(decisions), **FAST) as (nodes, gateway):
            digests = record_leader_digests(gateway)
            await gateway.discovered()
            gateway.config_path.write_text(
                config_text([*nodes, added], workers=2, decision_log=str(decisions), health_interval="0.1s")
            )
            os.kill(os.getpid(), signal.SIGHUP)
            await gateway.wait_for(lambda: added.host in gateway.control_plane.view.snapshot.nodes)
            await gateway.discovered()
            await workers_agree_with_leader(gateway, digests, workers=(1, 2))
            await routed_by_every_worker(gateway, decisions, to=added.host, workers=(1, 2))

            gateway.config_path.write_text("[gateway\n")
            os.kill(os.getpid(), signal.SIGHUP)
            await gateway.wait_for(lambda: gateway.logged("config reload failed; keeping current config"))
            await workers_agree_with_leader(gateway, digests, workers=(1, 2))
            await trio.sleep(0.3)
            assert len(gateway.logged("config reload failed; keeping current config")) == 1


async def test_the_event_log_of_a_run_with_workers_replays_to_the_live_transition_log(tmp_path):
    events = tmp_path / "events.jsonl"
    specs = node_specs(2)
    # No probe round after the first: the refusal is met by the workers' requests (an offline
    # mark), then by the recheck that mark asks for.
    async with nodes_and_gateway(tmp_path, specs, workers=2, event_log=str(events), health_interval="1h") as (
        nodes,
        gateway,
    ):
        await gateway.discovered()
        await health_by_worker(gateway.url, (1, 2))
        nodes[0].behaviour.refuse = True
        async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
            for _ in range(10):
                await http.post(gateway.url + CHAT, json=chat(), headers={"Connection": "close"})
        await gateway.wait_for(lambda: gateway.logged("node marked offline") and gateway.logged("node health changed"))
    live = [line for line in gateway.log.lines() if '"seq"' in line]
    replayed = [transition.log_line() for transition in replay([events]).transitions]
    assert "node marked offline" in "".join(live)
    assert replayed == live


async def test_sigterm_drains_every_worker_before_the_control_plane_stops(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1, tokens=10, tpot=0.05), workers=2) as (_, gateway):
        await health_by_worker(gateway.url, (1, 2))
        pids = [int(line["pid"]) for line in gateway.logged("worker started")]
        async with gateway.http.stream("POST", gateway.url + CHAT, json=chat(stream=True)) as stream:
            chunks = stream.aiter_text()
            text = await chunks.__anext__()
            os.kill(os.getpid(), signal.SIGTERM)
            async for chunk in chunks:
                text += chunk
        assert await gateway.exited() == 0
    assert sse_events(text)[-1] == "[DONE]"
    assert all(_exits(pid, within=1) for pid in pids)
    messages = gateway.log.messages()
    assert messages.index("shutting down") < messages.index("gateway stopped") == len(messages) - 1


def test_workers_exit_when_their_leader_is_killed(tmp_path):
    config = tmp_path / "gateway.toml"
    vllm_port, metrics_port = _free_port(), _free_port()
    node = subprocess.Popen(
        [sys.executable, "-m", "fixtures.node", "--host", "127.0.0.77", "--base-port", str(vllm_port),
         "--metrics-base-port", str(metrics_port), "--models", "test-model"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        config.write_text(
            '[gateway]\nlisten = "127.0.0.1:0"\nmetrics_listen = "127.0.0.1:0"\nworkers = 2\n'
            f'[[nodes]]\nip = "127.0.0.77"\nvllm_port = {vllm_port}\nmetrics_port = {metrics_port}\n'
        )
        leader = subprocess.Popen(
            [sys.executable, "-m", "interlock.cli", "serve", "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            pids = []
            for line in leader.stdout:
                record = json.loads(line)
                if record["msg"] == "worker started":
                    pids.append(int(record["pid"]))
                if record["msg"] == "metrics server listening":
                    break
            assert len(pids) == 2
            leader.kill()
            leader.wait(5)
            for pid in pids:
                assert _exits(pid, within=DEFAULT_SHUTDOWN_GRACE + 5), f"worker {pid} outlived its leader"
        finally:
            leader.kill()
            leader.wait()
    finally:
        node.terminate()
        node.wait()


def _ended(stream: str) -> bool:
    """Whether an event stream ended as a stream may: with [DONE], or with the error event."""
    last = sse_events(stream)[-1]
    return last == "[DONE]" or json.loads(last).get("error", {}).get("message") == "stream terminated by upstream failure"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _exits(pid: int, within: float) -> bool:
    """Whether process `pid` is gone (or a zombie nobody waits for) within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


async def test_workers_whose_leader_is_killed_finish_their_streams_and_exit_without_a_traceback(tmp_path):
    """Streams of different lengths in flight on two workers (eight: one worker has at least
    four), then SIGKILL to the leader: each stream's first decision record meets a broken
    socket. Each stream still ends with [DONE] or the error event, and the workers exit."""
    vllm_port, metrics_port, api_port = _free_port(), _free_port(), _free_port()
    node = subprocess.Popen(
        [sys.executable, "-m", "fixtures.node", "--host", "127.0.0.78", "--base-port", str(vllm_port),
         "--metrics-base-port", str(metrics_port), "--models", "test-model", "--tokens", "40", "--tpot", "0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    config, out, err = tmp_path / "gateway.toml", tmp_path / "out", tmp_path / "err"
    config.write_text(
        f'[gateway]\nlisten = "127.0.0.1:{api_port}"\nmetrics_listen = "127.0.0.1:0"\nworkers = 2\n'
        f'decision_log = "{tmp_path / "decisions.jsonl"}"\n'
        f'[[nodes]]\nip = "127.0.0.78"\nvllm_port = {vllm_port}\nmetrics_port = {metrics_port}\n'
    )
    url = f"http://127.0.0.1:{api_port}"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        leader = subprocess.Popen(
            [sys.executable, "-m", "interlock.cli", "serve", "--config", str(config)], stdout=stdout, stderr=stderr
        )
    pids: list[int] = []
    try:
        with trio.fail_after(30):
            while '"msg":"metrics server listening"' not in out.read_text():
                await trio.sleep(0.05)
        pids = [int(json.loads(line)["pid"]) for line in out.read_text().splitlines() if '"worker started"' in line]
        await health_by_worker(url, (1, 2))
        texts: dict[int, str] = {}
        started = trio.Semaphore(0)

        async def stream(tokens: int) -> None:
            body = {**chat("test-model", stream=True), "max_tokens": tokens}
            async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
                async with http.stream("POST", url + CHAT, json=body, headers={"Connection": "close"}) as response:
                    assert response.status_code == 200
                    chunks = response.aiter_text()
                    texts[tokens] = await chunks.__anext__()
                    started.release()
                    try:
                        async for chunk in chunks:
                            texts[tokens] += chunk
                    except httpx.RemoteProtocolError:
                        pass  # cut short: its last event says so

        async with trio.open_nursery() as nursery:
            lengths = [10 + 4 * number for number in range(8)]  # 1 to 4 seconds
            for tokens in lengths:
                nursery.start_soon(stream, tokens)
            with trio.fail_after(30):
                for _ in lengths:
                    await started.acquire()
            leader.kill()
        cut = [tokens for tokens in lengths if not _ended(texts[tokens])]
        assert not cut, f"streams of {cut} tokens cut short, of {lengths}"
        for pid in pids:
            assert _exits(pid, within=DEFAULT_SHUTDOWN_GRACE + 5), f"worker {pid} outlived its leader"
    finally:
        leader.kill()
        leader.wait()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        node.terminate()
        node.wait()
    assert len(pids) == 2
    assert "Traceback" not in err.read_text()
    records = [json.loads(line) for line in out.read_text().splitlines()]  # JSON lines only
    gone = [record["worker"] for record in records if record["msg"].startswith("leader gone")]
    assert sorted(gone) == ["1", "2"]

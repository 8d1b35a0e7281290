"""kv_aware end to end: a real gateway in front of simulated nodes with a real prefix cache that
publish their KV events over ZeroMQ in vLLM's format (fixtures/node.py), followed by the
gateway's own subscribers into its index; prompts tokenized with the same tokenizer directory
(fixtures/tokenizer_dir.py). Requests sent to a node directly stand for a client going around
the gateway: the gateway sees what they put in the node's cache only through the node's events.
Then `interlock verify` makes every pick again from the records (test_verify's tamper suite
changes their matches)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typing import NamedTuple

import httpx
import pytest
import trio
from harness import MODEL, decision_records, node_specs, nodes_and_gateway, running_gateway, table

from fixtures.node import NodeSpec, SimulatedNode, serve_nodes
from events.decisions import Decision
from fixtures.tokenizer_dir import write_tokenizer_dir
from journal.segments import list_segments

BLOCK = 4
CAPACITY = 48
"""Blocks a node's cache holds: a few prompts' worth, so that a few others evict one."""
SYSTEM = "Alpha system: you are a helpful assistant. Answer the question of the user briefly and precisely."
FILLERS = [
    f"{word} filler {number}: please summarise the following document in three sentences, "
    "the quick brown fox jumps over the lazy dog near the river bank."
    for number, word in enumerate(("Bravo", "Charlie", "Delta", "Echo", "Foxtrot"))
]


def chat(question: str, system: str = SYSTEM) -> dict:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": 2}


def kv_specs(tokenizer: Path) -> list[NodeSpec]:
    return [
        NodeSpec(
            name=f"n{index}", host=f"127.0.0.{index + 1}", models=[MODEL], tokenizer=str(tokenizer),
            kv_block_size=BLOCK, kv_capacity_blocks=CAPACITY, kv_events=f"tcp://127.0.0.{index + 1}:0",
            kv_events_replay=f"tcp://127.0.0.{index + 1}:0",
        )  # fmt: skip
        for index in (1, 2, 3)
    ]


def kv_settings(node: SimulatedNode) -> dict[str, str]:
    """The node's [[nodes]] keys for its KV events, as the node bound them."""
    return {"kv_events": node.kv_events.endpoint, "kv_events_replay": node.kv_events.replay_endpoint}


async def around_the_gateway(node: SimulatedNode, body: dict) -> None:
    """A request sent to the node itself, not through the gateway."""
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        response = await client.post(node.url + "/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text


class Published:
    """The KV event batches each node has published since it started, restarts included (a
    restarted node numbers its batches from 0 again)."""

    def __init__(self) -> None:
        self._before_restarts: dict[str, int] = {}

    def count(self, node: SimulatedNode) -> int:
        return self._before_restarts.get(node.name, 0) + node.kv_events.sequence + 1

    async def restart(self, node: SimulatedNode) -> None:
        """Empty the node's cache as a vLLM restart does (it publishes AllBlocksCleared as batch 0)."""
        self._before_restarts[node.name] = self.count(node)
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            assert (await client.post(node.url + "/_control/kv/restart")).status_code == 200


async def index_follows(gateway, node: SimulatedNode, published: Published) -> None:
    """Wait until the gateway's index has applied every batch of KV events the node published
    and its events flow."""
    with trio.fail_after(60):
        while True:
            applied = await gateway.metric(f'interlock_kv_events_batches_total{{node="{node.host}"}}')
            flowing = await gateway.metric(f'interlock_kv_events_flowing{{node="{node.host}"}}')
            if applied == published.count(node) and flowing == 1:
                return
            await trio.sleep(0.02)


async def routed(gateway, decisions: Path, question: str, system: str = SYSTEM) -> Decision:
    """Send the chat through the gateway: its decision record."""
    before = len(decision_records(decisions))
    response = await gateway.http.post(gateway.url + "/v1/chat/completions", json=chat(question, system))
    assert response.status_code == 200, response.text
    await gateway.wait_for(lambda: len(decision_records(decisions)) > before)
    return decision_records(decisions)[-1]


def held_by(record) -> dict[str, int]:
    return {candidate.node: candidate.kv.matched for candidate in record.candidates}


def interlock(*arguments: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "interlock.cli", *map(str, arguments)], capture_output=True, text=True, timeout=120
    )


class KvRun(NamedTuple):
    """A recorded run under kv_aware: its logs and its three requests' records, in order."""

    events: Path
    decisions: Path
    hosts: tuple[str, str, str]
    records: list[Decision]
    """Held by n1 (filled around the gateway); n1 evicted, held by n2; n2 cleared, held by n3."""


async def record_kv_run(folder: Path) -> KvRun:
    tokenizer = write_tokenizer_dir(folder / "tokenizer")
    events, decisions = folder / "events.jsonl", folder / "decisions.jsonl"
    model = f'[[models.available]]\nname = "{MODEL}"\npolicy = "kv_aware"\ntokenizer = "{tokenizer}"\n'
    records = []
    published = Published()
    async with (
        serve_nodes(kv_specs(tokenizer)) as nodes,
        running_gateway(
            folder, nodes, event_log=str(events), decision_log=str(decisions), models=(), extra=model,
            node_settings={node.name: kv_settings(node) for node in nodes},
        ) as gateway,
    ):  # fmt: skip
        n1, n2, n3 = nodes
        await gateway.discovered()
        # A client going around the gateway fills n1's cache.
        await around_the_gateway(n1, chat("What is the capital of France?"))
        await index_follows(gateway, n1, published)
        records.append(await routed(gateway, decisions, "Explain how a hash table works."))
        # n1 evicts the prompt (other prompts fill its cache); n2 holds it now.
        for filler in FILLERS:
            await around_the_gateway(n1, chat("Write a short poem about the sea.", system=filler))
        await around_the_gateway(n2, chat("What is the capital of France?"))
        await index_follows(gateway, n1, published)
        await index_follows(gateway, n2, published)
        records.append(await routed(gateway, decisions, "Translate the following sentence into German."))
        # n3 holds it too; n2 restarts (its cache cleared, AllBlocksCleared).
        await around_the_gateway(n3, chat("What is the capital of France?"))
        await published.restart(n2)
        await index_follows(gateway, n2, published)
        await index_follows(gateway, n3, published)
        records.append(await routed(gateway, decisions, "The weather is nice today."))
    [segment] = list_segments(decisions)
    return KvRun(events, segment, (n1.host, n2.host, n3.host), records)


@pytest.fixture(scope="module")
def kv_run(tmp_path_factory) -> KvRun:
    return trio.run(record_kv_run, tmp_path_factory.mktemp("kv"))


def test_a_route_follows_what_each_node_really_holds(kv_run):
    n1, n2, n3 = kv_run.hosts
    filled, evicted, cleared = kv_run.records
    # Filled around the gateway: the gateway saw it in n1's events and went there.
    assert filled.candidates[0].node == n1
    system_blocks = held_by(filled)[n1]
    assert system_blocks > 0 and held_by(filled)[n2] == held_by(filled)[n3] == 0
    # n1 evicted it: no longer preferred; n2, which holds it, is.
    assert evicted.candidates[0].node == n2
    assert held_by(evicted)[n1] == 0 and held_by(evicted)[n2] == system_blocks
    # n2 cleared by a restart: no longer preferred; n3 is.
    assert cleared.candidates[0].node == n3
    assert held_by(cleared)[n2] == 0 and held_by(cleared)[n3] == system_blocks
    for record in kv_run.records:
        assert {candidate.node for candidate in record.candidates} == set(kv_run.hosts)
        assert all(candidate.kv.flowing and not candidate.fallback for candidate in record.candidates)


def test_the_records_verify_and_explain_shows_the_blocks_each_node_held(kv_run):
    result = interlock("verify", kv_run.events, "--decisions", kv_run.decisions)
    assert (result.returncode, result.stderr) == (0, ""), result.stdout
    assert result.stdout.startswith("3 of 3 verified, 0 not verified, 0 differ")
    cleared = kv_run.records[-1]
    explained = interlock("explain", "--request-id", cleared.request_id, "--decisions", kv_run.decisions)
    assert explained.returncode == 0, explained.stderr
    rows = {row["CANDIDATE"].lstrip("* "): row for row in table(explained.stdout, "CANDIDATE")}
    for candidate in cleared.candidates:
        held = candidate.kv
        assert rows[candidate.node]["KV BLOCKS"] == f"{held.matched}/{held.total}"
        assert rows[candidate.node]["KV SEQ"] == str(held.seq)


async def test_without_kv_events_kv_aware_routes_as_prefix_affinity_and_says_so(tmp_path):
    tokenizer = write_tokenizer_dir(tmp_path / "tokenizer")
    events, decisions = tmp_path / "events.jsonl", tmp_path / "decisions.jsonl"
    model = f'[[models.available]]\nname = "{MODEL}"\npolicy = "kv_aware"\ntokenizer = "{tokenizer}"\n'
    async with nodes_and_gateway(
        tmp_path, node_specs(3), event_log=str(events), decision_log=str(decisions), models=(), extra=model
    ) as (_, gateway):
        await gateway.discovered()
        for number in range(6):
            await routed(gateway, decisions, f"Question {number}", system=FILLERS[number % 3])
    records = decision_records(decisions)
    assert all(candidate.fallback and candidate.kv is None for record in records for candidate in record.candidates)
    [segment] = list_segments(decisions)
    assert interlock("verify", events, "--decisions", segment).returncode == 0
    whatif = interlock("whatif", events, "--decisions", segment, "--policy", "prefix_affinity", "--json")
    assert json.loads(whatif.stdout)["changed"] == 0

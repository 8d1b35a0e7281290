"""One config for the fleet, with real processes: a nats-server, simulated nodes, replicas
(`interlock serve` subprocesses with `[fleet]`) and `interlock fleet config push`.

The first leader seeds the fleet's config document from its file; every replica reports the
version and digest it runs in `/health`, and a replica whose file's fleet-wide keys differ says
so (log and `X-Interlock-Config-Differs`). A pushed file (validated first: a bad one is refused
naming file and key) becomes the fleet's config through the leader's reload event, and a leader
killed leaves it in force: the new leader keeps the fleet's document, not its own file. A SIGHUP
on a follower proposes its file's fleet-wide keys; one that changed only a replica's own keys
proposes nothing and says a restart is needed."""

from __future__ import annotations

import os
import signal
import ssl
import sys

import httpx
import pytest
import trio

from controlplane.infrastructure.config import ConfigError, fleet_config_digest, fleet_wide, load_config
from events.config import FleetConfig
from fixtures.node import serve_nodes
from harness import PROJECT_ROOT, config_text, node_specs
from nats_cluster import nats_servers
from test_tls import certificate_files  # noqa: F401 (a fixture)
from test_fleet import HEALTH_INTERVAL, Replica, fleet_of, named, until


async def config_headers(http: httpx.AsyncClient, replica: Replica) -> dict[str, str]:
    """The fleet's config as `replica`'s /health reports it ({} while it does not answer)."""
    try:
        response = await http.get(replica.url + "/health", timeout=2)
    except httpx.HTTPError:
        return {}
    return {
        key.lower(): value
        for key, value in response.headers.items()
        if key.lower().startswith("x-interlock-config") or key.lower() == "x-interlock-leader"
    } | {"nodes": str(response.json()["nodes"])}


async def all_run(http: httpx.AsyncClient, replicas: list[Replica], version: int, digest: str) -> None:
    async def condition() -> bool:
        for replica in replicas:
            headers = await config_headers(http, replica)
            if (headers.get("x-interlock-config-version"), headers.get("x-interlock-config-digest")) != (
                str(version),
                digest,
            ):
                return False
        return True

    await until(condition, f"every replica runs the fleet's config version {version} ({digest})")


async def logged(replica: Replica, message: str) -> None:
    async def condition() -> bool:
        return await trio.to_thread.run_sync(lambda: message in replica.messages())

    await until(condition, f"{replica.name} logs {message!r}")


async def leader_named(http: httpx.AsyncClient, replica: Replica) -> str:
    """The leader `replica` names, once it names one."""
    leader = ""

    async def named_one() -> bool:
        nonlocal leader
        leader = (await config_headers(http, replica)).get("x-interlock-leader", "")
        return bool(leader)

    await until(named_one, f"{replica.name} names a leader")
    return leader


async def interlock(*arguments: str, check: bool = True) -> str:
    """`interlock ARGUMENTS`' output, stdout then stderr (exit 0 unless not `check`)."""
    done = await trio.run_process(
        [sys.executable, "-m", "interlock.cli", *arguments], capture_stdout=True, capture_stderr=True, check=False,
        cwd=PROJECT_ROOT,
    )  # fmt: skip
    output = done.stdout.decode() + done.stderr.decode()
    assert (done.returncode == 0) == check, output
    return output


async def test_the_fleet_runs_its_document_whatever_the_files_and_whoever_leads(tmp_path):
    differing = {"retry_unanswered": True}  # a fleet-wide key r2's file alone sets
    async with (
        nats_servers(tmp_path) as servers,
        serve_nodes(node_specs(2)) as nodes,
        fleet_of(tmp_path, nodes, servers, count=2, gateway=[{}, differing]) as replicas,
        httpx.AsyncClient() as http,
    ):
        files = {replica.name: load_config(replica.config_path) for replica in replicas}

        async def one_seeded() -> bool:
            headers = [await config_headers(http, replica) for replica in replicas]
            return all(h.get("x-interlock-config-version") == "1" for h in headers)

        await until(one_seeded, "the first leader seeds version 1")
        seeder = next(r for r in replicas if "fleet: config document seeded" in r.messages())
        other = next(r for r in replicas if r is not seeder)
        digest = fleet_config_digest(files[seeder.name])
        assert digest != fleet_config_digest(files[other.name])
        await all_run(http, replicas, 1, digest)
        assert "x-interlock-config-differs" not in await config_headers(http, seeder)
        differs = (await config_headers(http, other))["x-interlock-config-differs"]
        assert str(other.config_path) in differs and "version 1" in differs
        assert "fleet: this replica's config file differs from the fleet's; the fleet's is in force" in other.messages()

        # a file that does not validate is refused before anything is proposed, naming file and key
        bad = tmp_path / "bad.toml"
        bad.write_text(config_text(nodes, health_interval=HEALTH_INTERVAL) + '[routing]\npolicy = "fastest"\n')
        refused = await interlock("fleet", "config", "push", str(bad), "--fleet", servers[0].url, check=False)
        assert f"{bad}: routing.policy" in refused

        # a pushed file with one node becomes the fleet's config (version 2) on every replica
        pushed = tmp_path / "pushed.toml"
        pushed.write_text(config_text(nodes[:1], health_interval=HEALTH_INTERVAL))
        answer = await interlock("fleet", "config", "push", str(pushed), "--fleet", servers[0].url)
        pushed_digest = fleet_config_digest(load_config(pushed))
        assert "config version 2" in answer and pushed_digest in answer
        await all_run(http, replicas, 2, pushed_digest)
        for replica in replicas:
            headers = await config_headers(http, replica)
            assert headers["nodes"] == "1"
            assert "version 2" in headers["x-interlock-config-differs"]  # both files list two nodes

        # check-config against the fleet's export: a dry-run reload of a file's fleet-wide keys
        export = tmp_path / "export"
        await interlock("fleet", "export", str(export), "--fleet", servers[0].url)
        seeder_file = str(seeder.config_path)
        dry_run = await interlock("check-config", seeder_file, "--against", str(export))
        assert "keys changed: none" in dry_run  # its replica's own keys and [fleet] are not the fleet's
        dry_run = await interlock("check-config", str(other.config_path), "--against", str(export))
        assert "keys changed: gateway.retry_unanswered " in dry_run
        not_an_export = await interlock("check-config", seeder_file, "--against", str(tmp_path), check=False)
        assert f"{tmp_path}: a directory without events.jsonl, not a fleet export" in not_an_export

        # the leader killed: the new one keeps the fleet's document, never its own file
        leader = named(replicas, await leader_named(http, replicas[0]))
        leader.signal(signal.SIGKILL)
        survivor = next(r for r in replicas if r is not leader)

        async def survivor_leads() -> bool:
            return (await config_headers(http, survivor)).get("x-interlock-leader") == survivor.name

        await until(survivor_leads, f"{survivor.name} leads")
        assert "fleet: leading" in survivor.messages()
        await all_run(http, [survivor], 2, pushed_digest)
        assert (await config_headers(http, survivor))["nodes"] == "1"


async def test_a_sighup_on_a_follower_proposes_its_file_and_a_replica_key_alone_proposes_nothing(tmp_path):
    async with (
        nats_servers(tmp_path) as servers,
        serve_nodes(node_specs(2)) as nodes,
        fleet_of(tmp_path, nodes, servers, count=2) as replicas,
        httpx.AsyncClient() as http,
    ):
        digest = fleet_config_digest(load_config(replicas[0].config_path))
        await all_run(http, replicas, 1, digest)
        leader = await leader_named(http, replicas[0])
        follower = next(replica for replica in replicas if replica.name != leader)

        # a replica's own key changed: nothing to propose, and a restart is needed
        text = follower.config_path.read_text()
        own_key = f'[gateway]\ndecision_log = "{tmp_path}/d.jsonl"\n'
        follower.config_path.write_text(text.replace("[gateway]\n", own_key, 1))
        follower.signal(signal.SIGHUP)
        await logged(follower, "fleet: the file's fleet-wide keys are the fleet's config already")
        assert "gateway.decision_log changed; requires restart (a replica's own key)" in follower.messages()

        # a file that does not validate: the reload fails there and nothing changes
        follower.config_path.write_text(text + '[routing]\npolicy = "fastest"\n')
        follower.signal(signal.SIGHUP)
        await logged(follower, "config reload failed; keeping current config")

        # a fleet-wide key changed on the follower: proposed, and applied by the leader everywhere
        follower.config_path.write_text(text.replace("[gateway]\n", "[gateway]\nretry_unanswered = true\n", 1))
        follower.signal(signal.SIGHUP)
        changed = fleet_config_digest(load_config(follower.config_path))
        await all_run(http, replicas, 2, changed)
        assert "x-interlock-config-differs" not in await config_headers(http, follower)
        assert "x-interlock-config-differs" in await config_headers(http, named(replicas, leader))


def test_the_document_version_is_not_a_key_of_the_file(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(config_text(node_specs(1)) + '[fleet]\nnats = ["nats://127.0.0.1:4222"]\nconfig_version = 3\n')
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert (refused.value.path, refused.value.key) == (str(path), "fleet.config_version")


def test_the_fleet_wide_part_leaves_out_the_replicas_own_keys_and_the_fleet_table(tmp_path):
    first, second = tmp_path / "first.toml", tmp_path / "second.toml"
    nodes = node_specs(1)
    first.write_text(config_text(nodes) + '[fleet]\nnats = ["nats://127.0.0.1:4222"]\nreplica = "r1"\n')
    second.write_text(
        config_text(nodes, workers=2, decision_log=str(tmp_path / "d.jsonl"))
        + '[fleet]\nnats = ["nats://127.0.0.1:4223"]\nreplica = "r2"\nuser = "replica"\npassword = "secret"\n'
    )
    one, other = load_config(first), load_config(second)
    assert fleet_config_digest(one) == fleet_config_digest(other)
    assert fleet_wide(other).fleet == FleetConfig()  # no server, name or credential in the fleet's events
    assert fleet_wide(other, 4).fleet.config_version == 4
    assert fleet_wide(other).gateway.decision_log == "" and fleet_wide(other).gateway.workers == 1
    third = tmp_path / "third.toml"
    third.write_text(config_text(nodes, retry_unanswered=True) + '[fleet]\nnats = ["nats://127.0.0.1:4222"]\n')
    assert fleet_config_digest(load_config(third)) != fleet_config_digest(one)


async def test_a_replicas_workers_serve_https_with_its_own_tls_files_after_the_fleets_config_arrives(
    tmp_path, certificate_files
):
    """TLS files are a replica's own: the fleet's config carries none, and a worker started
    after the fleet's config is in force (one killed, started again) serves HTTPS with its
    replica's files."""
    ca, certificate, key = certificate_files
    async with nats_servers(tmp_path) as [server], serve_nodes(node_specs(1)) as nodes:
        directory = tmp_path / "r1"
        directory.mkdir()
        path = directory / "gateway.toml"
        tls = {"tls_certificate": certificate, "tls_key": key}
        gateway = config_text(nodes, health_interval=HEALTH_INTERVAL, workers=2, **tls)
        path.write_text(gateway + f'[fleet]\nnats = ["{server.url}"]\nreplica = "r1"\n')
        replica = Replica("r1", path, directory / "log.jsonl")
        try:
            await replica.start()
            async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=ca), trust_env=False) as https:

                async def runs_the_fleets_config() -> bool:
                    try:
                        response = await https.get(f"https://127.0.0.1:{replica.api_port}/health", timeout=2)
                    except httpx.HTTPError:
                        return False
                    return response.headers.get("X-Interlock-Config-Version") == "1"

                await until(runs_the_fleets_config, "a worker answers over HTTPS with the fleet's config")
                first = next(line["pid"] for line in replica.lines() if line.get("msg") == "worker started")
                os.kill(int(first), signal.SIGKILL)

                async def started_again() -> bool:
                    return sum(line.get("msg") == "worker started" for line in replica.lines()) == 3

                await until(started_again, "the killed worker started again")
                answered: set[str] = set()

                async def both_workers_answer_over_https() -> bool:
                    url = f"https://127.0.0.1:{replica.api_port}/health"
                    response = await https.get(url, headers={"Connection": "close"}, timeout=5)  # a new connection
                    answered.add(response.headers["X-Interlock-Worker"])
                    return len(answered) == 2

                await until(both_workers_answer_over_https, "both workers, the new one too, answer over HTTPS")
        finally:
            replica.signal(signal.SIGKILL)
            if replica.process is not None:
                await replica.process.wait()

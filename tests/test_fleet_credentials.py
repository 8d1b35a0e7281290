"""The fleet's connection with NATS credentials, against a real nats-server whose config file
(written here) asks for them: a replica with a user and password, a token over mutual TLS, an
NKey seed, or a creds file (the server in operator mode, its JWTs signed here as `nsc` would)
joins and leads; one with a wrong password, another seed, or a user of an account the operator
does not know is refused and says so; a user of the same server whose publish rights leave out
the fleet's subjects (README's account) cannot put a message on the events subject.
Credentials that cannot work (a file without a valid seed among them) are config errors naming
the key and file."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import nats
import nkeys
import pytest
import trio
import trustme

from controlplane.infrastructure.config import ConfigError, load_config
from fixtures.node import SimulatedNode, serve_nodes
from harness import config_text, node_specs
from nats_cluster import NatsServer
from test_cli_serve import readme_block
from test_fleet_config import interlock
from test_fleet import HEALTH_INTERVAL, LEASE, LEASE_RENEWAL, Replica, until
from test_tls import ca_file, issued

REPLICA_RIGHTS = readme_block("#### NATS credentials, and publish rights that are the replicas' alone", "")
"""README's account, as written: the replicas' user may publish anywhere, every other user of
the server not on the fleet's subjects, its buckets, or JetStream's API."""


def fleet_config(
    tmp_path: Path, name: str, nodes: list[SimulatedNode], server: NatsServer, credentials: str
) -> Replica:
    """Replica `name` of a fleet on `server`, its [fleet] table ending with `credentials`."""
    directory = tmp_path / name
    directory.mkdir()
    path = directory / "gateway.toml"
    fleet = (
        f'[fleet]\nnats = ["{server.url}"]\nreplica = "{name}"\nlease = "{LEASE}"\n'
        f'lease_renewal = "{LEASE_RENEWAL}"\n{credentials}\n'
    )
    path.write_text(config_text(nodes, health_interval=HEALTH_INTERVAL) + fleet)
    return Replica(name, path, directory / "log.jsonl")


async def leading(http: httpx.AsyncClient, replica: Replica) -> None:
    async def condition() -> bool:
        health = await replica.health(http)
        return health is not None and health.seq > 0 and health.leader == replica.name

    await until(condition, f"{replica.name} leads the fleet")


async def good_leads_and_wrong_is_refused(http: httpx.AsyncClient, good: Replica, wrong: Replica) -> None:
    """Start both; `good` leads, and `wrong` logs that NATS refused its credentials."""
    for replica in (good, wrong):
        await replica.start()
    await leading(http, good)
    await until(
        lambda: trio.to_thread.run_sync(lambda: "authorization violation" in wrong.log_path.read_text().lower()),
        f"{wrong.name}, with the wrong credentials, says NATS refused it",
    )


async def stop(replicas: list[Replica]) -> None:
    with trio.CancelScope(shield=True):
        for replica in replicas:
            replica.signal(9)
            if replica.process is not None:
                await replica.process.wait()


async def events_stream(url: str, user: str, password: str) -> list[bytes]:
    """Every message of the fleet's event stream, read as `user`."""

    async def read() -> list[bytes]:
        nc = await nats.connect(url, user=user, password=password)
        try:
            js = nc.jetstream()
            info = await js.stream_info("interlock-events")
            seqs = range(info.state.first_seq, info.state.last_seq + 1)
            return [(await js.get_msg("interlock-events", seq)).data for seq in seqs]
        finally:
            await nc.close()

    return await trio.to_thread.run_sync(lambda: asyncio.run(read()))


async def publish_as(url: str, user: str, password: str, subject: str, data: bytes) -> list[str]:
    """Publish as `user`; the errors the server sent back (a permissions violation)."""

    async def send() -> list[str]:
        errors: list[str] = []

        async def error_cb(error: Exception) -> None:
            errors.append(str(error))

        nc = await nats.connect(url, user=user, password=password, error_cb=error_cb)
        try:
            await nc.publish(subject, data)
            await nc.flush()
            for _ in range(100):  # the server's -ERR arrives after the flush's PONG at the latest
                if errors:
                    break
                await asyncio.sleep(0.05)
        finally:
            await nc.close()
        return errors

    return await trio.to_thread.run_sync(lambda: asyncio.run(send()))


async def test_a_replica_with_user_and_password_leads_and_no_other_user_can_publish_on_the_events_subject(tmp_path):
    conf = tmp_path / "nats.conf"
    conf.write_text(REPLICA_RIGHTS)
    server = NatsServer(name="nats1", store=tmp_path / "store", config=conf)
    replicas: list[Replica] = []
    async with serve_nodes(node_specs(1)) as nodes, httpx.AsyncClient() as http:
        await server.start()
        try:
            good = fleet_config(tmp_path, "r1", nodes, server, 'user = "replica"\npassword = "replica-secret"')
            wrong = fleet_config(tmp_path, "r2", nodes, server, 'user = "replica"\npassword = "not-the-secret"')
            replicas += [good, wrong]
            await good_leads_and_wrong_is_refused(http, good, wrong)

            errors = await publish_as(server.url, "observer", "observer-secret", "interlock.events", b"garbage")
            assert any("permissions violation" in error.lower() for error in errors), errors
            assert b"garbage" not in await events_stream(server.url, "replica", "replica-secret")
            assert "a message of the event stream set aside" not in good.messages()

            # the commands connect as the replica does, with its file's credentials
            export = tmp_path / "export"
            refused = await interlock("fleet", "export", str(export), "--fleet", server.url, check=False)
            assert "authorization violation" in refused.lower()
            exported = await interlock("fleet", "export", str(export), "--config", str(good.config_path))
            assert exported.startswith("wrote ")
            pushed = await interlock("fleet", "config", "push", str(good.config_path))
            assert "config version 2" in pushed
        finally:
            await stop(replicas)
            await server.kill()


async def test_a_replica_with_a_token_over_mutual_tls_leads(tmp_path):
    authority = trustme.CA()
    server_certificate, server_key = issued(tmp_path, authority, "nats-server", "127.0.0.1")
    client_certificate, client_key = issued(tmp_path, authority, "replica", "r1")
    authority_file = ca_file(tmp_path, authority, "ca")
    conf = tmp_path / "nats.conf"
    conf.write_text(
        'authorization { token: "fleet-token" }\n'
        f'tls {{ cert_file: "{server_certificate}", key_file: "{server_key}", ca_file: "{authority_file}", verify: true }}\n'
    )
    server = NatsServer(name="nats1", store=tmp_path / "store", config=conf)
    credentials = (
        f'token = "fleet-token"\ntls_ca_file = "{authority_file}"\n'
        f'tls_certificate = "{client_certificate}"\ntls_key = "{client_key}"'
    )
    async with serve_nodes(node_specs(1)) as nodes, httpx.AsyncClient() as http:
        await server.start()
        replica = fleet_config(tmp_path, "r1", nodes, server, credentials)
        try:
            await replica.start()
            await leading(http, replica)
        finally:
            await stop([replica])
            await server.kill()


PUBLIC_KEY = "UAMK2FG4MI6UE3ACF3FK3OIQBCEIEZV7NSWFFEW63UXMRLFM2XLAXK4GY\n"
"""A user's public key where its seed belongs."""
JWT = "-----BEGIN NATS USER JWT-----\neyJ0\n------END NATS USER JWT------\n"


@pytest.mark.parametrize(
    ("credentials", "content", "key", "message"),
    [
        ('user = "replica"', None, "fleet.password", "user is set: password must be set too"),
        ('user = "a"\npassword = "b"\ntoken = "c"', None, "fleet.token", "user and token are two ways to authenticate"),
        ('creds_file = "{file}"', None, "fleet.creds_file", "reading {file}: No such file or directory"),
        ('tls_ca_file = "{file}"', None, "fleet.tls_ca_file", "{file}"),
        ('tls_certificate = "{file}"', None, "fleet.tls_key", "tls_certificate is set: tls_key must be set too"),
        ('nkey_seed_file = "{file}"', "not a seed\n", "fleet.nkey_seed_file", "{file} holds no valid NKey seed"),
        ('nkey_seed_file = "{file}"', PUBLIC_KEY, "fleet.nkey_seed_file", "{file} holds no valid NKey seed"),
        ('creds_file = "{file}"', "", "fleet.creds_file", "{file} is not a NATS credentials file: no user JWT"),
        ('creds_file = "{file}"', JWT, "fleet.creds_file", "{file} is not a NATS credentials file: no NKey seed"),
        (
            'creds_file = "{file}"',
            JWT + "-----BEGIN USER NKEY SEED-----\nSUnot-a-seed\n------END USER NKEY SEED------\n",
            "fleet.creds_file",
            "{file} holds no valid NKey seed",
        ),
    ],
)
def test_credentials_that_cannot_work_are_refused_naming_the_key_and_the_file(
    tmp_path, credentials, content, key, message
):
    file = tmp_path / "credentials.file"
    if content is not None:
        file.write_text(content)
    path = tmp_path / "gateway.toml"
    fleet = '[fleet]\nnats = ["nats://127.0.0.1:4222"]\nreplica = "r1"\n' + credentials.format(file=file)
    path.write_text(config_text(node_specs(1)) + fleet)
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert (refused.value.path, refused.value.key) == (str(path), key)
    assert message.format(file=file) in refused.value.message


def new_seed(prefix: int = nkeys.PREFIX_BYTE_USER) -> tuple[bytes, str]:
    """A new NKey (a user's by default): its seed (`SU…`, the replica's file) and public key
    (`U…`, the server's)."""
    seed = nkeys.encode_seed(os.urandom(32), prefix)
    return seed, nkeys.from_seed(bytearray(seed)).public_key.decode()


async def one_leads_and_the_other_is_refused(tmp_path: Path, conf: Path, good: str, wrong: str) -> None:
    """A nats-server with config `conf` and two replicas, their credentials `good` and `wrong`:
    the first leads, the second says NATS refused it."""
    server = NatsServer(name="nats1", store=tmp_path / "store", config=conf)
    replicas: list[Replica] = []
    async with serve_nodes(node_specs(1)) as nodes, httpx.AsyncClient() as http:
        await server.start()
        try:
            for name, credentials in (("r1", good), ("r2", wrong)):
                replicas.append(fleet_config(tmp_path, name, nodes, server, credentials))
            await good_leads_and_wrong_is_refused(http, *replicas)
        finally:
            await stop(replicas)
            await server.kill()


async def test_a_replica_with_an_nkey_seed_leads_and_one_with_another_seed_is_refused(tmp_path):
    seed, public_key = new_seed()
    other_seed, _ = new_seed()
    (tmp_path / "replica.nk").write_bytes(seed + b"\n")
    (tmp_path / "other.nk").write_bytes(other_seed + b"\n")
    conf = tmp_path / "nats.conf"
    conf.write_text(f'authorization {{ users = [ {{ nkey: "{public_key}" }} ] }}\n')
    good, wrong = (f'nkey_seed_file = "{tmp_path / name}"' for name in ("replica.nk", "other.nk"))
    await one_leads_and_the_other_is_refused(tmp_path, conf, good, wrong)


def signed_jwt(issuer_seed: bytes, subject: str, claims: dict[str, Any]) -> str:
    """A NATS JWT (as `nsc` writes one) for `subject`, its `nats` claims `claims`, signed by the
    key of `issuer_seed`."""

    def encoded(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    issuer = nkeys.from_seed(bytearray(issuer_seed))
    header = encoded(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = {"jti": encoded(os.urandom(16)), "iat": int(time.time()), "iss": issuer.public_key.decode()}
    payload = encoded(json.dumps(body | {"name": subject, "sub": subject, "nats": claims}).encode())
    return f"{header}.{payload}.{encoded(issuer.sign(f'{header}.{payload}'.encode()))}"


UNLIMITED = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True, "conn": -1}
JETSTREAM = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}


def creds_file(path: Path, account_seed: bytes) -> Path:
    """A credentials file at `path`: a new user's JWT issued by the account of `account_seed`, and
    the user's seed."""
    seed, public_key = new_seed()
    user = signed_jwt(account_seed, public_key, {"type": "user", "version": 2, "pub": {}, "sub": {}} | UNLIMITED)
    path.write_text(
        f"-----BEGIN NATS USER JWT-----\n{user}\n------END NATS USER JWT------\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{seed.decode()}\n------END USER NKEY SEED------\n"
    )
    return path


def operator_mode(tmp_path: Path) -> tuple[Path, bytes]:
    """A nats-server config in operator mode (an operator JWT, its accounts preloaded: the
    fleet's with JetStream, and the system account), and the fleet account's seed."""
    operator_seed, operator = new_seed(nkeys.PREFIX_BYTE_OPERATOR)
    account_seed, account = new_seed(nkeys.PREFIX_BYTE_ACCOUNT)
    _, system = new_seed(nkeys.PREFIX_BYTE_ACCOUNT)
    operator_jwt = tmp_path / "operator.jwt"
    operator_claims = {"type": "operator", "version": 2, "system_account": system}
    operator_jwt.write_text(signed_jwt(operator_seed, operator, operator_claims))
    fleet_account = signed_jwt(
        operator_seed, account, {"type": "account", "version": 2, "limits": UNLIMITED | JETSTREAM}
    )
    system_account = signed_jwt(operator_seed, system, {"type": "account", "version": 2, "limits": UNLIMITED})
    conf = tmp_path / "nats.conf"
    conf.write_text(
        f'operator: "{operator_jwt}"\nsystem_account: {system}\nresolver: MEMORY\n'
        f'resolver_preload: {{\n  {account}: "{fleet_account}"\n  {system}: "{system_account}"\n}}\n'
    )
    return conf, account_seed


async def test_a_replica_with_a_creds_file_leads_and_one_of_an_unknown_account_is_refused(tmp_path):
    conf, account_seed = operator_mode(tmp_path)
    unknown_account_seed, _ = new_seed(nkeys.PREFIX_BYTE_ACCOUNT)
    good = creds_file(tmp_path / "replica.creds", account_seed)
    wrong = creds_file(tmp_path / "unknown.creds", unknown_account_seed)
    await one_leads_and_the_other_is_refused(tmp_path, conf, f'creds_file = "{good}"', f'creds_file = "{wrong}"')

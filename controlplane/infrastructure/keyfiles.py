"""The key files a config names: client key digests (`gateway.api_key_file`) and the keys sent
to nodes (`gateway.upstream_api_key_file`, `nodes[].api_key_file`). Errors are ValueErrors
naming the file, never a key; the loader adds the config file and the key.

The loader reads them all (in its thread) to check them, and keeps the client digests in the
config. The upstream keys stay in their files, so that no key enters an event: each process
reads them once per config it takes up (`UpstreamKeys`), off the event loop, never on a request;
the TLS contexts of https nodes (`controlplane.infrastructure.tlsfiles`) are built at the same moment."""

from __future__ import annotations

import re
import ssl

import trio

from controlplane.infrastructure.small_files import read_small_file
from controlplane.infrastructure.tlsfiles import upstream_contexts
from events.config import Config
from events.types import Checkpoint, ConfigReloaded, Event, RunStarted

MAX_KEY_FILE_BYTES = 16 * 1024 * 1024
"""The largest key file the gateway reads (a digest a line: about 250,000 client keys)."""
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
NOT_A_DIGEST = "not a SHA-256 hex digest (64 hex digits: printf %s KEY | sha256sum)"


def read_key_digests(key_file: str) -> list[str]:
    """The digests in `api_key_file`: one a line; blank lines and `#` comments are skipped.
    Raises ValueError naming the file (and the line)."""
    try:
        lines = read_small_file(key_file, MAX_KEY_FILE_BYTES, "a key file").decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"reading api_key_file: {exc}") from None
    digests = []
    for number, line in enumerate(lines, start=1):
        text = line.partition("#")[0].strip().lower()
        if not text:
            continue
        if not SHA256_HEX.fullmatch(text):
            raise ValueError(f"{key_file}:{number}: {NOT_A_DIGEST}")
        digests.append(text)
    return digests


def read_upstream_key(key_file: str) -> str:
    """The key in an upstream key file (surrounding whitespace dropped); raises ValueError
    naming the file. The key never appears in the error."""
    try:
        key = read_small_file(key_file, MAX_KEY_FILE_BYTES, "a key file").strip()
    except OSError as exc:
        raise ValueError(f"reading key file: {exc}") from None
    if not key:
        raise ValueError(f"key file {key_file!r} is empty")
    if not all(0x21 <= byte <= 0x7E for byte in key):
        raise ValueError(f"key file {key_file!r} must hold one key of printable ASCII without spaces")
    return key.decode("ascii")


def upstream_authorizations(config: Config | None) -> dict[str, bytes]:
    """The `Authorization` header value to send each node that has a key file, by IP. A file
    that became unreadable since the config was loaded sends no key (the node answers 401,
    which the model listing reports)."""
    if config is None:
        return {}
    authorizations = {}
    for ip, key_file in config.upstream_key_files().items():
        try:
            authorizations[ip] = b"Bearer " + read_upstream_key(key_file).encode()
        except ValueError:
            continue
    return authorizations


def _upstream_credentials(config: Config | None) -> tuple[dict[str, bytes], dict[str, ssl.SSLContext]]:
    return upstream_authorizations(config), upstream_contexts(config)


class UpstreamKeys:
    """A process's upstream keys and TLS contexts: those of the config in force (`in_force`,
    `tls_in_force`), and those read for the config it is about to take up. A process `read`s
    (in a thread) before it applies the event that puts a config in force, and its apply step
    calls `take_up` with no await between the new snapshot and the new keys, so a request never
    sees one config with another's keys."""

    def __init__(self) -> None:
        self.in_force: dict[str, bytes] = {}
        """The `Authorization` each node with a key file gets under the config in force, by IP."""
        self.tls_in_force: dict[str, ssl.SSLContext] = {}
        """The context each https node's connections are made with under the config in force, by IP."""
        self._read: tuple[Config | None, dict[str, bytes], dict[str, ssl.SSLContext]] = (None, {}, {})

    async def read(self, config: Config | None) -> None:
        """Read the key and TLS files `config` names, off the event loop, for `take_up`."""
        self._read = config, *await trio.to_thread.run_sync(_upstream_credentials, config)

    async def read_before(self, event: Event) -> None:
        """`read` the config `event` puts in force, if it puts one (a follower's step before
        applying an event of its leader's)."""
        if isinstance(event, (RunStarted, ConfigReloaded, Checkpoint)):
            await self.read(event.config)

    def take_up(self, config: Config | None) -> None:
        """`config` has just been put in force: its keys and contexts, as `read` read them. A
        config that names no key file and no https node needs no read."""
        read_for, authorizations, contexts = self._read
        if read_for is not config:
            if config is not None and (config.upstream_key_files() or config.https_nodes()):
                raise RuntimeError("a config was put in force before its upstream key and TLS files were read")
            authorizations, contexts = {}, {}
        self.in_force = authorizations
        self.tls_in_force = contexts
        self._read = (None, {}, {})

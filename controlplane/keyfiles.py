"""The key files a config names: client key digests (`gateway.api_key_file`) and the keys sent
to nodes (`gateway.upstream_api_key_file`, `nodes[].api_key_file`). Errors are ValueErrors
naming the file, never a key; the loader adds the config file and the key."""

from __future__ import annotations

import re

from events.config import Config

SHA256_HEX = re.compile(r"[0-9a-f]{64}")
NOT_A_DIGEST = "not a SHA-256 hex digest (64 hex digits: printf %s KEY | sha256sum)"


def read_key_digests(key_file: str) -> list[str]:
    """The digests in `api_key_file`: one a line; blank lines and `#` comments are skipped.
    Raises ValueError naming the file (and the line)."""
    try:
        with open(key_file, encoding="utf-8") as file:
            lines = file.read().splitlines()
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
        with open(key_file, "rb") as file:
            key = file.read().strip()
    except OSError as exc:
        raise ValueError(f"reading key file: {exc}") from None
    if not key:
        raise ValueError(f"key file {key_file!r} is empty")
    if not all(0x21 <= byte <= 0x7E for byte in key):
        raise ValueError(f"key file {key_file!r} must hold one key of printable ASCII without spaces")
    return key.decode("ascii")


def upstream_authorizations(config: Config) -> dict[str, bytes]:
    """The `Authorization` header value to send each node that has a key file, by IP. A file
    that became unreadable since the config was loaded sends no key (the node answers 401,
    which the model listing reports)."""
    authorizations = {}
    for ip, key_file in config.upstream_key_files().items():
        try:
            authorizations[ip] = b"Bearer " + read_upstream_key(key_file).encode()
        except ValueError:
            continue
    return authorizations

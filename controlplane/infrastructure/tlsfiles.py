"""The TLS files a config names: the API listener's certificate and key (`gateway.tls_certificate`,
`gateway.tls_key`), and what the gateway needs to reach a node over HTTPS (`nodes[].ca_file`,
`client_certificate`, `client_key`). Errors are ValueErrors naming the file; the loader adds the
config file and the key."""

from __future__ import annotations

import ssl

from controlplane.infrastructure.small_files import check_small_file
from events.config import Config

MAX_TLS_FILE_BYTES = 1024 * 1024
"""The largest certificate, key or CA file the gateway loads (a chain or a CA bundle is tens
of kilobytes)."""


def check_server_files(certificate: str, key: str) -> None:
    """Raise ValueError unless `certificate` and `key` are a PEM certificate (chain) and its
    private key, as the listener will load them when it starts."""
    _load_pair(ssl.create_default_context(ssl.Purpose.CLIENT_AUTH), certificate, key)


def client_context(ca_file: str, certificate: str, key: str) -> ssl.SSLContext:
    """The context a connection to a node is made with: the server's certificate is checked
    against `ca_file`'s CAs ("": the system's trust store) and must name the node's address;
    `certificate` and `key` (both or neither) are the client certificate of mutual TLS."""
    if ca_file:
        _readable(ca_file)
    try:
        context = ssl.create_default_context(cafile=ca_file or None)
    except ssl.SSLError as error:
        raise ValueError(f"{ca_file} holds no PEM CA certificate: {error.reason or error}") from None
    if certificate:
        _load_pair(context, certificate, key)
    return context


def upstream_contexts(config: Config | None) -> dict[str, ssl.SSLContext]:
    """The context each https node's connections are made with, by IP, built from its files
    now. A file that became unusable since the config was loaded leaves the system's trust
    store and no client certificate: the node's certificate is still checked, and a node that
    wants one refuses the handshake, which its health check reports."""
    if config is None:
        return {}
    contexts = {}
    for node in config.https_nodes():
        try:
            contexts[node.ip] = client_context(node.ca_file, node.client_certificate, node.client_key)
        except ValueError:
            contexts[node.ip] = ssl.create_default_context()
    return contexts


def _load_pair(context: ssl.SSLContext, certificate: str, key: str) -> None:
    for path in (certificate, key):
        _readable(path)
    try:
        context.load_cert_chain(certfile=certificate, keyfile=key)
    except ssl.SSLError as error:
        raise ValueError(f"{certificate} and {key} are not a PEM certificate and its key: {error.reason or error}") from None


def _readable(path: str) -> None:
    """Raise ValueError unless `path` is a regular file of at most MAX_TLS_FILE_BYTES that this
    process may read, opened without blocking (OpenSSL's own open would wait on a FIFO for ever)."""
    try:
        check_small_file(path, MAX_TLS_FILE_BYTES, "a TLS file")
    except OSError as error:
        raise ValueError(f"reading {path}: {error.strerror or error}") from None

"""The TLS files a config names: the API listener's certificate and key (`gateway.tls_certificate`,
`gateway.tls_key`). Errors are ValueErrors naming the file; the loader adds the config file and
the key."""

from __future__ import annotations

import ssl


def check_server_files(certificate: str, key: str) -> None:
    """Raise ValueError unless `certificate` and `key` are a PEM certificate (chain) and its
    private key, as the listener will load them when it starts."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    for path in (certificate, key):
        try:
            with open(path, "rb"):
                pass
        except OSError as error:
            raise ValueError(f"reading {path}: {error.strerror or error}") from None
    try:
        context.load_cert_chain(certfile=certificate, keyfile=key)
    except ssl.SSLError as error:
        raise ValueError(f"{certificate} and {key} are not a PEM certificate and its key: {error.reason or error}") from None

"""How a replica, or `interlock fleet …`, proves itself to NATS: the `[fleet]` table's
credentials and TLS files as arguments of nats-py's `connect` (the loader has checked them:
one way to authenticate at most, every file readable)."""

from __future__ import annotations

from typing import Any

import nats.errors

from controlplane.infrastructure.tlsfiles import client_context
from events.config import FleetConfig


def connect_options(fleet: FleetConfig) -> dict[str, Any]:
    """`nats.connect`'s keyword arguments for `fleet`'s credentials: user and password, a token,
    an NKey seed file or a credentials file, and a TLS context when a CA or a client
    certificate is given or a server URL is `tls://` (the system's CAs then). A TLS file that
    became unusable since the config was loaded is a failure to reach NATS, naming the file
    (nats.errors.Error: the replica serves on and tries again)."""
    options: dict[str, Any] = {}
    if fleet.user:
        options.update(user=fleet.user, password=fleet.password)
    if fleet.token:
        options.update(token=fleet.token)
    if fleet.nkey_seed_file:
        options.update(nkeys_seed=fleet.nkey_seed_file)
    if fleet.creds_file:
        options.update(user_credentials=fleet.creds_file)
    if fleet.tls_ca_file or fleet.tls_certificate or any(url.startswith("tls://") for url in fleet.nats):
        try:
            options.update(tls=client_context(fleet.tls_ca_file, fleet.tls_certificate, fleet.tls_key))
        except ValueError as error:
            raise nats.errors.Error(f"fleet TLS: {error}") from None
    return options

"""The fleet's config document: the one config every replica runs, versioned in the fleet's
JetStream (bucket `N-config`, key `config`; its revision is the version).

Kept in a key-value bucket rather than as events on the event stream, because a proposal must
outlive who makes it: `fleet config push` and a replica's SIGHUP store a new version whether or
not a leader holds the lease at that moment, JetStream acknowledges it (the pusher learns its
version), the document outlives the event stream's retention and its checkpoints, and two
replicas starting a new fleet at once cannot both seed it (`kv.create`). Only the leader turns
a version into the reload event (`ConfigReloaded`, the fleet-wide config with its version in
`[fleet]`), so the fleet's config changes only through its numbered events, and a new leader
appends the document's config, never its own file's.

The document holds the fleet-wide part of a config file (`controlplane.infrastructure.config.
fleet_wide`), the path it was read from, and who proposed it.
"""

from __future__ import annotations

import msgspec

from controlplane.infrastructure.config import fleet_wide
from events.config import Config, FleetConfig
from fleet.jetstream import command_link


class ConfigDocument(msgspec.Struct, frozen=True, kw_only=True):
    config: Config
    """The fleet-wide part of the proposed file."""
    path: str
    """The file it was read from (the reload event's `config_path`)."""
    origin: str
    """Who proposed it: `push from HOST`, `SIGHUP of replica NAME`, `seeded by replica NAME`."""

    def in_force(self, version: int) -> Config:
        """The config the leader appends for this document at `version`."""
        return fleet_wide(self.config, version)


def encode_document(config: Config, path: str, origin: str) -> bytes:
    """The document for `config` (a whole file's, or the fleet's in force), as stored."""
    return msgspec.json.encode(ConfigDocument(config=fleet_wide(config), path=path, origin=origin))


def decode_document(data: bytes) -> ConfigDocument:
    """The document as stored; msgspec.DecodeError or ValidationError when it is not one."""
    return msgspec.json.decode(data, type=ConfigDocument)


async def propose(fleet: FleetConfig, document: bytes) -> int:
    """Store `document` as the fleet's next config document (`interlock fleet config push`),
    through a connection of its own; its version."""
    async with command_link(fleet) as link:
        await link.open_config_bucket()
        return await link.propose_config(document)

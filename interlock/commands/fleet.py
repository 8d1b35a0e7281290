"""`interlock fleet export`: the fleet's streams in NATS JetStream written as logs; `interlock
fleet config push`: a file's fleet-wide keys proposed as the fleet's config."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import trio
from msgspec.structs import replace

from controlplane.infrastructure.config import ConfigError, Overrides, fleet_config_digest, load_config
from events.config import DEFAULT_FLEET_NAME, Config, FleetConfig
from interlock.commands.common import argument_type, bad_input
from interlock.commands.serve import parse_nats_urls


def add_fleet(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("fleet", help="the fleet's streams in NATS JetStream")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    export = actions.add_parser(
        "export", help="write the fleet's event and decision streams as logs (DIR/events.jsonl, DIR/decisions.jsonl)"
    )
    export.add_argument("dir", type=Path, metavar="DIR", help="where events.jsonl and decisions.jsonl go")
    export.add_argument(
        "--fleet",
        type=argument_type(parse_nats_urls),
        metavar="URL[,URL…]",
        help="the NATS servers (default, with --config: its [fleet] nats)",
    )
    export.add_argument(
        "--config",
        metavar="FILE",
        help="a replica's config file: its [fleet] table's credentials, TLS files, servers and name are used",
    )
    export.add_argument(
        "--name", help=f"the fleet's name (default: the --config file's [fleet] name, else {DEFAULT_FLEET_NAME})"
    )
    export.add_argument(
        "--partitions",
        type=Path,
        nargs="+",
        action="extend",
        default=[],
        metavar="PARTITION_DIR",
        help="replicas' [fleet] partition_dir: their partitions' events are written as DIR/partitions/NAME/",
    )
    export.set_defaults(run=run_fleet_export)
    config = actions.add_parser("config", help="the fleet's config document")
    config_actions = config.add_subparsers(dest="config_action", required=True, metavar="ACTION")
    push = config_actions.add_parser(
        "push",
        help="validate a file here, propose its fleet-wide keys as the fleet's config (the leader applies it)",
    )
    push.add_argument("path", metavar="FILE", help="the config file (its replica's own keys are not pushed)")
    push.add_argument(
        "--fleet",
        type=argument_type(parse_nats_urls),
        metavar="URL[,URL…]",
        help="the NATS servers (default: the file's [fleet] nats); the file's [fleet] credentials are used",
    )
    push.add_argument("--name", help=f"the fleet's name (default: the file's [fleet] name, else {DEFAULT_FLEET_NAME})")
    push.set_defaults(run=run_fleet_config_push)


def run_fleet_export(args: argparse.Namespace) -> int:
    from fleet.export import (  # NATS, imported only for the fleet
        ExportError,
        export_partitions,
        partitions_named,
        run_export,
        run_export_decisions,
    )

    if args.config is not None:
        try:
            _, fleet = fleet_of_file(args.config, args.fleet, args.name, "export")
        except ValueError as error:
            return bad_input(args, str(error))
    elif args.fleet is None:
        return bad_input(args, "give the NATS servers with --fleet URL, or a replica's config file with --config FILE")
    else:
        name = args.name or DEFAULT_FLEET_NAME
        fleet = FleetConfig(nats=args.fleet, name=name, replica="export", lease=1.0, lease_renewal=0.5)
    try:
        path, count = run_export(fleet, args.dir)
        decisions_path, decisions = run_export_decisions(fleet, args.dir)
        partitions = export_partitions(args.partitions, args.dir)
    except ExportError as error:
        return bad_input(args, str(error))
    except Exception as error:  # NATS unreachable, a stream missing: one line, no traceback
        servers = ",".join(fleet.nats)
        return bad_input(args, f"cannot read the fleet {fleet.name!r} from {servers}: {str(error) or repr(error)}")
    print(f"wrote {count} events to {path}")
    print(f"wrote {decisions} decision records to {decisions_path}")
    for partition in partitions:
        where = args.dir / "partitions" / partition.partition
        print(f"wrote partition {partition.partition} ({partition.interval()}) to {where}")
    for name in sorted(partitions_named(decisions_path) - {partition.partition for partition in partitions}):
        print(
            f"interlock: fleet export: records were routed in partition {name}, whose events are not in the export "
            "(give its replica's partition_dir with --partitions)",
            file=sys.stderr,
        )
    return 0


def run_fleet_config_push(args: argparse.Namespace) -> int:
    from fleet.document import encode_document, propose  # NATS, imported only for the fleet

    try:
        config, fleet = fleet_of_file(args.path, args.fleet, args.name, "config-push")
    except ValueError as error:
        return bad_input(args, str(error))
    origin = f"push from {socket.gethostname()}"
    try:
        version = trio.run(propose, fleet, encode_document(config, os.path.abspath(args.path), origin))
    except Exception as error:  # NATS unreachable or refusing: one line, no traceback
        servers = ",".join(fleet.nats)
        return bad_input(args, f"cannot propose to the fleet {fleet.name!r} on {servers}: {str(error) or repr(error)}")
    print(f"proposed {args.path} as the fleet {fleet.name!r}'s config version {version} (digest "
          f"{fleet_config_digest(config)}); its leader applies it as the reload event")  # fmt: skip
    return 0


def fleet_of_file(path: str, urls: tuple[str, ...] | None, name: str | None, who: str) -> tuple[Config, FleetConfig]:
    """The config file at `path`, validated, and the fleet connection its `[fleet]` table gives
    (credentials and TLS files), with `urls` and `name` (the command line's) winning, made as
    `who`; ValueError naming the file and key when it does not validate or has no servers."""
    try:
        config = load_config(path, warn=lambda unknown: print(f"warning: {unknown}", file=sys.stderr),
                             overrides=Overrides(fleet_nats=urls))  # fmt: skip
    except ConfigError as error:
        raise ValueError(str(error)) from None
    if config.fleet is None:
        raise ValueError(f"{path}: no [fleet] table: give the NATS servers with --fleet URL")
    return config, replace(config.fleet, name=name or config.fleet.name, replica=who)

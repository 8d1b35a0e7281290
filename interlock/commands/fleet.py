"""`interlock fleet export`: the fleet's streams in NATS JetStream written as logs."""

from __future__ import annotations

import argparse
from pathlib import Path

from events.config import DEFAULT_FLEET_NAME, FleetConfig
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
        "--fleet", required=True, type=argument_type(parse_nats_urls), metavar="URL[,URL…]", help="the NATS servers"
    )
    export.add_argument("--name", default=DEFAULT_FLEET_NAME, help=f"the fleet's name (default: {DEFAULT_FLEET_NAME})")
    export.set_defaults(run=run_fleet_export)


def run_fleet_export(args: argparse.Namespace) -> int:
    from fleet.export import ExportError, run_export, run_export_decisions  # NATS, imported only for the fleet

    fleet = FleetConfig(nats=args.fleet, name=args.name, replica="export", lease=1.0, lease_renewal=0.5)
    try:
        path, count = run_export(fleet, args.dir)
        decisions_path, decisions = run_export_decisions(fleet, args.dir)
    except ExportError as error:
        return bad_input(args, str(error))
    except Exception as error:  # NATS unreachable, a stream missing: one line, no traceback
        servers = ",".join(args.fleet)
        return bad_input(args, f"cannot read the fleet {args.name!r} from {servers}: {error or repr(error)}")
    print(f"wrote {count} events to {path}")
    print(f"wrote {decisions} decision records to {decisions_path}")
    return 0

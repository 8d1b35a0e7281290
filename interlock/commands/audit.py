"""`interlock audit`: the transition log lines the live gateway printed."""

from __future__ import annotations

import argparse
import sys

from controlplane.effects.replay import audit, node_ips
from events.config import LOG_FORMATS
from interlock.commands.common import (
    EXIT_OK,
    add_log_arguments,
    add_skip_invalid,
    add_span,
    argument_type,
    bad_input,
    replay_logs,
)
from interlock.render import KINDS, parse_kinds


def add_audit(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("audit", help="print the transition log lines the live gateway printed")
    add_log_arguments(parser, moment=False)
    parser.add_argument("--node", metavar="IP|NAME", help="only transitions of this node (its IP, or its name)")
    add_span(parser)
    parser.add_argument(
        "--kind",
        dest="kinds",
        action="extend",
        type=argument_type(parse_kinds),
        metavar="KIND[,KIND]",
        help=f"only these kinds: {KINDS}",
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=LOG_FORMATS[0],
        help="json: plinth's JSON lines; text: the live --log-format text lines (default: json)",
    )
    add_skip_invalid(parser)
    parser.set_defaults(run=run_audit)


def run_audit(args: argparse.Namespace) -> int:
    result = replay_logs(args)
    nodes = None
    if args.node is not None:
        nodes = node_ips(result, args.node)
        if not nodes:
            known = ", ".join(sorted(f"{ip} ({name})" if name else ip for ip, name in result.configured_nodes))
            return bad_input(args, f"argument --node: no node {args.node!r} in the log (its nodes: {known or 'none'})")
    lines = audit(result.transitions, nodes=nodes, since=args.since, until=args.until, kinds=args.kinds)
    sys.stdout.write("".join(transition.log_line(args.log_format) + "\n" for transition in lines))
    if not lines:
        print(f"{args.prog}: no transition of the log's {len(result.transitions)} matches", file=sys.stderr)
    return EXIT_OK

"""`interlock replay`: the cluster state recorded in an event log."""

from __future__ import annotations

import argparse

from interlock.commands.common import EXIT_OK, add_log_arguments, add_skip_invalid, print_json, replay_logs
from interlock.render import render_state, state_to_builtins


def add_replay(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("replay", help="rebuild the cluster state recorded in an event log")
    add_log_arguments(parser, moment=True)
    add_skip_invalid(parser)
    parser.set_defaults(run=run_replay)


def run_replay(args: argparse.Namespace) -> int:
    result = replay_logs(args, until_seq=args.until_seq, until_at=args.at)
    now = result.moment(args.at)
    if args.json:
        print_json(state_to_builtins(result, now))
    else:
        print(render_state(result, now))
    return EXIT_OK

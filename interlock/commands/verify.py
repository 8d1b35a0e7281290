"""`interlock verify`: every recorded decision made again with this code, and compared."""

from __future__ import annotations

import argparse

import msgspec

from events.decisions import read_decisions_with_gaps
from interlock.commands.common import (
    EXIT_FAILURE,
    EXIT_OK,
    add_decision_logs,
    add_log_arguments,
    add_partition,
    add_skip_invalid,
    add_span,
    bad_input,
    print_json,
    warner,
)
from interlock.verify import DEFAULT_SHOWN, incomplete_warning, unnumbered_warning, verify
from interlock.verify import render_report as render_verify_report


def add_verify(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "verify",
        help="make every recorded decision again with this code, on the state it was made on, and check "
        "every field of each record (exit 1 at the first difference, or a record missing or repeated)",
    )
    add_log_arguments(parser, moment=False)
    add_decision_logs(parser)
    add_partition(parser)
    add_span(parser)
    parser.add_argument(
        "--show",
        type=int,
        default=DEFAULT_SHOWN,
        metavar="N",
        help=f"differences (and records not verified) named; the rest are counted (default: {DEFAULT_SHOWN})",
    )
    parser.add_argument(
        "--allow-unverified",
        action="store_true",
        help="records that cannot be verified (lacking policy inputs, beyond the event log) do not fail the run",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_skip_invalid(parser)
    parser.set_defaults(run=run_verify)


def run_verify(args: argparse.Namespace) -> int:
    if args.show < 1:
        return bad_input(args, "argument --show: must be at least 1")
    warn = warner(args)
    skip = warn if args.skip_invalid else None
    report = verify(
        args.logs,
        read_decisions_with_gaps(args.decisions, warn, skip),
        since=args.since,
        until=args.until,
        shown=args.show,
        warn=warn,
        skip_invalid=skip,
        allow_unverified=args.allow_unverified,
        partition=args.partition,
    )
    if report.numbering.unnumbered:
        warn(unnumbered_warning(report.numbering))
    if report.incomplete:
        warn(incomplete_warning(report.incomplete, report.decisions, report.missing, report.incomplete_ids))
    if args.json:
        print_json({**msgspec.to_builtins(report), "not_verified": report.not_verified, "passed": report.passed})
    else:
        print(render_verify_report(report))
    return EXIT_OK if report.passed else EXIT_FAILURE

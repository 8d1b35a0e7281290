"""What the verbs of the `interlock` command line share: exit codes, argument types and groups, output, errors."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Callable

import msgspec

from controlplane.effects.replay import ReplayResult, replay
from events.decisions import Decision, missing_inputs, read_decisions_with_gaps
from interlock.render import parse_time, parse_time_through
from interlock.verify import MissingInputs

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_NO_NODE = 3


def package_version() -> str:
    try:
        return importlib.metadata.version("interlock")
    except importlib.metadata.PackageNotFoundError:
        return "dev"


def argument_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse type from a parser raising ValueError, keeping the ValueError's message."""

    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return convert


def print_json(data: object) -> None:
    print(msgspec.json.format(msgspec.json.encode(data), indent=2).decode())


def bad_input(args: argparse.Namespace, message: str) -> int:
    """Report bad input found after parsing as argparse reports its own (one line, exit code 2)."""
    print(f"{args.prog}: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def warner(args: argparse.Namespace) -> Callable[[str], None]:
    """Reports something the command skips (a torn line, an unknown config key) on stderr; the
    command carries on."""
    return lambda message: print(f"{args.prog}: warning: {message}", file=sys.stderr)


LOGS_HELP = "event log segments in order, or a log's name for all its segments"


THROUGH_HELP = "(RFC 3339 or UNIX seconds; a whole second includes the events within it)"


def add_log_arguments(parser: argparse.ArgumentParser, *, moment: bool, optional: bool = False) -> None:
    parser.add_argument("logs", nargs="*" if optional else "+", metavar="LOG", help=LOGS_HELP)
    if moment:
        when = parser.add_mutually_exclusive_group()
        when.add_argument("--until-seq", type=int, metavar="N", help="stop after the event numbered N")
        when.add_argument(
            "--at", type=argument_type(parse_time_through), metavar="TIME", help=f"the moment {THROUGH_HELP}"
        )
        parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def add_skip_invalid(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--skip-invalid",
        action="store_true",
        help="skip lines of a damaged log (event or decision log) that are not valid records (each one "
        "reported) instead of stopping",
    )


def add_span(parser: argparse.ArgumentParser) -> None:
    """--since and --until, for the commands that take a span of the log."""
    parser.add_argument(
        "--since", type=argument_type(parse_time), metavar="T", help="only from this time on (RFC 3339, UNIX seconds)"
    )
    parser.add_argument(
        "--until", type=argument_type(parse_time_through), metavar="T", help=f"only up to this time {THROUGH_HELP}"
    )


def add_decision_logs(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    parser.add_argument(
        "--decisions",
        required=required,
        nargs="+",
        metavar="FILE",
        help="the run's decision logs (gateway.decision_log; names or segments, of any workers and replicas)",
    )


def add_partition(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--partition",
        default="",
        metavar="NAME",
        help="the logs are the events of this partition of a fleet replica (a fleet export's "
        "DIR/partitions/NAME/events.jsonl): the records routed in it are the ones read against them",
    )


def replay_logs(args: argparse.Namespace, **limits: float | int | None) -> ReplayResult:
    """`replay` of the command's logs: warnings on stderr; with --skip-invalid, each invalid line
    is reported as it is skipped, and their count at the end."""
    warn = warner(args)
    skipped: list[str] = []

    def skip(message: str) -> None:
        skipped.append(message)
        warn(message)

    result = replay(args.logs, warn=warn, skip_invalid=skip if args.skip_invalid else None, **limits)
    if skipped:
        count = f"{len(skipped)} invalid line{'' if len(skipped) == 1 else 's'}"
        warn(f"skipped {count}: from the first one on, the state may differ from the live gateway's")
    return result


def complete_decisions(args: argparse.Namespace, warn: Callable[[str], None]) -> list[Decision]:
    """The records of the command's decision logs, with a warning naming the policy inputs the
    records whose pick they need lack."""
    records = []
    lacking_inputs = MissingInputs()
    for decision, absent in read_decisions_with_gaps(args.decisions, warn, warn if args.skip_invalid else None):
        records.append(decision)
        if lacking := missing_inputs(decision, absent):
            lacking_inputs.add(decision, lacking)
    if lacking_inputs.records:
        warn(lacking_inputs.warning(len(records)))
    return records

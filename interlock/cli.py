"""The `interlock` command line.

    interlock demo [--config PATH] [--once] [--dir PATH] [--log-to-stderr] [--port N] [--metrics-port N]
    interlock serve [--config PATH] [--listen HOST:PORT | --host HOST] [--port PORT]
                    [--metrics-listen HOST:PORT] [--log-level LEVEL] [--log-format json|text] [--workers N]
                    [--fleet URL[,URL…]] [--require-event-log]
    interlock check-config PATH [--strict] [--against LOG… [--decisions FILE…] [--since T]]
    interlock replay LOG… [--until-seq N | --at TIME] [--json] [--skip-invalid]
    interlock explain LOG… --model M [--until-seq N | --at TIME] [--json] [--skip-invalid]
    interlock explain [LOG…] --request-id ID --decisions FILE [--json] [--skip-invalid]
    interlock audit LOG… [--node IP|NAME] [--since T] [--until T] [--kind KIND[,KIND]] [--log-format json|text]
                    [--skip-invalid]
    interlock timeline LOG… [--since T] [--until T] [--decisions FILE] -o FILE
    interlock whatif LOG… --decisions FILE… [--policy P] [--since T] [--until T] [--cache-entries N] [--json]
                    [--progress SECONDS]
    interlock whatif LOG… --health KEY=VALUE[,…] [--decisions FILE…] [--since T] [--until T] [--json]
    interlock whatif --tenants FILE --decisions FILE… [--since T] [--until T] [--json]
    interlock verify LOG… --decisions FILE… [--since T] [--until T] [--show N] [--json]
    interlock fleet export DIR --fleet URL[,URL…] [--name N]

A subcommand is a module of `interlock/commands/` with an `add_<name>(commands)` function that
declares its arguments and sets `run` (a function of the parsed arguments returning the exit
code), listed in SUBCOMMANDS; what the subcommands share is in `interlock/commands/common.py`.
Exit codes: 0 ok, 1 `serve` cannot start or `verify` found a decision made otherwise, 2 bad input
(arguments, config, log, a request id not in the decision log), 3 `explain` found no node to
route to. Errors are one line on stderr naming the culprit, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from interlock.commands.audit import add_audit
from interlock.commands.check_config import add_check_config
from interlock.commands.common import EXIT_BAD_INPUT, EXIT_OK, package_version
from interlock.commands.demo import add_demo
from interlock.commands.explain import add_explain
from interlock.commands.fleet import add_fleet
from interlock.commands.replay import add_replay
from interlock.commands.serve import add_serve
from interlock.commands.timeline import add_timeline
from interlock.commands.verify import add_verify
from interlock.commands.whatif import add_whatif
from journal.segments import LogFileError


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors as one line (`interlock replay: error: …`) and exit code 2."""

    def error(self, message: str) -> None:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


SUBCOMMANDS = [
    add_demo, add_serve, add_check_config, add_replay, add_explain, add_audit, add_timeline, add_whatif, add_verify,
    add_fleet,
]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="interlock", description="An event-sourced gateway for LLM inference clusters.")
    parser.add_argument("--version", action="version", version=f"interlock {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_subcommand in SUBCOMMANDS:
        add_subcommand(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):
        parser.print_help()  # a bare `interlock`: what it can do
        return EXIT_OK
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit:  # --help, --version, or a usage error already reported
        return exit.code
    args.prog = f"interlock {args.command}"
    try:
        return args.run(args)
    except BrokenPipeError:
        # The reader went away (`interlock audit … | head`): stop quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except (LogFileError, OSError) as err:
        print(f"{args.prog}: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())

"""The `interlock` command line.

    interlock demo [--config PATH] [--once] [--quiet]
    interlock serve [--config PATH]
    interlock check-config PATH [--strict]
    interlock replay LOG… [--until-seq N | --at TIME] [--json]
    interlock explain LOG… --model M [--until-seq N | --at TIME] [--json]
    interlock explain [LOG…] --request-id ID --decisions FILE [--json]
    interlock audit LOG… [--node IP] [--since T] [--until T] [--kind KIND[,KIND]]
    interlock timeline LOG… [--since T] [--until T] [--decisions FILE] -o FILE

A subcommand is an `add_<name>(commands)` function that declares its arguments and sets `run`
(a function of the parsed arguments returning the exit code), listed in SUBCOMMANDS. Exit codes:
0 ok, 2 bad input (arguments, config, log, a request id not in the decision log), 3 `explain`
found no node to route to. Errors are one line on stderr naming the culprit, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from collections.abc import Callable

import msgspec

from controlplane.config import ConfigError, UnknownKey, describe_config, load_config
from controlplane.logs import format_timestamp
from controlplane.replay import audit, explain, replay
from dataplane.decisions import find_decisions
from events.jsonl import LogFileError
from interlock.explain_request import render_causes, render_request, request_to_builtins
from interlock.render import (
    explanation_to_builtins,
    parse_kinds,
    parse_time,
    render_explanation,
    render_state,
    state_to_builtins,
)
from interlock.timeline import TimelineError, build_timeline, render_html

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_NO_NODE = 3


def package_version() -> str:
    try:
        return importlib.metadata.version("interlock")
    except importlib.metadata.PackageNotFoundError:
        return "dev"


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors as one line (`interlock replay: error: …`) and exit code 2."""

    def error(self, message: str) -> None:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def _argument_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse type from a parser raising ValueError, keeping the ValueError's message."""

    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return convert


def _print_json(data: object) -> None:
    print(msgspec.json.format(msgspec.json.encode(data), indent=2).decode())


def _error(args: argparse.Namespace, message: str) -> int:
    """Report bad input found after parsing as argparse reports its own (one line, exit code 2)."""
    print(f"{args.prog}: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _warner(args: argparse.Namespace) -> Callable[[str], None]:
    """Reports something the command skips (a torn line, an unknown config key) on stderr; the
    command carries on."""
    return lambda message: print(f"{args.prog}: warning: {message}", file=sys.stderr)


# --- check-config ----------------------------------------------------------------------------


def add_check_config(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "check-config",
        help="validate a config file and summarize it",
        description="Validate a config file and summarize it. Keys the gateway does not know are ignored, "
        "as plinth does, with a warning naming the closest known key.",
    )
    parser.add_argument("path", metavar="PATH", help="the gateway's TOML config file")
    parser.add_argument("--strict", action="store_true", help="unknown keys are errors (exit code 2)")
    parser.set_defaults(run=run_check_config)


def run_check_config(args: argparse.Namespace) -> int:
    unknown_keys: list[UnknownKey] = []
    warn = _warner(args)

    def report(unknown: UnknownKey) -> None:
        unknown_keys.append(unknown)
        if args.strict:
            print(unknown, file=sys.stderr)
        else:
            warn(str(unknown))

    try:
        config = load_config(args.path, warn=report)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.strict and unknown_keys:
        return EXIT_BAD_INPUT
    print("ok")
    print(describe_config(config))
    return EXIT_OK


# --- replay, explain, audit ------------------------------------------------------------------


_LOGS_HELP = "event log segments in order, or a log's name for all its segments"


def _add_log_arguments(parser: argparse.ArgumentParser, *, moment: bool, optional: bool = False) -> None:
    parser.add_argument("logs", nargs="*" if optional else "+", metavar="LOG", help=_LOGS_HELP)
    if moment:
        when = parser.add_mutually_exclusive_group()
        when.add_argument("--until-seq", type=int, metavar="N", help="stop after the event numbered N")
        when.add_argument(
            "--at", type=_argument_type(parse_time), metavar="TIME", help="the moment (RFC 3339 or UNIX seconds)"
        )
        parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def add_replay(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("replay", help="rebuild the cluster state recorded in an event log")
    _add_log_arguments(parser, moment=True)
    parser.set_defaults(run=run_replay)


def run_replay(args: argparse.Namespace) -> int:
    result = replay(args.logs, until_seq=args.until_seq, until_at=args.at, warn=_warner(args))
    now = result.moment(args.at)
    if args.json:
        _print_json(state_to_builtins(result, now))
    else:
        print(render_state(result, now))
    return EXIT_OK


def add_explain(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "explain",
        help="show where a request for a model would have gone, or where a recorded request went, and why",
    )
    _add_log_arguments(parser, moment=True, optional=True)
    parser.add_argument("--model", metavar="M", help="the requested model, exactly as sent (unless --request-id)")
    parser.add_argument("--request-id", metavar="ID", help="explain this recorded request instead")
    parser.add_argument("--decisions", metavar="FILE", help="the decision log (gateway.decision_log) to find it in")
    parser.set_defaults(run=run_explain)


def run_explain(args: argparse.Namespace) -> int:
    if args.request_id is not None:
        return _explain_request(args)
    if args.decisions is not None:
        return _error(args, "argument --decisions: only allowed with --request-id")
    if args.model is None:
        return _error(args, "the following arguments are required: --model")
    if not args.logs:
        return _error(args, "the following arguments are required: LOG")
    result = replay(args.logs, until_seq=args.until_seq, until_at=args.at, warn=_warner(args))
    explanation = explain(result, args.model, args.at)
    if args.json:
        _print_json(explanation_to_builtins(explanation))
    else:
        print(render_explanation(explanation))
    return EXIT_NO_NODE if explanation.refusal else EXIT_OK


def _explain_request(args: argparse.Namespace) -> int:
    """One recorded request; with event logs, the events behind its exclusions too."""
    if args.decisions is None:
        return _error(args, "the following arguments are required: --decisions (with --request-id)")
    for given, name in ((args.model, "--model"), (args.until_seq, "--until-seq"), (args.at, "--at")):
        if given is not None:
            return _error(args, f"argument {name}: not allowed with --request-id (the record has its model and seq)")
    records = find_decisions(args.decisions, args.request_id, warn=_warner(args))
    if not records:
        return _error(args, f"no request with id {args.request_id!r} in the decision log {args.decisions}")
    *earlier, decision = records
    # The control plane as the request saw it: the log replayed up to the snapshot it was routed on.
    result = replay(args.logs, until_seq=decision.seq, warn=_warner(args)) if args.logs else None
    if args.json:
        _print_json(request_to_builtins(decision, result))
    elif result is None:
        print(render_request(decision, earlier))
    else:
        print(render_request(decision, earlier) + "\n\n" + render_causes(decision, result))
    return EXIT_OK


def add_audit(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("audit", help="print the transition log lines the live gateway printed")
    _add_log_arguments(parser, moment=False)
    parser.add_argument("--node", metavar="IP", help="only transitions of this node")
    parser.add_argument("--since", type=_argument_type(parse_time), metavar="T", help="only from this time on")
    parser.add_argument("--until", type=_argument_type(parse_time), metavar="T", help="only up to this time")
    parser.add_argument(
        "--kind",
        dest="kinds",
        action="extend",
        type=_argument_type(parse_kinds),
        metavar="KIND[,KIND]",
        help="only these kinds: run, reload, health, models, offline",
    )
    parser.set_defaults(run=run_audit)


def run_audit(args: argparse.Namespace) -> int:
    result = replay(args.logs, warn=_warner(args))
    lines = audit(result.transitions, node=args.node, since=args.since, until=args.until, kinds=args.kinds)
    sys.stdout.write("".join(transition.log_line() + "\n" for transition in lines))
    return EXIT_OK


# --- timeline --------------------------------------------------------------------------------


def add_timeline(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "timeline", help="draw a recorded run as one self-contained HTML page: a lane per node, every transition"
    )
    _add_log_arguments(parser, moment=False)
    time = _argument_type(parse_time)
    parser.add_argument("--since", type=time, metavar="T", help="start here (default: the log's first event)")
    parser.add_argument("--until", type=time, metavar="T", help="end here (default: the log's last event)")
    parser.add_argument(
        "--decisions", metavar="FILE", help="the decision log (gateway.decision_log): request and 5xx rates on top"
    )
    parser.add_argument("-o", "--output", required=True, metavar="FILE", help="the HTML file to write")
    parser.set_defaults(run=run_timeline)


def run_timeline(args: argparse.Namespace) -> int:
    if args.since is not None and args.until is not None and args.since >= args.until:
        return _error(args, "argument --since: must be before --until")
    try:
        timeline = build_timeline(
            args.logs, since=args.since, until=args.until, decisions=args.decisions, warn=_warner(args)
        )
    except TimelineError as err:
        return _error(args, str(err))
    with open(args.output, "w", encoding="utf-8") as page:
        page.write(render_html(timeline))
    window = f"from {format_timestamp(timeline.start)} to {format_timestamp(timeline.end)}"
    print(f"wrote {args.output}: {len(timeline.lanes)} nodes {window}")
    return EXIT_OK


# --- serve -----------------------------------------------------------------------------------


SERVE_SIGNALS_HELP = """\
signals:
  SIGHUP            reload the config file (listen addresses and the log
                    settings need a restart); an invalid file is rejected and
                    the running config stays in force
  SIGTERM, SIGINT   graceful shutdown: stop accepting connections, let requests
                    and streams in flight finish (for up to 10 s), write the
                    decision and event logs, log `gateway stopped`, exit 0
  a second one      forced shutdown: connections still open are closed at once
                    (worker processes are killed), the logs are still written,
                    exit 0; any more are ignored

exit codes: 0 after a shutdown by signal, 1 if the gateway cannot start (an
invalid config file, an address it cannot listen on, an event or decision log
another gateway holds)"""
"""What `interlock serve --help` says about signals and exit codes (interlock.serve does it;
the 10 s are its SHUTDOWN_GRACE_SECONDS)."""


def add_serve(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "serve",
        help="run the gateway (exit code 1 if it cannot start)",
        description="Run the gateway: probe the nodes, serve the API and the metrics.",
        epilog=SERVE_SIGNALS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config", default="config/gateway.toml", metavar="PATH", help="the gateway's TOML config file"
    )
    parser.add_argument(
        "--workers",
        type=_argument_type(parse_workers),
        metavar="N|auto",
        help="processes serving the API (overrides gateway.workers; auto: one per usable core)",
    )
    parser.set_defaults(run=run_serve)


def parse_workers(text: str) -> int | str:
    if text == "auto":
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"invalid worker count {text!r}: a whole number from 1, or auto")


def run_serve(args: argparse.Namespace) -> int:
    from interlock.serve import run_serve as serve_gateway  # the server stack, imported only to serve

    return serve_gateway(args.config, package_version(), workers=args.workers)


# --- demo ------------------------------------------------------------------------------------


def add_demo(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("demo", help="simulated nodes and the gateway, with one request through it")
    parser.add_argument("--config", default=None, metavar="PATH", help="the demo's TOML config (default: config/demo.toml)")
    parser.add_argument("--once", action="store_true", help="stop after the first request instead of serving on")
    parser.add_argument("--quiet", action="store_true", help="do not print the gateway's JSON log (on stderr)")
    parser.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from interlock.demo import DEMO_CONFIG  # the server stack, imported only to serve
    from interlock.demo import run_demo as demo

    return demo(args.config or str(DEMO_CONFIG), package_version(), once=args.once, quiet=args.quiet)


# --- the program -----------------------------------------------------------------------------

SUBCOMMANDS = [add_demo, add_serve, add_check_config, add_replay, add_explain, add_audit, add_timeline]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="interlock", description="An event-sourced gateway for LLM inference clusters.")
    parser.add_argument("--version", action="version", version=f"interlock {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_subcommand in SUBCOMMANDS:
        add_subcommand(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
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

"""The `interlock` command line.

    interlock demo [--config PATH] [--once] [--dir PATH] [--log-to-stderr]
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

A subcommand is an `add_<name>(commands)` function that declares its arguments and sets `run`
(a function of the parsed arguments returning the exit code), listed in SUBCOMMANDS. Exit codes:
0 ok, 1 `serve` cannot start or `verify` found a decision made otherwise, 2 bad input (arguments, config,
log, a request id not in the decision log), 3 `explain` found no node to route to. Errors are one
line on stderr naming the culprit, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import msgspec

from controlplane.infrastructure.config import ConfigError, Overrides, UnknownKey, load_config, load_tenants
from controlplane.infrastructure.gocompat import parse_go_duration, parse_listen_address
from controlplane.rules.log_lines import format_timestamp
from controlplane.rules.reducer import RESTART_KEYS
from controlplane.effects.replay import ReplayResult, audit, explain, node_ips, replay
from events.config import (
    DEFAULT_FLEET_NAME,
    DEFAULT_LISTEN,
    DEFAULT_METRICS_LISTEN,
    DEFAULT_SHUTDOWN_GRACE,
    LOG_FORMATS,
    LOG_LEVELS,
    Config,
    FleetConfig,
)
from events.decisions import Decision, find_decisions, missing_inputs, read_decisions_with_gaps
from interlock.describe import describe_config
from interlock.explain_request import render_causes, render_request, render_saturation, request_to_builtins
from interlock.reconfigured import (
    HEALTH_KEYS,
    NOT_RECORDED_NOTE,
    HealthOverrideError,
    config_dry_run,
    health_what_if,
    parse_health_overrides,
    render_reconfigured,
)
from interlock.render import (
    KINDS,
    explanation_to_builtins,
    parse_kinds,
    parse_time,
    parse_time_through,
    render_explanation,
    render_state,
    state_to_builtins,
)
from interlock.timeline import TimelineError, build_timeline, render_html
from interlock.verify import DEFAULT_SHOWN, MissingInputs, incomplete_warning, verify
from interlock.verify import render_report as render_verify_report
from interlock.admission_whatif import render_tenants_what_if, tenants_what_if
from interlock.whatif import (
    DEFAULT_CACHE_ENTRIES,
    PROGRESS_SECONDS,
    RECORDED,
    WHAT_IF_POLICIES,
    in_span,
    render_report,
    what_if,
)
from journal.segments import LogFileError
from journal.writer import unwritable_log_reason

EXIT_OK = 0
EXIT_FAILURE = 1
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
    parser.add_argument(
        "--against",
        nargs="+",
        metavar="LOG",
        help="dry-run reload: replay this event log with the config reloaded at its start (or --since) "
        "and compare the nodes' health and, with --decisions, where the recorded requests would go",
    )
    _add_decision_logs(parser, required=False)
    parser.add_argument(
        "--since", type=_argument_type(parse_time), metavar="TIME", help="with --against: the moment of the reload"
    )
    _add_skip_invalid(parser)
    parser.set_defaults(run=run_check_config)


def run_check_config(args: argparse.Namespace) -> int:
    if not args.against and (args.decisions or args.since is not None):
        return _error(args, "arguments --decisions and --since: only with --against")
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
    unwritable = [problem for key in LOG_KEYS if (problem := unwritable_log(config, key))]
    for problem in unwritable:
        print(f"{args.path}: {problem}", file=sys.stderr)
    if unwritable:
        return EXIT_BAD_INPUT
    print("ok")
    print(describe_config(config))
    if args.against:
        report = config_dry_run(
            args.against, config, args.path, _complete_decisions(args, warn) if args.decisions else None,
            since=args.since, warn=warn, skip_invalid=warn if args.skip_invalid else None,
        )  # fmt: skip
        print()
        print(render_reconfigured(report))
    return EXIT_OK


LOG_KEYS = ("event_log", "decision_log")


def unwritable_log(config: Config, key: str) -> str | None:
    """`gateway.event_log = PATH: why` when the log at `key` is set and the gateway could not
    write it, so `check-config` and `serve --require-event-log` catch it before a run without
    its records."""
    path = getattr(config.gateway, key)
    reason = unwritable_log_reason(path) if path else None
    return f"gateway.{key} = {path}: {reason}" if reason else None


# --- replay, explain, audit ------------------------------------------------------------------


_LOGS_HELP = "event log segments in order, or a log's name for all its segments"


_THROUGH_HELP = "(RFC 3339 or UNIX seconds; a whole second includes the events within it)"


def _add_log_arguments(parser: argparse.ArgumentParser, *, moment: bool, optional: bool = False) -> None:
    parser.add_argument("logs", nargs="*" if optional else "+", metavar="LOG", help=_LOGS_HELP)
    if moment:
        when = parser.add_mutually_exclusive_group()
        when.add_argument("--until-seq", type=int, metavar="N", help="stop after the event numbered N")
        when.add_argument(
            "--at", type=_argument_type(parse_time_through), metavar="TIME", help=f"the moment {_THROUGH_HELP}"
        )
        parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _add_skip_invalid(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--skip-invalid",
        action="store_true",
        help="skip lines of a damaged log that are not valid events (each one reported) instead of stopping",
    )


def _replay(args: argparse.Namespace, **limits: float | int | None) -> ReplayResult:
    """`replay` of the command's logs: warnings on stderr; with --skip-invalid, each invalid line
    is reported as it is skipped, and their count at the end."""
    warn = _warner(args)
    skipped: list[str] = []

    def skip(message: str) -> None:
        skipped.append(message)
        warn(message)

    result = replay(args.logs, warn=warn, skip_invalid=skip if args.skip_invalid else None, **limits)
    if skipped:
        count = f"{len(skipped)} invalid line{'' if len(skipped) == 1 else 's'}"
        warn(f"skipped {count}: from the first one on, the state may differ from the live gateway's")
    return result


def add_replay(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("replay", help="rebuild the cluster state recorded in an event log")
    _add_log_arguments(parser, moment=True)
    _add_skip_invalid(parser)
    parser.set_defaults(run=run_replay)


def run_replay(args: argparse.Namespace) -> int:
    result = _replay(args, until_seq=args.until_seq, until_at=args.at)
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
    _add_skip_invalid(parser)
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
    result = _replay(args, until_seq=args.until_seq, until_at=args.at)
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
    result = _replay(args, until_seq=decision.seq) if args.logs else None
    if args.json:
        _print_json(request_to_builtins(decision, result))
    elif result is None:
        print(render_request(decision, earlier))
    else:
        text = render_request(decision, earlier) + "\n\n" + render_causes(decision, result)
        if decision.admission is not None and decision.admission.saturated_seq:
            # The pool as admission saw it when the request arrived: the log up to that seq.
            saturated = _replay(args, until_seq=decision.admission.saturated_seq)
            text += "\n\n" + render_saturation(decision, saturated)
        print(text)
    return EXIT_OK


def _add_span(parser: argparse.ArgumentParser) -> None:
    """--since and --until, for the commands that take a span of the log."""
    parser.add_argument(
        "--since", type=_argument_type(parse_time), metavar="T", help="only from this time on (RFC 3339, UNIX seconds)"
    )
    parser.add_argument(
        "--until", type=_argument_type(parse_time_through), metavar="T", help=f"only up to this time {_THROUGH_HELP}"
    )


def add_audit(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("audit", help="print the transition log lines the live gateway printed")
    _add_log_arguments(parser, moment=False)
    parser.add_argument("--node", metavar="IP|NAME", help="only transitions of this node (its IP, or its name)")
    _add_span(parser)
    parser.add_argument(
        "--kind",
        dest="kinds",
        action="extend",
        type=_argument_type(parse_kinds),
        metavar="KIND[,KIND]",
        help=f"only these kinds: {KINDS}",
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=LOG_FORMATS[0],
        help="json: plinth's JSON lines; text: the live --log-format text lines (default: json)",
    )
    _add_skip_invalid(parser)
    parser.set_defaults(run=run_audit)


def run_audit(args: argparse.Namespace) -> int:
    result = _replay(args)
    nodes = None
    if args.node is not None:
        nodes = node_ips(result, args.node)
        if not nodes:
            known = ", ".join(sorted(f"{ip} ({name})" if name else ip for ip, name in result.configured_nodes))
            return _error(args, f"argument --node: no node {args.node!r} in the log (its nodes: {known or 'none'})")
    lines = audit(result.transitions, nodes=nodes, since=args.since, until=args.until, kinds=args.kinds)
    sys.stdout.write("".join(transition.log_line(args.log_format) + "\n" for transition in lines))
    if not lines:
        print(f"{args.prog}: no transition of the log's {len(result.transitions)} matches", file=sys.stderr)
    return EXIT_OK


# --- whatif ----------------------------------------------------------------------------------


def add_whatif(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "whatif", help="route a recorded run's requests again under another policy, offline, and compare"
    )
    _add_log_arguments(parser, moment=False, optional=True)
    _add_decision_logs(parser, required=False)
    parser.add_argument(
        "--health",
        metavar="KEY=VALUE[,KEY=VALUE…]",
        help="replay the run's probe results under other health rules instead (keys: "
        + ", ".join(HEALTH_KEYS)
        + "; probe times are the recorded ones) and compare the nodes' health intervals and ejections",
    )
    parser.add_argument(
        "--tenants",
        metavar="FILE",
        help="admit the recorded requests again under the [[tenants]] limits of FILE (open-loop: requests "
        "arrive as recorded) and report who would have been limited; reads only the decision logs",
    )
    parser.add_argument(
        "--policy",
        default=RECORDED,
        choices=WHAT_IF_POLICIES,
        help="the policy to route by (default: recorded, each request's own, with its recorded inputs)",
    )
    _add_span(parser)
    parser.add_argument(
        "--cache-entries",
        type=int,
        default=DEFAULT_CACHE_ENTRIES,
        metavar="N",
        help=f"prompt prefixes a node remembers, for the prefix-seen share (default: {DEFAULT_CACHE_ENTRIES})",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--progress",
        type=float,
        metavar="SECONDS",
        help="once it has run this long, say how far it has come on stderr, and again every SECONDS, "
        f"whatever stderr is (default: every {PROGRESS_SECONDS:g} s when stderr is a terminal, else never; "
        "0: at every request and event)",
    )
    _add_skip_invalid(parser)
    parser.set_defaults(run=run_whatif)


def run_whatif(args: argparse.Namespace) -> int:
    if args.cache_entries < 1:
        return _error(args, "argument --cache-entries: must be at least 1")
    if args.progress is not None and not args.progress >= 0:
        return _error(args, "argument --progress: must be 0 or more seconds")
    if args.since is not None and args.until is not None and args.since > args.until:
        return _error(args, "argument --since: must not be after --until")
    warn = _warner(args)
    if args.tenants is not None:
        return _tenants_what_if(args, warn)
    if not args.logs:
        return _error(args, "the following arguments are required: LOG (or --tenants)")
    if args.health is not None:
        return _health_what_if(args, warn)
    if not args.decisions:
        return _error(args, "the following arguments are required: --decisions (or --health)")
    report = what_if(
        args.logs,
        _complete_decisions(args, warn),
        policy=args.policy,
        since=args.since,
        until=args.until,
        cache_entries=args.cache_entries,
        warn=warn,
        skip_invalid=warn if args.skip_invalid else None,
        **_progress(args),
    )
    if args.json:
        _print_json(msgspec.to_builtins(report))
    else:
        print(render_report(report))
    return EXIT_OK


def _tenants_what_if(args: argparse.Namespace, warn: Callable[[str], None]) -> int:
    if not args.decisions:
        return _error(args, "argument --tenants: --decisions is required")
    if args.health is not None or args.policy != RECORDED:
        return _error(args, "argument --tenants: not with --health or --policy")
    try:
        tenants = load_tenants(args.tenants)
    except ConfigError as error:
        return _error(args, f"argument --tenants: {error}")
    decisions = in_span(
        (decision for decision, _ in read_decisions_with_gaps(args.decisions, warn)), args.since, args.until
    )
    report = tenants_what_if(decisions, tenants)
    if args.json:
        _print_json(msgspec.to_builtins(report))
    else:
        print(render_tenants_what_if(report))
    return EXIT_OK


def _progress(args: argparse.Namespace) -> dict:
    """`what_if`'s progress arguments: said on stderr every `--progress` seconds; without it,
    every PROGRESS_SECONDS on a terminal only (a log file or a pipe gets no progress lines)."""
    every = args.progress
    if every is None:
        if not sys.stderr.isatty():
            return {}
        every = PROGRESS_SECONDS
    return {"progress": lambda message: print(f"{args.prog}: {message}", file=sys.stderr), "progress_every": every}


def _health_what_if(args: argparse.Namespace, warn: Callable[[str], None]) -> int:
    try:
        overrides = parse_health_overrides(args.health)
    except HealthOverrideError as err:
        return _error(args, f"argument --health: {err}")
    if args.policy != RECORDED:
        return _error(args, "argument --policy: not with --health (requests keep the policy their config names)")
    report = health_what_if(
        args.logs, overrides, _complete_decisions(args, warn) if args.decisions else None,
        since=args.since, until=args.until, warn=warn, skip_invalid=warn if args.skip_invalid else None,
    )  # fmt: skip
    if args.json:
        _print_json({**msgspec.to_builtins(report), "note": NOT_RECORDED_NOTE})
    else:
        print(render_reconfigured(report))
    return EXIT_OK


def _add_decision_logs(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    parser.add_argument(
        "--decisions",
        required=required,
        nargs="+",
        metavar="FILE",
        help="the run's decision logs (gateway.decision_log; names or segments, of any workers and replicas)",
    )


def _complete_decisions(args: argparse.Namespace, warn: Callable[[str], None]) -> list[Decision]:
    """The records of the command's decision logs, with a warning naming the policy inputs the
    records whose pick they need lack."""
    records = []
    lacking_inputs = MissingInputs()
    for decision, absent in read_decisions_with_gaps(args.decisions, warn):
        records.append(decision)
        if lacking := missing_inputs(decision, absent):
            lacking_inputs.add(decision, lacking)
    if lacking_inputs.records:
        warn(lacking_inputs.warning(len(records)))
    return records


# --- verify ----------------------------------------------------------------------------------


def add_verify(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "verify",
        help="make every recorded decision again with this code, on the state it was made on, and compare "
        "(exit 1 at the first difference)",
    )
    _add_log_arguments(parser, moment=False)
    _add_decision_logs(parser)
    _add_span(parser)
    parser.add_argument(
        "--show",
        type=int,
        default=DEFAULT_SHOWN,
        metavar="N",
        help=f"differences (and records not verified) named; the rest are counted (default: {DEFAULT_SHOWN})",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    _add_skip_invalid(parser)
    parser.set_defaults(run=run_verify)


def run_verify(args: argparse.Namespace) -> int:
    if args.show < 1:
        return _error(args, "argument --show: must be at least 1")
    warn = _warner(args)
    report = verify(
        args.logs,
        read_decisions_with_gaps(args.decisions, warn),
        since=args.since,
        until=args.until,
        shown=args.show,
        warn=warn,
        skip_invalid=warn if args.skip_invalid else None,
    )
    if report.incomplete:
        warn(incomplete_warning(report.incomplete, report.decisions, report.missing, report.incomplete_ids))
    if args.json:
        _print_json({**msgspec.to_builtins(report), "passed": report.passed})
    else:
        print(render_verify_report(report))
    return EXIT_OK if report.passed else EXIT_FAILURE


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


def _restart_keys_help() -> str:
    """The settings a SIGHUP does not apply, wrapped to sit under SIGHUP in `serve --help`."""
    keys = textwrap.wrap(", ".join(RESTART_KEYS) + ".", width=58)
    return "\n".join(" " * 20 + line for line in keys)


SERVE_SIGNALS_HELP = f"""\
signals:
  SIGHUP            reload the config file; an invalid file is rejected and
                    the running config stays in force. Everything applies
                    (nodes, models, routing, keys, log_level, log_format)
                    but these gateway settings, which need a restart:
{_restart_keys_help()}
  SIGTERM, SIGINT   graceful shutdown: stop accepting connections, let requests
                    and streams in flight finish (for up to --shutdown-grace;
                    a stream still open then ends with an error event), write
                    the decision and event logs, log `gateway stopped`, exit 0
  a second one      forced shutdown: connections still open are closed at once
                    (worker processes are killed), the logs are still written,
                    exit 0; any more are ignored

exit codes: 0 after a shutdown by signal, 1 if the gateway cannot start (an
invalid config file, an address it cannot listen on, an event or decision log
another gateway holds, no writable event log with --require-event-log), 2 for
invalid options"""
"""What `interlock serve --help` says about signals and exit codes (interlock.serve does it)."""


CONFIG_ENV = "INTERLOCK_CONFIG"
DEFAULT_CONFIG = "config/gateway.toml"


def add_serve(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "serve",
        help="run the gateway (exit code 1 if it cannot start)",
        description="Run the gateway: probe the nodes, serve the API and the metrics.\n"
        "Each option but --config overrides a setting of the config file, at start and at every\n"
        "reload; without it, the file's setting holds (its default in parentheses).",
        epilog=SERVE_SIGNALS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        default=os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG,
        metavar="PATH",
        help=f"the gateway's TOML config file (default: ${CONFIG_ENV} if set, else {DEFAULT_CONFIG})",
    )
    address = _argument_type(_listen_address)
    api = parser.add_mutually_exclusive_group()
    api.add_argument(
        "--listen",
        type=address,
        metavar="HOST:PORT",
        help=f"the API's address; :PORT is all interfaces, [::1]:PORT IPv6 (gateway.listen: {DEFAULT_LISTEN})",
    )
    api.add_argument("--host", metavar="HOST", help="as vLLM's --host: the API's host, with gateway.listen's port")
    parser.add_argument(
        "--port",
        type=_argument_type(_port),
        metavar="PORT",
        help="as vLLM's --port: the API's port, with gateway.listen's host (or --host)",
    )
    parser.add_argument(
        "--metrics-listen",
        type=address,
        metavar="HOST:PORT",
        help=f"the Prometheus metrics' address (gateway.metrics_listen: {DEFAULT_METRICS_LISTEN})",
    )
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        help=f"the least severe lines logged (gateway.log_level: {LOG_LEVELS[0]})",
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        help=f"json: plinth's JSON lines; text: for a terminal (gateway.log_format: {LOG_FORMATS[0]})",
    )
    parser.add_argument(
        "--shutdown-grace",
        type=_argument_type(_seconds),
        metavar="DURATION",
        help="how long SIGTERM's drain lets streams finish, as 90s or 2m "
        f"(gateway.shutdown_grace: {DEFAULT_SHUTDOWN_GRACE:g}s)",
    )
    parser.add_argument(
        "--workers",
        type=_argument_type(parse_workers),
        metavar="N|auto",
        help="processes serving the API; auto: one per usable core (gateway.workers: 1)",
    )
    parser.add_argument(
        "--fleet",
        type=_argument_type(parse_nats_urls),
        metavar="URL[,URL…]",
        help="join a fleet through these NATS servers (fleet.nats; the rest of [fleet] from the file)",
    )
    parser.add_argument(
        "--require-event-log",
        action="store_true",
        help="refuse to start (exit code 1) unless gateway.event_log is set and its folder can be written, "
        "for teams that depend on replay, explain and audit",
    )
    parser.set_defaults(run=run_serve)


def _listen_address(text: str) -> str:
    parse_listen_address(text)
    return text


def _seconds(text: str) -> float:
    """A non-negative Go duration (`90s`, `2m`), in seconds."""
    seconds = parse_go_duration(text) / 1e9
    if seconds < 0:
        raise ValueError(f"invalid duration {text!r}: must be non-negative")
    return seconds


def _port(text: str) -> int:
    if text.isdigit() and 1 <= int(text) <= 65535:
        return int(text)
    raise ValueError(f"invalid port {text!r}: a number from 1 to 65535")


def parse_workers(text: str) -> int | str:
    if text == "auto":
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"invalid worker count {text!r}: a whole number from 1, or auto")


def parse_nats_urls(text: str) -> tuple[str, ...]:
    urls = tuple(url.strip() for url in text.split(","))
    if not all(urls):
        raise ValueError(f"invalid NATS server list {text!r}: comma-separated URLs (nats://host:4222)")
    return urls


def run_serve(args: argparse.Namespace) -> int:
    from interlock.serve import run_serve as serve_gateway  # the server stack, imported only to serve

    if args.listen is not None and args.port is not None:
        return _error(args, "argument --port: not allowed with argument --listen (its address has a port)")
    overrides = Overrides(
        listen=args.listen,
        metrics_listen=args.metrics_listen,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_format=args.log_format,
        shutdown_grace=args.shutdown_grace,
        fleet_nats=args.fleet,
    )
    if args.require_event_log and (missing := _missing_event_log(args.config, overrides)):
        print(f"fatal: --require-event-log: {missing}", file=sys.stderr)
        return EXIT_FAILURE
    return serve_gateway(args.config, package_version(), workers=args.workers, overrides=overrides)


def _missing_event_log(config_path: str, overrides: Overrides) -> str | None:
    """Why `serve` would run without an event log, else None. A config that does not load is
    `serve`'s to report."""
    try:
        config = load_config(config_path, overrides=overrides)
    except ConfigError:
        return None
    if not config.gateway.event_log:
        return f"{config_path} sets no gateway.event_log"
    unwritable = unwritable_log(config, "event_log")
    return f"{config_path}: {unwritable}" if unwritable else None


# --- demo ------------------------------------------------------------------------------------


def add_demo(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("demo", help="simulated nodes and the gateway, with one request through it")
    parser.add_argument("--config", default=None, metavar="PATH", help="the demo's TOML config (default: config/demo.toml)")
    parser.add_argument("--once", action="store_true", help="stop after the first request instead of serving on")
    parser.add_argument(
        "--dir",
        type=Path,
        metavar="PATH",
        help="where the gateway's log and the config's relative log paths go "
        "(default: $XDG_STATE_HOME/interlock/demo, else ~/.local/state/interlock/demo)",
    )
    parser.add_argument(
        "--log-to-stderr", action="store_true", help="the gateway's log lines on stderr instead of DIR/gateway.log"
    )
    parser.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    checkout = Path(__file__).resolve().parent.parent
    if not (checkout / "fixtures" / "node.py").is_file():
        print(
            "error: interlock demo runs from a source checkout (its simulated nodes, fixtures/, are not installed): "
            "run `make demo` there",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    if str(checkout) not in sys.path:
        sys.path.append(str(checkout))  # the simulated nodes, from the source tree
    from interlock.demo import DEMO_CONFIG, default_directory  # the server stack, imported only to serve
    from interlock.demo import run_demo as demo

    return demo(
        args.config or str(DEMO_CONFIG),
        package_version(),
        once=args.once,
        directory=args.dir or default_directory(),
        log_to_stderr=args.log_to_stderr,
    )


# --- the program -----------------------------------------------------------------------------

def add_fleet(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("fleet", help="the fleet's streams in NATS JetStream")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    export = actions.add_parser(
        "export", help="write the fleet's event and decision streams as logs (DIR/events.jsonl, DIR/decisions.jsonl)"
    )
    export.add_argument("dir", type=Path, metavar="DIR", help="where events.jsonl and decisions.jsonl go")
    export.add_argument(
        "--fleet", required=True, type=_argument_type(parse_nats_urls), metavar="URL[,URL…]", help="the NATS servers"
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
        return _error(args, str(error))
    except Exception as error:  # NATS unreachable, a stream missing: one line, no traceback
        return _error(args, f"cannot read the fleet {args.name!r} from {','.join(args.fleet)}: {error or repr(error)}")
    print(f"wrote {count} events to {path}")
    print(f"wrote {decisions} decision records to {decisions_path}")
    return 0


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

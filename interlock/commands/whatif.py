"""`interlock whatif`: a recorded run's requests routed again, offline, under another policy,
other health rules or other tenant limits."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import msgspec

from controlplane.infrastructure.config import ConfigError, load_tenants
from events.decisions import read_decisions_with_gaps
from interlock.admission_whatif import render_tenants_what_if, tenants_what_if
from interlock.commands.common import (
    EXIT_OK,
    add_decision_logs,
    add_log_arguments,
    add_skip_invalid,
    add_span,
    bad_input,
    complete_decisions,
    print_json,
    warner,
)
from interlock.reconfigured import (
    HEALTH_KEYS,
    NOT_RECORDED_NOTE,
    HealthOverrideError,
    health_what_if,
    parse_health_overrides,
    render_reconfigured,
)
from interlock.whatif import (
    DEFAULT_CACHE_ENTRIES,
    PROGRESS_SECONDS,
    RECORDED,
    WHAT_IF_POLICIES,
    in_span,
    render_report,
    what_if,
)


def add_whatif(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "whatif", help="route a recorded run's requests again under another policy, offline, and compare"
    )
    add_log_arguments(parser, moment=False, optional=True)
    add_decision_logs(parser, required=False)
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
    add_span(parser)
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
    add_skip_invalid(parser)
    parser.set_defaults(run=run_whatif)


def run_whatif(args: argparse.Namespace) -> int:
    if args.cache_entries < 1:
        return bad_input(args, "argument --cache-entries: must be at least 1")
    if args.progress is not None and not args.progress >= 0:
        return bad_input(args, "argument --progress: must be 0 or more seconds")
    if args.since is not None and args.until is not None and args.since > args.until:
        return bad_input(args, "argument --since: must not be after --until")
    warn = warner(args)
    if args.tenants is not None:
        return _tenants_what_if(args, warn)
    if not args.logs:
        return bad_input(args, "the following arguments are required: LOG (or --tenants)")
    if args.health is not None:
        return _health_what_if(args, warn)
    if not args.decisions:
        return bad_input(args, "the following arguments are required: --decisions (or --health)")
    report = what_if(
        args.logs,
        complete_decisions(args, warn),
        policy=args.policy,
        since=args.since,
        until=args.until,
        cache_entries=args.cache_entries,
        warn=warn,
        skip_invalid=warn if args.skip_invalid else None,
        **_progress(args),
    )
    if args.json:
        print_json(msgspec.to_builtins(report))
    else:
        print(render_report(report))
    return EXIT_OK


def _tenants_what_if(args: argparse.Namespace, warn: Callable[[str], None]) -> int:
    if not args.decisions:
        return bad_input(args, "argument --tenants: --decisions is required")
    if args.health is not None or args.policy != RECORDED:
        return bad_input(args, "argument --tenants: not with --health or --policy")
    try:
        tenants = load_tenants(args.tenants)
    except ConfigError as error:
        return bad_input(args, f"argument --tenants: {error}")
    decisions = in_span(
        (decision for decision, _ in read_decisions_with_gaps(args.decisions, warn)), args.since, args.until
    )
    report = tenants_what_if(decisions, tenants)
    if args.json:
        print_json(msgspec.to_builtins(report))
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
        return bad_input(args, f"argument --health: {err}")
    if args.policy != RECORDED:
        return bad_input(args, "argument --policy: not with --health (requests keep the policy their config names)")
    report = health_what_if(
        args.logs, overrides, complete_decisions(args, warn) if args.decisions else None,
        since=args.since, until=args.until, warn=warn, skip_invalid=warn if args.skip_invalid else None,
    )  # fmt: skip
    if args.json:
        print_json({**msgspec.to_builtins(report), "note": NOT_RECORDED_NOTE})
    else:
        print(render_reconfigured(report))
    return EXIT_OK

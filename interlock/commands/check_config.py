"""`interlock check-config`: validate a config file and summarize it; with --against, a dry-run reload."""

from __future__ import annotations

import argparse
import os
import sys

from controlplane.infrastructure.config import ConfigError, UnknownKey, load_config
from events.config import Config
from interlock.commands.common import (
    EXIT_BAD_INPUT,
    EXIT_OK,
    add_decision_logs,
    add_skip_invalid,
    argument_type,
    bad_input,
    complete_decisions,
    warner,
)
from interlock.describe import describe_config
from interlock.reconfigured import config_dry_run, render_reconfigured
from interlock.render import parse_time
from journal.writer import unwritable_log_reason


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
        help="dry-run reload: replay this event log (or a `fleet export` directory: its events.jsonl, and its "
        "decisions.jsonl unless --decisions) with the config reloaded at its start (or --since) "
        "and compare the nodes' health and, with --decisions, where the recorded requests would go",
    )
    add_decision_logs(parser, required=False)
    parser.add_argument(
        "--since", type=argument_type(parse_time), metavar="TIME", help="with --against: the moment of the reload"
    )
    add_skip_invalid(parser)
    parser.set_defaults(run=run_check_config)


def run_check_config(args: argparse.Namespace) -> int:
    if not args.against and (args.decisions or args.since is not None):
        return bad_input(args, "arguments --decisions and --since: only with --against")
    unknown_keys: list[UnknownKey] = []
    warn = warner(args)

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
        try:
            args.against, args.decisions = fleet_export_logs(args.against, args.decisions)
        except ValueError as error:
            print(error, file=sys.stderr)
            return EXIT_BAD_INPUT
        report = config_dry_run(
            args.against, config, args.path, complete_decisions(args, warn) if args.decisions else None,
            since=args.since, warn=warn, skip_invalid=warn if args.skip_invalid else None,
        )  # fmt: skip
        print()
        print(render_reconfigured(report))
    return EXIT_OK


LOG_KEYS = ("event_log", "decision_log")


def fleet_export_logs(against: list[str], decisions: list[str] | None) -> tuple[list[str], list[str] | None]:
    """The event logs and decision logs of `--against`, a `fleet export` directory read as its
    `events.jsonl` and, when no `--decisions` are given, its `decisions.jsonl`; ValueError naming
    a directory that is not an export. (A partition's events, in the export's `partitions/`, are
    numbered apart from the fleet's: `--against DIR/partitions/NAME/events.jsonl` reads them.)"""
    logs: list[str] = []
    exported: list[str] = []
    for path in against:
        if not os.path.isdir(path):
            logs.append(path)
            continue
        from fleet.export import EXPORTED_DECISIONS, EXPORTED_EVENTS  # NATS, imported only for an export

        events = os.path.join(path, EXPORTED_EVENTS)
        if not os.path.isfile(events):
            raise ValueError(f"{path}: a directory without {EXPORTED_EVENTS}, not a fleet export (interlock fleet export)")
        logs.append(events)
        if os.path.isfile(records := os.path.join(path, EXPORTED_DECISIONS)):
            exported.append(records)
    return logs, decisions if decisions else (exported or None)


def unwritable_log(config: Config, key: str) -> str | None:
    """`gateway.event_log = PATH: why` when the log at `key` is set and the gateway could not
    write it, so `check-config` and `serve --require-event-log` catch it before a run without
    its records."""
    path = getattr(config.gateway, key)
    reason = unwritable_log_reason(path) if path else None
    return f"gateway.{key} = {path}: {reason}" if reason else None

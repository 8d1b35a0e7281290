"""`interlock timeline`: a recorded run as one self-contained HTML page."""

from __future__ import annotations

import argparse

from controlplane.rules.log_lines import format_timestamp
from interlock.commands.common import EXIT_OK, add_log_arguments, argument_type, bad_input, warner
from interlock.render import parse_time
from interlock.timeline import TimelineError, build_timeline
from interlock.timeline_page import render_html


def add_timeline(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "timeline", help="draw a recorded run as one self-contained HTML page: a lane per node, every transition"
    )
    add_log_arguments(parser, moment=False)
    time = argument_type(parse_time)
    parser.add_argument("--since", type=time, metavar="T", help="start here (default: the log's first event)")
    parser.add_argument("--until", type=time, metavar="T", help="end here (default: the log's last event)")
    parser.add_argument(
        "--decisions", metavar="FILE", help="the decision log (gateway.decision_log): request and 5xx rates on top"
    )
    parser.add_argument("-o", "--output", required=True, metavar="FILE", help="the HTML file to write")
    parser.set_defaults(run=run_timeline)


def run_timeline(args: argparse.Namespace) -> int:
    if args.since is not None and args.until is not None and args.since >= args.until:
        return bad_input(args, "argument --since: must be before --until")
    try:
        timeline = build_timeline(
            args.logs, since=args.since, until=args.until, decisions=args.decisions, warn=warner(args)
        )
    except TimelineError as err:
        return bad_input(args, str(err))
    with open(args.output, "w", encoding="utf-8") as page:
        page.write(render_html(timeline))
    window = f"from {format_timestamp(timeline.start)} to {format_timestamp(timeline.end)}"
    print(f"wrote {args.output}: {len(timeline.lanes)} nodes {window}")
    return EXIT_OK

"""`interlock explain`: where a request for a model would have gone, or where a recorded request went, and why."""

from __future__ import annotations

import argparse

from controlplane.effects.replay import explain
from events.decisions import find_decisions
from interlock.commands.common import (
    EXIT_NO_NODE,
    EXIT_OK,
    add_log_arguments,
    add_partition,
    add_skip_invalid,
    bad_input,
    print_json,
    replay_logs,
    warner,
)
from interlock.explain_request import render_causes, render_request, render_saturation, request_to_builtins
from interlock.render import explanation_to_builtins, render_explanation


def add_explain(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "explain",
        help="show where a request for a model would have gone, or where a recorded request went, and why",
    )
    add_log_arguments(parser, moment=True, optional=True)
    parser.add_argument("--model", metavar="M", help="the requested model, exactly as sent (unless --request-id)")
    parser.add_argument("--request-id", metavar="ID", help="explain this recorded request instead")
    parser.add_argument("--decisions", metavar="FILE", help="the decision log (gateway.decision_log) to find it in")
    add_partition(parser)
    add_skip_invalid(parser)
    parser.set_defaults(run=run_explain)


def run_explain(args: argparse.Namespace) -> int:
    if args.request_id is not None:
        return _explain_request(args)
    for given, name in ((args.decisions, "--decisions"), (args.partition, "--partition")):
        if given:
            return bad_input(args, f"argument {name}: only allowed with --request-id")
    if args.model is None:
        return bad_input(args, "the following arguments are required: --model")
    if not args.logs:
        return bad_input(args, "the following arguments are required: LOG")
    result = replay_logs(args, until_seq=args.until_seq, until_at=args.at)
    explanation = explain(result, args.model, args.at)
    if args.json:
        print_json(explanation_to_builtins(explanation))
    else:
        print(render_explanation(explanation))
    return EXIT_NO_NODE if explanation.refusal else EXIT_OK


def _explain_request(args: argparse.Namespace) -> int:
    """One recorded request; with event logs, the events behind its exclusions too."""
    if args.decisions is None:
        return bad_input(args, "the following arguments are required: --decisions (with --request-id)")
    for given, name in ((args.model, "--model"), (args.until_seq, "--until-seq"), (args.at, "--at")):
        if given is not None:
            return bad_input(args, f"argument {name}: not allowed with --request-id (the record has its model and seq)")
    warn = warner(args)
    records = find_decisions(args.decisions, args.request_id, warn, warn if args.skip_invalid else None)
    if not records:
        return bad_input(args, f"no request with id {args.request_id!r} in the decision log {args.decisions}")
    *earlier, decision = records
    if args.logs and decision.partition != args.partition:
        return bad_input(args, _routed_elsewhere(args.request_id, decision.partition, decision.replica))
    # The control plane as the request saw it: the log replayed up to the snapshot it was routed on.
    result = replay_logs(args, until_seq=decision.seq) if args.logs else None
    if args.json:
        print_json(request_to_builtins(decision, result))
    elif result is None:
        print(render_request(decision, earlier))
    else:
        text = render_request(decision, earlier) + "\n\n" + render_causes(decision, result)
        if decision.admission is not None and decision.admission.saturated_seq:
            # The pool as admission saw it when the request arrived: the log up to that seq.
            saturated = replay_logs(args, until_seq=decision.admission.saturated_seq)
            text += "\n\n" + render_saturation(decision, saturated)
        print(text)
    return EXIT_OK


def _routed_elsewhere(request_id: str, partition: str, replica: str) -> str:
    """Why a request is not explained against the events given: it was routed on others."""
    if partition:
        return (
            f"request {request_id!r} was routed in partition {partition} of replica {replica}, on its own events: "
            f"explain it with that partition's event log (a fleet export's DIR/partitions/{partition}/events.jsonl) "
            f"and --partition {partition}"
        )
    return f"request {request_id!r} was routed on the fleet's events, not a partition's: explain it without --partition"

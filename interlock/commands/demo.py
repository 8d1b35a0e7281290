"""`interlock demo`: simulated nodes and the gateway, with one request through it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from interlock.commands.common import EXIT_FAILURE, package_version


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
    parser.add_argument("--port", type=int, metavar="N", help="the gateway's API port (default: the config's, 8080)")
    parser.add_argument(
        "--metrics-port", type=int, metavar="N", help="the gateway's metrics port (default: the config's, 9090)"
    )
    parser.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    checkout = Path(__file__).resolve().parent.parent.parent
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
        port=args.port,
        metrics_port=args.metrics_port,
    )

"""`interlock serve`: its options, its help on signals and exit codes; `interlock.serve` runs the gateway."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

from controlplane.infrastructure.config import ConfigError, Overrides, load_config
from controlplane.infrastructure.gocompat import parse_go_duration, parse_listen_address
from events.config import (
    DEFAULT_LISTEN,
    DEFAULT_METRICS_LISTEN,
    DEFAULT_SHUTDOWN_GRACE,
    LOG_FORMATS,
    LOG_LEVELS,
    RESTART_KEYS,
)
from interlock.commands.check_config import unwritable_log
from interlock.commands.common import EXIT_FAILURE, argument_type, bad_input, package_version


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
    address = argument_type(_listen_address)
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
        type=argument_type(_port),
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
        type=argument_type(_seconds),
        metavar="DURATION",
        help="how long SIGTERM's drain lets streams finish, as 90s or 2m "
        f"(gateway.shutdown_grace: {DEFAULT_SHUTDOWN_GRACE:g}s)",
    )
    parser.add_argument(
        "--workers",
        type=argument_type(parse_workers),
        metavar="N|auto",
        help="processes serving the API; auto: one per usable core (gateway.workers: 1)",
    )
    parser.add_argument(
        "--fleet",
        type=argument_type(parse_nats_urls),
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
        return bad_input(args, "argument --port: not allowed with argument --listen (its address has a port)")
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
    if not os.path.exists(args.config):
        print(
            f"fatal: no config file at {args.config}: give its path with --config PATH or ${CONFIG_ENV} "
            f"(config/gateway.toml in a checkout documents every key)",
            file=sys.stderr,
        )
        return EXIT_FAILURE
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

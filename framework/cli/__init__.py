"""The ``framework`` command: run services, inspect destinations, send messages, manage the server.

Every sub-command that talks to the broker takes ``--broker-url`` (alias ``--redis-url``; default
``$BROKER_URL``, else ``$REDIS_URL``, else the per-user embedded Valkey, see
:func:`broker.redis.default_data_dir`) and ``--namespace`` (default ``$FRAMEWORK_NAMESPACE`` or
``fw``); ``memory://`` is refused (it lives inside one process). Errors are one line on stderr with exit status 2 (bad
arguments) or 1 (the broker, the database or the code failed). Output piped into a reader that stops
early (``| head``) ends quietly with status 141, as a command stopped by SIGPIPE does.

One module per command group, named for it: :mod:`~framework.cli.run`, :mod:`~framework.cli.status`,
:mod:`~framework.cli.produce` (send, publish), :mod:`~framework.cli.peek`, :mod:`~framework.cli.server`,
:mod:`~framework.cli.dead_letters` (dlq), :mod:`~framework.cli.destinations` (unsubscribe, delete),
:mod:`~framework.cli.outbox` (with :mod:`~framework.cli.outbox_rows` for refused rows) and
:mod:`~framework.cli.schedule`; :mod:`~framework.cli.common` holds what they share, and
:mod:`~framework.cli.hints` what they say about names that do not exist. Those modules are
internal: the public names are :func:`main` and :func:`build_parser`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from framework.cli import asyncapi, dead_letters, destinations, outbox, peek, produce, run, schedule, server, status
from framework.cli import dashboard as dashboard_cli
from framework.cli.args import log_level
from framework.cli.common import Parser, run_command
from framework.logconfig import configure_logging

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``framework`` command."""
    common = Parser(add_help=False)  # only a parent: its options are copied into each parser
    common.add_argument(
        "--log-level", type=log_level, default=argparse.SUPPRESS, help="debug, info, warning, error (default: info)"
    )
    common.add_argument(
        "--log-format",
        choices=("console", "json"),
        default=argparse.SUPPRESS,
        help="default: console on a terminal, json otherwise",
    )
    parser = Parser(prog="framework", description="Event-driven microservices on Redis Streams.", parents=[common])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    commands = _Commands(sub, common)  # every sub-command accepts the logging options too
    # the order of `framework --help`
    for group in (run, status, produce, peek, server, dead_letters, destinations, outbox, schedule, asyncapi):
        group.register(commands)
    dashboard_cli.register(commands)
    return parser


class _Commands:
    """What the command groups' ``register(sub)`` add their sub-commands to: ``sub.add_parser``
    with the common options as a parent."""

    def __init__(self, sub: argparse._SubParsersAction[Parser], common: Parser) -> None:
        self._sub = sub
        self._common = common

    def add_parser(self, name: str, **kwargs: Any) -> Parser:
        return self._sub.add_parser(name, parents=[self._common], **kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``framework`` and ``python -m framework``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configure_logging(getattr(args, "log_level", None), getattr(args, "log_format", None))
    except ValueError as exc:  # FRAMEWORK_LOG_LEVEL/FORMAT (the options are checked by the parser)
        print(f"framework {args.command}: error: {exc}", file=sys.stderr)
        return 2
    try:
        status = run_command(args)
        sys.stdout.flush()  # a closed pipe shows here, while it can still be handled
    except BrokenPipeError:  # `framework dlq show ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit flush writes nowhere
        return 128 + signal.SIGPIPE  # what a command killed by SIGPIPE reports (141)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""What every ``framework`` sub-command shares: the parser, connection options, and one-line errors.

A wrong argument raises :class:`UsageError` (one line on stderr, exit status 2); a failure of the
broker, the database or the user's code is one line with exit status 1 (:func:`run_command`).
Nothing here prints a traceback for an error whose message already says what to do.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

import orjson

from broker.connect import configured_url, is_memory_url
from broker.errors import transport_errors
from framework.cli.args import json_argument
from framework.service import HandlerError

__all__ = ["Parser", "UsageError", "connection_options", "json_payload", "print_json", "run_command"]


class UsageError(Exception):
    """A wrong argument: reported in one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors end with where to find help."""

    def error(self, message: str) -> NoReturn:
        """Exit with status 2 and one line naming ``--help``."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def refuse_memory(url: str | None) -> None:
    """Raise :class:`UsageError` for a ``memory://`` URL: a command run from the shell cannot meet
    anything there (that transport lives inside one process: users' unit tests)."""
    if is_memory_url(url):
        raise UsageError(
            "memory:// is an in-process transport for unit tests (ServiceHarness): a separate process "
            "(framework run, the relay, this command) would run alone on it; use redis://host:port "
            "or leave the URL unset for the embedded Valkey"
        )


def connection_options(p: argparse.ArgumentParser) -> None:
    """Add ``--broker-url`` (alias ``--redis-url``) and ``--namespace`` (resolved by :func:`broker.connect`
    when left out)."""
    p.add_argument(
        "--broker-url",
        "--redis-url",
        dest="redis_url",
        default=None,
        help="broker URL: redis://, rediss://, unix://, amqp://, amqps:// "
        "(default: $BROKER_URL, else $REDIS_URL, else embedded Valkey)",
    )
    p.add_argument("--namespace", default=None, help="key prefix (default: $FRAMEWORK_NAMESPACE or 'fw')")


def json_payload(text: str) -> Any:
    """The JSON argument of a command: the JSON itself, ``-`` (stdin) or ``@FILE``; UsageError if bad."""
    try:
        return json_argument(text)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def print_json(data: Any) -> None:
    """Write ``data`` to stdout as indented JSON (the ``--json`` output of every command)."""
    sys.stdout.write(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode() + "\n")


def _reportable() -> tuple[type[BaseException], ...]:
    """Errors shown as one line (no traceback): they say what was wrong and how to fix it."""
    # transport_errors(): also the transport clients' own errors (ACL refusals on connections
    # broker.connect did not make, such as the status views' blocking clients)
    errors: tuple[type[BaseException], ...] = (*transport_errors(), HandlerError)
    try:
        from framework.sql import DatabaseUnavailable
    except ImportError:  # the sql extra is not installed
        return errors
    return (*errors, DatabaseUnavailable)


def _cause(group: BaseExceptionGroup) -> BaseException:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _cause(exc)
        if isinstance(exc, (UsageError, KeyboardInterrupt, BrokenPipeError, *_reportable())):
            return exc
    return group


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed sub-command (``args.func``); return its exit status, errors reported in one line."""
    try:
        try:
            if hasattr(args, "redis_url"):  # a command that connects: memory:// from the environment too
                refuse_memory(args.redis_url or configured_url())
            return int(args.func(args) or 0)
        except BaseExceptionGroup as group:  # raised through task groups: report the cause
            raise _cause(group) from None
    except UsageError as exc:
        print(f"framework {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except _reportable() as exc:
        print(f"framework {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130

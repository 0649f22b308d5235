"""What the ``framework outbox`` commands share: the SQL modules imported on demand, the engine, and
database failures reported in one line (exit status 1), as the other commands report the broker's.

SQLAlchemy and the database drivers are imported only when an outbox command runs, so the rest of
the ``framework`` command works without the ``sql`` extra.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from typing import Any

from framework.cli.common import UsageError

__all__ = ["Fail", "checked", "database_option", "engine_of", "guarded", "logging_options", "one_line", "sql_modules"]


def sql_modules() -> tuple[Any, Any]:
    try:
        from framework import outbox, sql
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in ("sqlalchemy", "psycopg", "aiosqlite", "greenlet"):
            raise Fail(
                f"the outbox needs the SQL extra ({exc.name} is missing): pip install 'framework[sql]'"
            ) from None
        raise
    return outbox, sql


class Fail(Exception):
    """A failure reported in one line with exit status 1 (the database, not the arguments)."""


def engine_of(args: argparse.Namespace) -> Any:
    outbox, _ = sql_modules()
    try:
        return outbox.create_engine(args.database_url)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def one_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def guarded(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Report database failures in one line (exit 1), as the other commands do for the broker."""

    @functools.wraps(run)
    def command(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except Fail as exc:
            print(f"framework outbox {args.outbox_command}: {exc}", file=sys.stderr)
            return 1
        except BaseExceptionGroup as group:
            inner = group
            while isinstance(inner, BaseExceptionGroup) and len(inner.exceptions) == 1:
                inner = inner.exceptions[0]
            if isinstance(inner, Fail):
                print(f"framework outbox {args.outbox_command}: {inner}", file=sys.stderr)
                return 1
            raise
        except Exception as exc:
            from sqlalchemy.exc import SQLAlchemyError

            if not isinstance(exc, SQLAlchemyError | OSError):
                raise
            print(f"framework outbox {args.outbox_command}: database error: {one_line(exc)}", file=sys.stderr)
            return 1

    return command


async def checked(engine: Any) -> None:
    """Fail in one line when the database is unreachable or lacks the tables."""
    outbox, sql = sql_modules()
    try:
        await outbox.check_tables(engine)
    except sql.DatabaseUnavailable as exc:
        raise Fail(str(exc)) from None


def database_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--database-url",
        default=None,
        help="postgresql://... or sqlite:///file.db (default: $DATABASE_URL, else $FRAMEWORK_HOME/outbox.db)",
    )


def logging_options(p: argparse.ArgumentParser) -> None:
    # nested sub-commands do not inherit the top-level parser's parents
    p.add_argument("--log-level", default=argparse.SUPPRESS, help="debug, info, warning, error (default: info)")
    p.add_argument(
        "--log-format",
        choices=("console", "json"),
        default=argparse.SUPPRESS,
        help="default: console on a terminal, json otherwise",
    )

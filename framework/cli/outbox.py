"""``framework outbox relay|migrate|ddl|status|retry``: the database outbox from the command line.

SQLAlchemy and the database drivers are imported only when an outbox command runs, so the rest of
the ``framework`` command works without the ``sql`` extra.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import anyio

from framework.cli.args import duration, metrics_address, metrics_options, positive_int
from framework.cli.common import UsageError, connection_options, print_json

__all__ = ["register"]

_DIALECTS = ("postgresql", "sqlite")  # as framework.outbox.schema.DIALECTS, without importing SQLAlchemy


def _sql_modules() -> tuple[Any, Any]:
    try:
        from framework import outbox, sql
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in ("sqlalchemy", "psycopg", "aiosqlite", "greenlet"):
            raise _Fail(
                f"the outbox needs the SQL extra ({exc.name} is missing): pip install 'framework[sql]'"
            ) from None
        raise
    return outbox, sql


class _Fail(Exception):
    """A failure reported in one line with exit status 1 (the database, not the arguments)."""


def _engine(args: argparse.Namespace) -> Any:
    outbox, _ = _sql_modules()
    try:
        return outbox.create_engine(args.database_url)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _one_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _guarded(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Report database failures in one line (exit 1), as the other commands do for the broker."""

    @functools.wraps(run)
    def command(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except _Fail as exc:
            print(f"framework outbox {args.outbox_command}: {exc}", file=sys.stderr)
            return 1
        except BaseExceptionGroup as group:
            inner = group
            while isinstance(inner, BaseExceptionGroup) and len(inner.exceptions) == 1:
                inner = inner.exceptions[0]
            if isinstance(inner, _Fail):
                print(f"framework outbox {args.outbox_command}: {inner}", file=sys.stderr)
                return 1
            raise
        except Exception as exc:
            from sqlalchemy.exc import SQLAlchemyError

            if not isinstance(exc, SQLAlchemyError | OSError):
                raise
            print(f"framework outbox {args.outbox_command}: database error: {_one_line(exc)}", file=sys.stderr)
            return 1

    return command


async def _checked(engine: Any) -> None:
    """Fail in one line when the database is unreachable or lacks the tables."""
    outbox, sql = _sql_modules()
    try:
        await outbox.check_tables(engine)
    except sql.DatabaseUnavailable as exc:
        raise _Fail(str(exc)) from None


@_guarded
def relay_command(args: argparse.Namespace) -> int:
    """Publish committed outbox messages until a signal (``--once``: what waits now, then exit)."""
    engine = _engine(args)  # first: it says in one line when the sql extra is missing

    from sqlalchemy.exc import SQLAlchemyError

    from broker import connect
    from broker.errors import transport_errors
    from framework import observability
    from framework.logs import get_logger
    from framework.outbox import OutboxRelay

    log = get_logger("framework.cli")
    try:
        metrics_port, metrics_host = metrics_address(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:  # tracing and metrics as the OTEL_* variables say; --metrics-port serves Prometheus
        observability.configure_from_env("outbox-relay", metrics_port=metrics_port, metrics_host=metrics_host)
    except OSError as exc:
        raise _Fail(f"cannot serve metrics on {metrics_host}:{metrics_port}: {exc.strerror or exc}") from None

    async def main() -> int:
        try:
            await _checked(engine)
            broker = await connect(args.redis_url, namespace=args.namespace)
            try:
                relay = OutboxRelay(
                    engine,
                    broker,
                    batch_size=args.batch_size,
                    poll_interval=args.poll_interval,
                    retention=args.retention,
                    inbox_retention=args.inbox_retention,
                    concurrency=args.concurrency,
                    max_shards=args.max_shards,
                )
                if args.once:
                    failures: tuple[type[BaseException], ...] = (*transport_errors(), SQLAlchemyError)
                    try:
                        settled = await relay.drain()
                    except failures as exc:
                        raise _Fail(
                            f"stopped after publishing {relay.published} message(s): {_one_line(exc)}; "
                            "the next run publishes the rest"
                        ) from None
                    print(
                        f"published {relay.published} message(s)"
                        + (f", set {settled - relay.published} aside" if settled > relay.published else "")
                    )
                    return 0
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_stop_on_signals, relay, log)
                    await relay.run()
                    tg.cancel_scope.cancel()
                return 0
            finally:
                await broker.close()
        finally:
            await engine.dispose()

    try:
        return anyio.run(main)
    finally:
        observability.shutdown()  # spans and metrics still buffered go out now


@_guarded
def migrate_command(args: argparse.Namespace) -> int:
    """Create the outbox and inbox tables (idempotent)."""
    outbox, sql = _sql_modules()
    engine = _engine(args)

    async def main() -> None:
        try:
            try:
                await sql.ping(engine)
            except sql.DatabaseUnavailable as exc:
                raise _Fail(str(exc)) from None
            await outbox.create_tables(engine)
        finally:
            await engine.dispose()

    anyio.run(main)
    print(f"outbox and inbox tables are in place in {sql.redact_url(engine.url)}")
    return 0


@_guarded
def ddl_command(args: argparse.Namespace) -> int:
    """Print the DDL of the tables, for the user's own migration tool."""
    outbox, sql = _sql_modules()
    dialect = args.dialect
    if dialect is None:
        try:
            dialect = sql.resolve_url(args.database_url).get_backend_name()
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    sys.stdout.write(outbox.ddl(dialect))
    return 0


@_guarded
def status_command(args: argparse.Namespace) -> int:
    """Print how many messages wait, were refused and were sent, and the inbox records."""
    _, sql = _sql_modules()
    engine = _engine(args)

    async def main() -> dict[str, Any]:
        try:
            await _checked(engine)
            return await _status(engine)
        finally:
            await engine.dispose()

    st = anyio.run(main)
    if args.json:
        print_json(st)
        return 0
    print(f"database:  {sql.redact_url(engine.url)}")
    oldest = st["oldest_waiting_seconds"]
    age = f" (oldest waiting {oldest:.1f} s)" if oldest is not None else ""
    print(f"waiting:   {st['waiting']}{age}")
    print(
        f"refused:   {st['refused']}"
        + ("  (see the error column; `framework outbox retry` once fixed)" if st["refused"] else "")
    )
    print(f"sent:      {st['sent']} (kept for the retention period)")
    print(f"inbox:     {st['inbox']} record(s)")
    return 0


@_guarded
def retry_command(args: argparse.Namespace) -> int:
    """Put refused messages back in line once the cause is fixed."""
    if not args.ids and not args.all:
        raise UsageError("say which refused messages to retry: message ids, or --all")
    engine = _engine(args)

    async def main() -> int:
        from sqlalchemy import update

        from framework.outbox.schema import outbox_table as t

        try:
            await _checked(engine)
            stmt = update(t).where(t.c.error.isnot(None)).values(error=None)
            if args.ids:
                stmt = stmt.where(t.c.message_id.in_(args.ids))
            async with engine.begin() as conn:
                return int((await conn.execute(stmt)).rowcount)
        finally:
            await engine.dispose()

    print(f"{anyio.run(main)} refused message(s) will be published again")
    return 0


async def _stop_on_signals(relay: Any, log: Any) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        stopping = False
        async for signum in signals:
            if stopping:
                log.warning("second signal: exiting now; an unfinished batch is published again by the next relay")
                os._exit(128 + signum)
            stopping = True
            log.info("signal received: finishing the current batch", signal=signal.Signals(signum).name)
            relay.stop()


async def _status(engine: Any) -> dict[str, Any]:
    from datetime import UTC, datetime

    from sqlalchemy import func, select

    from framework.outbox.schema import inbox_table, outbox_table, sent_table

    o = outbox_table
    async with engine.connect() as conn:
        waiting = (await conn.execute(select(func.count()).where(o.c.error.is_(None)))).scalar_one()
        refused = (await conn.execute(select(func.count()).where(o.c.error.isnot(None)))).scalar_one()
        oldest = (await conn.execute(select(func.min(o.c.created_at)).where(o.c.error.is_(None)))).scalar()
        sent = (await conn.execute(select(func.count()).select_from(sent_table))).scalar_one()
        inbox = (await conn.execute(select(func.count()).select_from(inbox_table))).scalar_one()
    if oldest is not None and oldest.tzinfo is None:
        oldest = oldest.replace(tzinfo=UTC)
    return {
        "waiting": waiting,
        "refused": refused,
        "sent": sent,
        "inbox": inbox,
        "oldest_waiting_seconds": (datetime.now(UTC) - oldest).total_seconds() if oldest is not None else None,
    }


def _database_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--database-url",
        default=None,
        help="postgresql://... or sqlite:///file.db (default: $DATABASE_URL, else $FRAMEWORK_HOME/outbox.db)",
    )


def _logging_options(p: argparse.ArgumentParser) -> None:
    # nested sub-commands do not inherit the top-level parser's parents
    p.add_argument("--log-level", default=argparse.SUPPRESS, help="debug, info, warning, error (default: info)")
    p.add_argument(
        "--log-format",
        choices=("console", "json"),
        default=argparse.SUPPRESS,
        help="default: console on a terminal, json otherwise",
    )


def register(sub: Any) -> None:
    """Add ``outbox`` (relay, migrate, ddl, status, retry) to the ``framework`` command."""
    outbox = sub.add_parser("outbox", help="database outbox: run the relay, create the tables, print the DDL")
    actions = outbox.add_subparsers(dest="outbox_command", required=True)

    p = actions.add_parser("relay", help="publish committed outbox messages until SIGTERM/SIGINT")
    _database_option(p)
    p.add_argument("--batch-size", type=positive_int, default=1000, help="messages per transaction (default 1000)")
    p.add_argument(
        "--poll-interval",
        type=duration,
        default=None,
        help="idle check interval: a fallback on PostgreSQL, which wakes on NOTIFY (default 2s; SQLite 0.05s)",
    )
    p.add_argument(
        "--retention",
        type=duration,
        default=24 * 3600.0,
        help="how long sent messages are kept, e.g. 3600, 12h, 7d (default 24h)",
    )
    p.add_argument(
        "--inbox-retention",
        type=duration,
        default=7 * 24 * 3600.0,
        help="how long SQL inbox records (handlers' processed message ids) are kept (default 7d)",
    )
    p.add_argument(
        "--concurrency", type=positive_int, default=2, help="batches in flight at once on PostgreSQL (default 2)"
    )
    p.add_argument(
        "--max-shards",
        type=positive_int,
        default=16,
        help="shards (of 64) one PostgreSQL batch claims, leaving others to other relays (default 16)",
    )
    p.add_argument("--once", action="store_true", help="publish what is waiting now, then exit")
    metrics_options(p)
    connection_options(p)
    _logging_options(p)
    p.set_defaults(func=relay_command)

    p = actions.add_parser("migrate", help="create the outbox and inbox tables (idempotent)")
    _database_option(p)
    _logging_options(p)
    p.set_defaults(func=migrate_command)

    p = actions.add_parser("ddl", help="print the DDL, for your own migration tool")
    p.add_argument(
        "--dialect",
        choices=_DIALECTS,
        default=None,
        help="default: that of --database-url / $DATABASE_URL (SQLite without either)",
    )
    _database_option(p)
    p.set_defaults(func=ddl_command)

    p = actions.add_parser("status", help="messages waiting, refused and sent; inbox records")
    _database_option(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _logging_options(p)
    p.set_defaults(func=status_command)

    p = actions.add_parser("retry", help="publish messages the broker refused again, once the cause is fixed")
    p.add_argument("ids", nargs="*", metavar="MESSAGE_ID")
    p.add_argument("--all", action="store_true", help="every refused message")
    _database_option(p)
    _logging_options(p)
    p.set_defaults(func=retry_command)

"""``framework outbox relay|migrate|ddl|status``: the database outbox from the command line.

The refused rows (``list``, ``show``, ``retry``, ``discard``) are in :mod:`framework.cli.outbox_rows`;
what both share in :mod:`framework.cli.outbox_db`.

SQLAlchemy and the database drivers are imported only when an outbox command runs, so the rest of
the ``framework`` command works without the ``sql`` extra.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

import anyio

from framework.cli import outbox_rows
from framework.cli.args import duration, metrics_address, metrics_options, positive_int
from framework.cli.common import UsageError, connection_options, print_json
from framework.cli.outbox_db import (
    Fail,
    checked,
    database_option,
    engine_of,
    guarded,
    logging_options,
    one_line,
    sql_modules,
)

__all__ = ["register"]

_DIALECTS = ("postgresql", "sqlite")  # as framework.outbox.schema.DIALECTS, without importing SQLAlchemy


@guarded
def relay_command(args: argparse.Namespace) -> int:
    """Publish committed outbox messages until a signal (``--once``: what waits now, then exit)."""
    engine = engine_of(args)  # first: it says in one line when the sql extra is missing

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
        raise Fail(f"cannot serve metrics on {metrics_host}:{metrics_port}: {exc.strerror or exc}") from None

    async def main() -> int:
        try:
            await checked(engine)
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
                        raise Fail(
                            f"stopped after publishing {relay.published} message(s): {one_line(exc)}; "
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


@guarded
def migrate_command(args: argparse.Namespace) -> int:
    """Create the outbox and inbox tables (idempotent)."""
    outbox, sql = sql_modules()
    engine = engine_of(args)

    async def main() -> None:
        try:
            try:
                await sql.ping(engine)
            except sql.DatabaseUnavailable as exc:
                raise Fail(str(exc)) from None
            await outbox.create_tables(engine)
        finally:
            await engine.dispose()

    anyio.run(main)
    print(f"outbox and inbox tables are in place in {sql.redact_url(engine.url)}")
    return 0


@guarded
def ddl_command(args: argparse.Namespace) -> int:
    """Print the DDL of the tables, for the user's own migration tool."""
    outbox, sql = sql_modules()
    dialect = args.dialect
    if dialect is None:
        try:
            dialect = sql.resolve_url(args.database_url).get_backend_name()
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    sys.stdout.write(outbox.ddl(dialect))
    return 0


@guarded
def status_command(args: argparse.Namespace) -> int:
    """Print how many messages wait, were refused and were sent, and the inbox records."""
    _, sql = sql_modules()
    engine = engine_of(args)

    async def main() -> dict[str, Any]:
        try:
            await checked(engine)
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
        + ("  (`framework outbox list` shows them; `framework outbox retry` once fixed)" if st["refused"] else "")
    )
    print(f"sent:      {st['sent']} (kept for the retention period)")
    print(f"inbox:     {st['inbox']} record(s)")
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


def register(sub: Any) -> None:
    """Add ``outbox`` (relay, migrate, ddl, status, list, show, retry, discard) to the ``framework`` command."""
    outbox = sub.add_parser("outbox", help="database outbox: run the relay, create the tables, print the DDL")
    actions = outbox.add_subparsers(dest="outbox_command", required=True)

    p = actions.add_parser("relay", help="publish committed outbox messages until SIGTERM/SIGINT")
    database_option(p)
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
    logging_options(p)
    p.set_defaults(func=relay_command)

    p = actions.add_parser("migrate", help="create the outbox and inbox tables (idempotent)")
    database_option(p)
    logging_options(p)
    p.set_defaults(func=migrate_command)

    p = actions.add_parser("ddl", help="print the DDL, for your own migration tool")
    p.add_argument(
        "--dialect",
        choices=_DIALECTS,
        default=None,
        help="default: that of --database-url / $DATABASE_URL (SQLite without either)",
    )
    database_option(p)
    p.set_defaults(func=ddl_command)

    p = actions.add_parser("status", help="messages waiting, refused and sent; inbox records")
    database_option(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    logging_options(p)
    p.set_defaults(func=status_command)

    outbox_rows.register(actions)

"""``framework outbox list|show|retry|discard``: the rows the broker refused, from the command line.

Thin layers over :mod:`framework.outbox.refusals`. ``retry`` checks each row against the broker
first: a row it would refuse again at once stays set aside (counted, with its reason), instead of
going round the relay to come back. ``discard`` deletes refused rows for good, after confirmation
(``--yes``; without a terminal it refuses rather than ask); a row still waiting is never discarded.
Bodies are shown as the dead-letter view shows them (secret fields redacted).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from framework.cli.args import positive_int
from framework.cli.common import UsageError, connection_options, print_json
from framework.cli.outbox_db import checked, database_option, engine_of, guarded, logging_options, sql_modules

__all__ = ["register"]


def _refusals() -> Any:
    """:mod:`framework.outbox.refusals`, or one line naming the SQL extra when it is not installed."""
    sql_modules()
    from framework.outbox import refusals

    return refusals


def _with_engine(args: argparse.Namespace, fn: Callable[[Any], Awaitable[Any]]) -> Any:
    """Run ``fn(engine)`` once the tables are there; dispose of the engine after."""
    engine = engine_of(args)

    async def go() -> Any:
        try:
            await checked(engine)
            return await fn(engine)
        finally:
            await engine.dispose()

    return anyio.run(go)


def _view(row: Any) -> dict[str, Any]:
    """A row as JSON: its columns, ``state`` (waiting or refused) and the body as the DLQ view shows it."""
    import attrs

    from framework.dead_letters import body_view

    data = {k: v for k, v in attrs.asdict(row).items() if k != "body"}
    return {**data, "state": "waiting" if row.error is None else "refused", **body_view(row.body)}


@guarded
def list_command(args: argparse.Namespace) -> int:
    """Print the refused rows, oldest first."""
    refusals = _refusals()
    rows, total = _with_engine(args, lambda e: refusals.refused_rows(e, limit=args.limit))
    if args.json:
        print_json([_view(r) for r in rows])
        return 0
    if not rows:
        print("no refused messages")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"refused outbox messages: {total}" + (f" (first {len(rows)})" if total > len(rows) else ""))
    for col in ("message id", "destination", "kind", "created", "error"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r.message_id, r.destination, r.kind, r.created_at[:19], (r.error or "")[:160])
    (Console() if sys.stdout.isatty() else Console(width=200)).print(table)
    return 0


@guarded
def show_command(args: argparse.Namespace) -> int:
    """Print one outbox row (refused or waiting): destination, headers, body, error."""
    refusals = _refusals()
    row = _with_engine(args, lambda e: refusals.get_row(e, args.message_id))
    if row is None:
        raise UsageError(f"no outbox message {args.message_id!r} (sent ones leave the outbox; see outbox status)")
    data = _view(row)
    if args.json:
        print_json(data)
        return 0
    for k, v in data.items():
        print(f"{k:>12}: {v}")
    return 0


def _ids(args: argparse.Namespace, verb: str) -> list[str] | None:
    if args.ids and args.all:
        raise UsageError(f"give message ids or --all, not both, to {verb}")
    if not args.ids and not args.all:
        raise UsageError(f"say which refused messages to {verb}: message ids, or --all")
    return list(args.ids) or None


@guarded
def retry_command(args: argparse.Namespace) -> int:
    """Put refused messages back in line once the cause is fixed; those refused again stay set aside."""
    ids = _ids(args, "retry")
    refusals = _refusals()
    from broker import connect

    async def go(engine: Any) -> Any:
        broker = await connect(args.redis_url, namespace=args.namespace)
        try:
            return await refusals.retry(engine, broker, ids)
        finally:
            await broker.close()

    result = _with_engine(args, go)
    print(f"{result.requeued} refused message(s) will be published again")
    if result.still_refused:
        print(f"{len(result.still_refused)} stay refused (the broker would refuse them again at once):")
        for message_id, reason in list(result.still_refused.items())[:10]:
            print(f"  {message_id}: {reason}")
        if len(result.still_refused) > 10:
            print(f"  and {len(result.still_refused) - 10} more (framework outbox list)")
    if result.unknown:
        print(f"not refused messages (unknown or already sent): {', '.join(result.unknown)}", file=sys.stderr)
    return 1 if result.still_refused or result.unknown else 0


@guarded
def discard_command(args: argparse.Namespace) -> int:
    """Delete refused messages for good, after confirmation."""
    ids = _ids(args, "discard")
    refusals = _refusals()
    if not args.yes:
        count = len(ids) if ids else _with_engine(args, lambda e: refusals.refused_rows(e, limit=1))[1]
        if not sys.stdin.isatty():
            raise UsageError(f"refusing to discard {count} refused message(s) without confirmation: pass --yes")
        if input(f"Delete {count} refused outbox message(s) for good? [y/N] ").strip().lower() not in ("y", "yes"):
            print("nothing discarded")
            return 1
    print(f"discarded {_with_engine(args, lambda e: refusals.discard(e, ids))} refused message(s)")
    return 0


def register(actions: Any) -> None:
    """Add ``list``, ``show``, ``retry`` and ``discard`` to ``framework outbox``."""
    p = actions.add_parser("list", help="messages the broker refused, oldest first, with the reason")
    p.add_argument("--limit", type=positive_int, default=100, help="at most this many (default 100)")
    p.add_argument("--json", action="store_true", help="machine-readable output, bodies (redacted) and headers")
    database_option(p)
    logging_options(p)
    p.set_defaults(func=list_command)

    p = actions.add_parser("show", help="one outbox message (refused or waiting): headers, body, reason")
    p.add_argument("message_id", metavar="MESSAGE_ID")
    p.add_argument("--json", action="store_true")
    database_option(p)
    logging_options(p)
    p.set_defaults(func=show_command)

    p = actions.add_parser("retry", help="publish refused messages again once the cause is fixed (checked first)")
    p.add_argument("ids", nargs="*", metavar="MESSAGE_ID")
    p.add_argument("--all", action="store_true", help="every refused message")
    database_option(p)
    connection_options(p)
    logging_options(p)
    p.set_defaults(func=retry_command)

    p = actions.add_parser("discard", help="delete refused messages for good (never one still waiting)")
    p.add_argument("ids", nargs="*", metavar="MESSAGE_ID")
    p.add_argument("--all", action="store_true", help="every refused message")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    database_option(p)
    logging_options(p)
    p.set_defaults(func=discard_command)

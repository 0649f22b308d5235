"""``framework schedule list|show|cancel``: scheduled messages from the command line.

Thin layers over the broker's scheduling role (:mod:`broker.redis.scheduling`): ``list`` shows
messages waiting for their due time (earliest first), ``show`` one by its message id, ``cancel``
drops them before they are delivered. Every action takes ``--json``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import anyio

from broker import connect
from framework.cli.args import positive_int
from framework.cli.common import UsageError, connection_options, print_json

__all__ = ["register"]


def _with_broker(args: argparse.Namespace, fn: Callable[[Any], Awaitable[Any]]) -> Any:
    """Run ``fn`` on the broker ``args`` names; close the connection after."""

    async def go() -> Any:
        broker = await connect(args.redis_url, namespace=args.namespace)
        try:
            return await fn(broker)
        finally:
            await broker.close()

    return anyio.run(go)


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


def _to_json(m: Any) -> dict[str, Any]:
    """Plain data of a scheduled message (body as text when it is UTF-8, else hex)."""
    env = m.envelope
    data: dict[str, Any] = {
        "message_id": m.message_id,
        "destination": m.destination,
        "partition": m.partition,
        "due_at": _iso(m.due_ms),
        "due_ms": m.due_ms,
        "kind": env.kind if env else None,
        "type": env.type if env else None,
        "key": env.key if env else None,
        "headers": dict(env.headers) if env else None,
        "scheduled_at": _iso(env.published_at) if env else None,
        "body": None,
    }
    if env is None:
        data["error"] = "the stored entry could not be decoded"
        return data
    try:
        data["body"] = env.body.decode()
    except UnicodeDecodeError:
        data["body_hex"] = env.body.hex()
    return data


def list_scheduled(args: argparse.Namespace) -> int:
    """Print scheduled messages as a table, or as JSON."""
    items = _with_broker(args, lambda b: b.scheduled_messages(destination=args.destination, limit=args.limit))
    if args.json:
        print_json([_to_json(m) for m in items])
        return 0
    if not items:
        print("no scheduled messages")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table()
    for col in ("message id", "destination", "partition", "due (UTC)", "type"):
        table.add_column(col, overflow="fold")
    for m in items:
        table.add_row(
            m.message_id, m.destination, str(m.partition), _iso(m.due_ms), m.envelope.type if m.envelope else "?"
        )
    (Console() if sys.stdout.isatty() else Console(width=200)).print(table)
    return 0


def show_scheduled(args: argparse.Namespace) -> int:
    """Print one scheduled message: due time, headers and body."""
    found = _with_broker(
        args, lambda b: b.scheduled_messages(destination=args.destination, message_ids=[args.message_id])
    )
    if not found:
        raise UsageError(f"no scheduled message {args.message_id!r} (delivered, cancelled or never scheduled)")
    data = _to_json(found[0])
    if args.json:
        print_json(data)
        return 0
    for k, v in data.items():
        print(f"{k:>14}: {v}")
    return 0


def cancel_scheduled(args: argparse.Namespace) -> int:
    """Cancel scheduled messages by id; exit 1 when none of them was still scheduled."""

    async def go(broker: Any) -> dict[str, bool]:
        out = {}
        for message_id in args.message_ids:
            out[message_id] = bool(await broker.cancel_scheduled([message_id], destination=args.destination))
        return out

    result = _with_broker(args, go)
    cancelled = [i for i, ok in result.items() if ok]
    missing = [i for i, ok in result.items() if not ok]
    if args.json:
        print_json({"cancelled": cancelled, "not_scheduled": missing})
    else:
        print(f"cancelled {len(cancelled)} scheduled message(s)")
        for i in missing:
            print(f"not scheduled (delivered, cancelled or unknown): {i}", file=sys.stderr)
    return 0 if cancelled else 1


def register(sub: Any) -> None:
    """Add ``schedule`` (list, show, cancel) to the ``framework`` command."""
    schedule = sub.add_parser("schedule", help="list, show and cancel scheduled messages")
    actions = schedule.add_subparsers(dest="schedule_action", required=True, metavar="{list,show,cancel}")

    p = actions.add_parser("list", help="messages waiting for their due time, earliest first")
    p.add_argument("--destination", help="only this queue/topic")
    p.add_argument("--limit", type=positive_int, default=100, help="at most this many (default 100)")
    p.add_argument("--json", action="store_true")
    connection_options(p)
    p.set_defaults(func=list_scheduled)

    p = actions.add_parser("show", help="one scheduled message: due time, headers and body")
    p.add_argument("message_id")
    p.add_argument("--destination", help="look only in this queue/topic")
    p.add_argument("--json", action="store_true")
    connection_options(p)
    p.set_defaults(func=show_scheduled)

    p = actions.add_parser("cancel", help="drop scheduled messages before they are delivered")
    p.add_argument("message_ids", nargs="+", metavar="MESSAGE_ID")
    p.add_argument("--destination", help="look only in this queue/topic")
    p.add_argument("--json", action="store_true")
    connection_options(p)
    p.set_defaults(func=cancel_scheduled)

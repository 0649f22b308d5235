"""``framework peek DEST``: the messages stored in a destination, read without consuming them.

Read-only (XRANGE on Redis streams: no group moves, nothing is acknowledged). Bodies are shown as
the dead-letter view shows them (:func:`framework.dead_letters.body_view`: secret fields redacted).
``--from`` takes a stream entry id (``1764150000000-0``), a time (ISO 8601, UTC unless it says
otherwise) or a duration ago (``10m``). Without ``--partition`` every partition is read and the
entries are merged in stream-id (time) order. RabbitMQ keeps no log (a message leaves its queue when
consumed): peek says so in one line.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from datetime import UTC, datetime
from typing import Any

import anyio

from broker import Broker, connect
from broker.capabilities import INTROSPECTION, as_introspection, supports
from broker.codec import decode_fields
from broker.errors import DecodeError
from broker.introspection import MessageLog
from framework.cli.args import duration, positive_int
from framework.cli.common import UsageError, connection_options, print_json
from framework.cli.hints import require_destination
from framework.dead_letters import body_view

__all__ = ["register", "start_id"]

_ENTRY_ID = re.compile(r"^\d+(-\d+)?$")


def start_id(text: str, now: float | None = None) -> str:
    """The XRANGE start of ``--from``: an entry id as given, a time or a duration ago as ``MS-0``."""
    text = text.strip()
    if _ENTRY_ID.match(text) and (len(text) >= 12 or "-" in text):  # a stream id (or its milliseconds)
        return text
    try:
        ago = duration(text)
    except argparse.ArgumentTypeError:
        pass
    else:
        return f"{int(((time.time() if now is None else now) - ago) * 1000)}-0"
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an entry id (1764150000000-0), a time (2026-11-26T11:00:00) or a duration ago (10m), "
            f"got {text!r}"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return f"{int(when.timestamp() * 1000)}-0"


def _order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _row(partition: int, entry_id: str, fields: dict[bytes, bytes], name: str, kind: Any) -> dict[str, Any]:
    """One entry as the JSON output shows it (undecodable entries say why)."""
    row: dict[str, Any] = {
        "partition": partition,
        "entry_id": entry_id,
        "stored_at": datetime.fromtimestamp(_order(entry_id)[0] / 1000, tz=UTC).isoformat(),
    }
    try:
        env = decode_fields(fields, name, kind)
    except DecodeError as exc:
        return {**row, "undecodable": str(exc), **body_view(fields.get(b"body", b""))}
    return {
        **row,
        "message_id": env.id,
        "type": env.type,
        "key": env.key,
        "attempt": env.attempt,
        "headers": env.headers,
        **body_view(env.body),
    }


async def _peek(broker: Broker, args: argparse.Namespace) -> list[dict[str, Any]] | str:
    """The rows to show, or the one line saying this transport keeps no log."""
    spec = await require_destination(broker, args.destination)
    log = as_introspection(broker) if supports(broker, INTROSPECTION) else None
    if not isinstance(log, MessageLog):
        return (
            f"{type(broker).__name__} keeps no log of {spec.name!r}: a message leaves its queue when it is "
            "consumed, so there is nothing to peek at (dead letters: framework dlq list)"
        )
    if args.partition is not None and not 0 <= args.partition < spec.partitions:
        raise UsageError(
            f"{spec.name!r} has {spec.partitions} partition(s): --partition is 0 to {spec.partitions - 1}, "
            f"not {args.partition}"
        )
    partitions = [args.partition] if args.partition is not None else list(range(spec.partitions))
    rows: list[tuple[tuple[int, int], int, str, dict[bytes, bytes]]] = []
    for p in partitions:
        for entry_id, fields in await log.read_entries(spec, p, args.start or "-", args.limit):
            rows.append((_order(entry_id), p, entry_id, fields))
    rows.sort(key=lambda r: r[0])
    return [_row(p, entry_id, fields, spec.name, spec.kind) for _, p, entry_id, fields in rows[: args.limit]]


def peek(args: argparse.Namespace) -> int:
    """Print the stored messages of a destination as a table, or as JSON."""

    async def go() -> list[dict[str, Any]] | str:
        broker = await connect(args.redis_url, namespace=args.namespace)
        try:
            return await _peek(broker, args)
        finally:
            await broker.close()

    rows = anyio.run(go)
    if isinstance(rows, str):
        print(rows)
        return 0
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        print(f"no messages stored in {args.destination!r}" + (" from there" if args.start else ""))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.destination}: {len(rows)} message(s), oldest first")
    for col in ("part", "entry id", "message id", "type", "key", "body"):
        table.add_column(col, overflow="fold")
    for r in rows:
        body = r.get("body") or (f"<{len(r['body_hex']) // 2} bytes, not UTF-8>" if "body_hex" in r else "")
        text = body if len(body) <= 160 else body[:160] + "..."
        cells = (r.get("message_id", "?"), r.get("type", ""), r.get("key") or "", text)
        table.add_row(str(r["partition"]), r["entry_id"], *cells)
    (Console() if sys.stdout.isatty() else Console(width=200)).print(table)
    return 0


def register(sub: Any) -> None:
    """Add ``peek`` to the ``framework`` command."""
    p = sub.add_parser("peek", help="show the messages stored in a destination (read-only; bodies redacted)")
    p.add_argument("destination", metavar="DEST")
    p.add_argument("--partition", type=int, default=None, metavar="N", help="only this partition (default: all)")
    p.add_argument(
        "--from",
        dest="start",
        type=start_id,
        default=None,
        metavar="ID|TIME",
        help="from this entry id, time (ISO 8601, UTC by default) or duration ago (10m); default: the oldest",
    )
    p.add_argument("--limit", type=positive_int, default=20, help="at most this many, oldest first (default 20)")
    p.add_argument("--json", action="store_true", help="machine-readable output, full bodies and headers")
    connection_options(p)
    p.set_defaults(func=peek)

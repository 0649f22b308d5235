"""The database outbox and the SQL inbox: messages that commit or roll back with your own rows.

Code outside handlers (an HTTP endpoint, a batch job) writes its business rows and its outgoing
messages in one SQLAlchemy transaction::

    async with engine.begin() as conn:
        await conn.execute(orders.insert().values(id=order_id, total=total))
        await outbox.add_event(conn, "orders.placed", OrderPlaced(order_id, total), key=order_id)

and an :class:`OutboxRelay` (``framework outbox relay``) publishes committed rows to the broker,
keeping each row's message id, so a re-publish after a crash is dropped by downstream inboxes.
Handlers whose effects live in the same database call :func:`claim_inbox` and :func:`stage` in
their transaction: exactly-once effects.

The tables (:mod:`framework.outbox.schema`, created by :func:`create_tables` or the plain SQL of
:func:`ddl`) and the relay (:mod:`framework.outbox.relay`) are re-exported here: this module is the
one import path for all of it.

Order per key is commit order: on PostgreSQL, :func:`stage` takes a transaction-level advisory
lock per key, so a second transaction adding to the same key waits until the first one ends and
``seq`` follows commit order. SQLite has a single writer, which gives the same.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from sqlalchemy import text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from broker import COMMAND, EVENT, DestinationSpec, Envelope, Kind, validate_name
from broker.codec import check_body_size, max_body_bytes
from framework._messages import Outgoing, build_envelope
from framework.handlers import Queue, Topic
from framework.observability import hooks
from framework.outbox.relay import OutboxRelay
from framework.outbox.schema import (
    DIALECTS,
    NOTIFY_CHANNEL,
    SHARDS,
    check_tables,
    create_tables,
    ddl,
    inbox_table,
    lock_id,
    metadata,
    outbox_table,
    sent_table,
    shards_table,
)
from framework.scheduling import with_due
from framework.sql import DatabaseUnavailable, create_engine

__all__ = [
    "NOTIFY_CHANNEL",
    "SHARDS",
    "DatabaseUnavailable",
    "OutboxRelay",
    "add",
    "add_command",
    "add_event",
    "check_tables",
    "claim_inbox",
    "create_engine",
    "create_tables",
    "ddl",
    "inbox_table",
    "metadata",
    "outbox_table",
    "sent_table",
    "shard_of",
    "shards_table",
    "stage",
]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)


# -- producing ------------------------------------------------------------------------------------------


def shard_of(key: str | None, message_id: str) -> int:
    """The shard of a message: by its key when it has one, else by its id."""
    return zlib.crc32((key if key is not None else message_id).encode()) % SHARDS


_LOCK_KEYS = text(
    "SELECT pg_advisory_xact_lock(k) FROM (SELECT k FROM unnest(CAST(:ids AS bigint[])) AS u(k) ORDER BY k) AS s"
)
_INSERT = {
    "postgresql": postgresql.insert(outbox_table).on_conflict_do_nothing(index_elements=["message_id"]),
    "sqlite": sqlite.insert(outbox_table).on_conflict_do_nothing(index_elements=["message_id"]),
}


def _dialect(conn: AsyncConnection) -> str:
    name = conn.dialect.name
    if name not in DIALECTS:
        raise ValueError(f"the outbox supports PostgreSQL and SQLite, not {name!r}")
    return name


def _row(env: Envelope, spec: DestinationSpec | None) -> dict[str, Any]:
    validate_name("destination", env.destination)
    if env.kind not in (COMMAND, EVENT):
        raise ValueError(f"kind must be 'command' or 'event', not {env.kind!r}")
    return {
        "message_id": env.id,
        "destination": env.destination,
        "kind": env.kind,
        "type": env.type,
        "key": env.key,
        "shard": shard_of(env.key, env.id),
        "headers": orjson.dumps(env.headers).decode(),
        "body": env.body,
        "spec": orjson.dumps(spec.to_json()).decode() if spec is not None else None,
        "created_at": _EPOCH + env.published_at * _MS,  # exact: no float
    }


async def stage(conn: AsyncConnection, messages: Sequence[Envelope | Outgoing]) -> None:
    """Insert prepared envelopes (or ``(envelope, spec)`` pairs) in the caller's transaction, keeping their ids.

    Never commits. A message id already in the table is not added again, so staging the same
    derived ids twice is harmless. On PostgreSQL this waits while another open transaction holds
    messages of one of these keys (per-key commit order); keys are locked in a fixed order.
    A body over the maximum size (``$FRAMEWORK_MAX_BODY_BYTES``, else 1 MiB) raises
    :class:`~broker.errors.MessageTooLarge` before anything is written: the relay could not publish it.
    """
    if not messages:
        return
    dialect = _dialect(conn)
    rows = []
    keys: set[str] = set()
    limit = max_body_bytes()
    stamp = hooks.TRACING  # the writer's trace context goes into the row: the relay's publish continues it
    for item in messages:
        env, spec = (item, None) if isinstance(item, Envelope) else item
        check_body_size(env, limit)
        if stamp:
            hooks.stamp_outbox((env,))
        rows.append(_row(env, spec))
        if env.key is not None:
            keys.add(env.key)
    if keys and dialect == "postgresql":
        await conn.execute(_LOCK_KEYS, {"ids": sorted({lock_id(k) for k in keys})})
    await conn.execute(_INSERT[dialect], rows)


_STAGE_PG = (
    "INSERT INTO framework_outbox (message_id, destination, kind, type, key, shard, headers, body, spec, created_at) "
    "VALUES (%(message_id)s, %(destination)s, %(kind)s, %(type)s, %(key)s, %(shard)s, %(headers)s, %(body)s, "
    "%(spec)s, %(created_at)s) ON CONFLICT (message_id) DO NOTHING"
)
_LOCK_KEYS_PG = "SELECT pg_advisory_xact_lock(k) FROM (SELECT k FROM unnest(%s::bigint[]) AS u(k) ORDER BY k) AS s"


async def _stage_pg(cursor: Any, messages: Sequence[Envelope | Outgoing]) -> None:
    """:func:`stage` on a psycopg 3 async cursor (PostgreSQL), without SQLAlchemy: the group commit's path.

    Same rows, same per-key locks, same size check; the insert is prepared once per connection.
    """
    if not messages:
        return
    rows = []
    keys: set[str] = set()
    limit = max_body_bytes()
    for item in messages:
        env, spec = (item, None) if isinstance(item, Envelope) else item
        check_body_size(env, limit)
        rows.append(_row(env, spec))
        if env.key is not None:
            keys.add(env.key)
    if keys:
        await cursor.execute(_LOCK_KEYS_PG, (sorted({lock_id(k) for k in keys}),), prepare=True)
    await cursor.executemany(_STAGE_PG, rows)


_NO_PAYLOAD: Any = object()


async def add(
    conn: AsyncConnection,
    destination: str | Queue | Topic | Envelope,
    payload: Any = _NO_PAYLOAD,
    *,
    kind: Kind | None = None,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
    type: str | None = None,
    message_id: str | None = None,
    delay: timedelta | float | None = None,
    at: datetime | None = None,
) -> str:
    """Add one message in the caller's transaction (never commits); return its message id.

    ``kind`` is ``"event"`` (a topic) or ``"command"`` (a queue); it is implied by a
    :class:`~framework.Topic`/:class:`~framework.Queue` destination and required with a name.
    The message is published by a relay once the transaction commits, and never if it rolls back.
    ``add(conn, envelope)`` adds a prepared :class:`~broker.Envelope` as it is (its id kept).
    ``delay`` (seconds or timedelta from now) or ``at`` (an aware datetime) schedules the message:
    the relay stores it with the broker when it publishes, to be delivered when due (a due time
    already past when the relay publishes is delivered at once). See :mod:`framework.scheduling`.
    """
    if isinstance(destination, Envelope):
        if payload is not _NO_PAYLOAD:
            raise TypeError("add(conn, envelope) takes no payload: the envelope carries its body")
        await stage(conn, [destination])
        return destination.id
    if payload is _NO_PAYLOAD:
        raise TypeError(f"add(conn, {destination!r}, payload): the payload is missing")
    if kind is None:
        if isinstance(destination, Topic):
            kind = EVENT
        elif isinstance(destination, Queue):
            kind = COMMAND
        else:
            raise TypeError(
                f"say whether {destination!r} is a topic or a queue: kind='event' or kind='command' "
                "(or use add_event / add_command)"
            )
    headers = with_due(dict(headers) if headers else None, delay, at)
    outgoing = build_envelope(destination, kind, payload, key=key, headers=headers, type=type, message_id=message_id)
    await stage(conn, [outgoing])
    return outgoing[0].id


async def add_event(conn: AsyncConnection, topic: str | Topic, event: Any, **options: Any) -> str:
    """:func:`add` an event for ``topic``; same options (key, headers, type, message_id, delay, at)."""
    return await add(conn, topic, event, kind=EVENT, **options)


async def add_command(conn: AsyncConnection, queue: str | Queue, command: Any, **options: Any) -> str:
    """:func:`add` a command for ``queue``; same options (key, headers, type, message_id, delay, at)."""
    return await add(conn, queue, command, kind=COMMAND, **options)


# -- inbox ----------------------------------------------------------------------------------------------

_CLAIM = {  # rowcount of an INSERT is only kept when asked for
    "postgresql": postgresql.insert(inbox_table).on_conflict_do_nothing().execution_options(preserve_rowcount=True),
    "sqlite": sqlite.insert(inbox_table).on_conflict_do_nothing().execution_options(preserve_rowcount=True),
}


async def claim_inbox(conn: AsyncConnection, group: str, message_id: str) -> bool:
    """Record ``message_id`` as processed by ``group`` in the caller's transaction.

    True the first time (go ahead: the record commits or rolls back with your effects), False if
    it is already recorded (a duplicate: skip it). On PostgreSQL a concurrent claim of the same id
    waits until the first transaction ends, then returns False if it committed.
    """
    result = await conn.execute(
        _CLAIM[_dialect(conn)],
        {"group_name": group, "message_id": message_id, "processed_at": datetime.now(UTC)},
    )
    return bool(result.rowcount == 1)

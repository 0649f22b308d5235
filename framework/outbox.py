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

Tables (see :func:`ddl`): ``framework_outbox`` (one row per message, ``seq`` gives insertion
order), ``framework_outbox_shards`` (the 64 shards relays claim, so that one key is published by one
relay at a time) and ``framework_inbox`` (processed message ids per consumer group).

Order per key is commit order: on PostgreSQL, :func:`stage` takes a transaction-level advisory
lock per key, so a second transaction adding to the same key waits until the first one ends and
``seq`` follows commit order. SQLite has a single writer, which gives the same.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.schema import CreateIndex, CreateTable

from broker import COMMAND, EVENT, DestinationSpec, Envelope, Kind, validate_name
from framework.messages import Outgoing, build_envelope
from framework.service import Queue, Topic
from framework.sql import DatabaseUnavailable, create_engine

__all__ = [
    "NOTIFY_CHANNEL",
    "SHARDS",
    "DatabaseUnavailable",
    "OutboxRelay",
    "add",
    "add_command",
    "add_event",
    "claim_inbox",
    "create_engine",
    "create_tables",
    "ddl",
    "inbox_table",
    "metadata",
    "outbox_table",
    "shard_of",
    "shards_table",
    "stage",
]

SHARDS = 64
"""Number of shards; a message's key (else its id) picks one. Part of the schema: do not change."""

NOTIFY_CHANNEL = "framework_outbox"
"""PostgreSQL channel the insert trigger notifies and relays LISTEN on."""

_DIALECTS = ("postgresql", "sqlite")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)

metadata = MetaData()
"""SQLAlchemy metadata of the outbox and inbox tables (for Alembic: include it in your target metadata)."""

outbox_table = Table(
    "framework_outbox",
    metadata,
    Column("seq", BigInteger().with_variant(Integer, "sqlite"), Identity(), primary_key=True,
           comment="insertion order; per key also commit order"),
    Column("message_id", String(200), nullable=False),
    Column("destination", String(200), nullable=False),
    Column("kind", String(7), nullable=False),
    Column("type", Text, nullable=False),
    Column("key", Text, nullable=True),
    Column("shard", SmallInteger, nullable=False, comment="crc32(key, else message_id) % 64"),
    Column("headers", Text, nullable=False, comment="JSON object of string headers"),
    Column("body", LargeBinary, nullable=False),
    Column("spec", Text, nullable=True, comment="JSON destination spec when added with a Queue/Topic"),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("sent_at", DateTime(timezone=True), nullable=True),
    Column("error", Text, nullable=True, comment="why the broker refused it; such rows wait for a retry"),
    CheckConstraint("kind IN ('command', 'event')", name="framework_outbox_kind"),
    UniqueConstraint("message_id", name="framework_outbox_message_id"),
    sqlite_autoincrement=True,
)
"""One row per outgoing message; pending while ``sent_at`` and ``error`` are NULL."""

_PENDING = outbox_table.c.sent_at.is_(None) & outbox_table.c.error.is_(None)
Index("framework_outbox_pending", outbox_table.c.seq, postgresql_where=_PENDING, sqlite_where=_PENDING)
Index("framework_outbox_pending_shard", outbox_table.c.shard, outbox_table.c.seq,
      postgresql_where=_PENDING).ddl_if(dialect="postgresql")
Index("framework_outbox_sent", outbox_table.c.sent_at, postgresql_where=outbox_table.c.sent_at.isnot(None),
      sqlite_where=outbox_table.c.sent_at.isnot(None))

shards_table = Table(
    "framework_outbox_shards",
    metadata,
    Column("shard", SmallInteger, primary_key=True, autoincrement=False),
)
"""One row per shard (0..63); a relay on PostgreSQL locks the rows of the shards it publishes."""

inbox_table = Table(
    "framework_inbox",
    metadata,
    Column("group_name", String(200), primary_key=True),
    Column("message_id", String(200), primary_key=True),
    Column("processed_at", DateTime(timezone=True), nullable=False),
    Index("framework_inbox_processed_at", "processed_at"),
)
"""Message ids a consumer group has processed (see :func:`claim_inbox`); cleaned after a window."""

_PG_NOTIFY = [
    f"""CREATE OR REPLACE FUNCTION framework_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('{NOTIFY_CHANNEL}', '');
    RETURN NULL;
END $$""",
    "DROP TRIGGER IF EXISTS framework_outbox_notify ON framework_outbox",
    """CREATE TRIGGER framework_outbox_notify AFTER INSERT ON framework_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION framework_outbox_notify()""",
]


def _statements(dialect_name: str) -> list[str]:
    if dialect_name not in _DIALECTS:
        raise ValueError(f"no outbox DDL for {dialect_name!r}: use one of {', '.join(_DIALECTS)}")
    dialect = postgresql.dialect() if dialect_name == "postgresql" else sqlite.dialect()
    out: list[str] = []
    for table in metadata.sorted_tables:
        out.append(str(CreateTable(table, if_not_exists=True).compile(dialect=dialect)).strip())
        for index in sorted(table.indexes, key=lambda i: i.name or ""):
            if index.name == "framework_outbox_pending_shard" and dialect_name != "postgresql":
                continue
            out.append(str(CreateIndex(index, if_not_exists=True).compile(dialect=dialect)).strip())
    rows = ", ".join(f"({i})" for i in range(SHARDS))
    out.append(f"INSERT INTO framework_outbox_shards (shard) VALUES {rows} ON CONFLICT DO NOTHING")
    if dialect_name == "postgresql":
        out += _PG_NOTIFY
    return out


def ddl(dialect_name: str) -> str:
    """The plain DDL creating the outbox and inbox tables (``postgresql`` or ``sqlite``).

    Idempotent (``IF NOT EXISTS``), so it can go into your own migration tool as it is; it is
    exactly what :func:`create_tables` runs. PostgreSQL also gets the NOTIFY trigger relays wake on.
    """
    return ";\n\n".join(_statements(dialect_name)) + ";\n"


async def create_tables(engine: AsyncEngine) -> None:
    """Create the outbox and inbox tables if they are missing (safe to run concurrently and repeatedly)."""
    async with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            await conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _lock_id("\x00create_tables")})
        for statement in _statements(conn.dialect.name):
            await conn.exec_driver_sql(statement)


# -- producing ------------------------------------------------------------------------------------------


def shard_of(key: str | None, message_id: str) -> int:
    """The shard of a message: by its key when it has one, else by its id."""
    return zlib.crc32((key if key is not None else message_id).encode()) % SHARDS


def _lock_id(key: str) -> int:
    digest = hashlib.blake2b(b"framework_outbox\x1f" + key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


_LOCK_KEYS = text(
    "SELECT pg_advisory_xact_lock(k) FROM (SELECT k FROM unnest(CAST(:ids AS bigint[])) AS u(k) ORDER BY k) AS s"
)
_INSERT = {
    "postgresql": postgresql.insert(outbox_table).on_conflict_do_nothing(index_elements=["message_id"]),
    "sqlite": sqlite.insert(outbox_table).on_conflict_do_nothing(index_elements=["message_id"]),
}


def _dialect(conn: AsyncConnection) -> str:
    name = conn.dialect.name
    if name not in _DIALECTS:
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
    """
    if not messages:
        return
    dialect = _dialect(conn)
    rows = []
    keys: set[str] = set()
    for item in messages:
        env, spec = (item, None) if isinstance(item, Envelope) else item
        rows.append(_row(env, spec))
        if env.key is not None:
            keys.add(env.key)
    if keys and dialect == "postgresql":
        await conn.execute(_LOCK_KEYS, {"ids": sorted({_lock_id(k) for k in keys})})
    await conn.execute(_INSERT[dialect], rows)


async def add(
    conn: AsyncConnection,
    destination: str | Queue | Topic,
    payload: Any,
    *,
    kind: Kind | None = None,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
    type: str | None = None,
    message_id: str | None = None,
) -> str:
    """Add one message in the caller's transaction (never commits); return its message id.

    ``kind`` is ``"event"`` (a topic) or ``"command"`` (a queue); it is implied by a
    :class:`~framework.Topic`/:class:`~framework.Queue` destination and required with a name.
    The message is published by a relay once the transaction commits, and never if it rolls back.
    """
    if kind is None:
        if isinstance(destination, Topic):
            kind = EVENT
        elif isinstance(destination, Queue):
            kind = COMMAND
        else:
            raise TypeError(f"say whether {destination!r} is a topic or a queue: kind='event' or kind='command' "
                            "(or use add_event / add_command)")
    outgoing = build_envelope(destination, kind, payload, key=key, headers=headers, type=type,
                              message_id=message_id)
    await stage(conn, [outgoing])
    return outgoing[0].id


async def add_event(conn: AsyncConnection, topic: str | Topic, event: Any, **options: Any) -> str:
    """:func:`add` an event for ``topic``; same options (key, headers, type, message_id)."""
    return await add(conn, topic, event, kind=EVENT, **options)


async def add_command(conn: AsyncConnection, queue: str | Queue, command: Any, **options: Any) -> str:
    """:func:`add` a command for ``queue``; same options (key, headers, type, message_id)."""
    return await add(conn, queue, command, kind=COMMAND, **options)


# -- inbox ----------------------------------------------------------------------------------------------

_CLAIM = {
    "postgresql": postgresql.insert(inbox_table).on_conflict_do_nothing(),
    "sqlite": sqlite.insert(inbox_table).on_conflict_do_nothing(),
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


# Defined last: the relay module imports the tables above.
from framework.outbox_relay import OutboxRelay  # noqa: E402

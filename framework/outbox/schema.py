"""The outbox and inbox tables: SQLAlchemy Core definitions, their plain DDL, and creating them.

``framework_outbox``        messages waiting to be published (``seq``: insertion order; per key
                            also commit order), or set aside with ``error`` when the broker refused them
``framework_outbox_sent``   published messages, moved there by the relay in the transaction that
                            published them; deleted after the relay's retention period
``framework_outbox_shards`` the 64 shards (a message's key, else its id, picks one); a relay on
                            PostgreSQL locks the shards it publishes, so one key has one publisher
``framework_inbox``         (group_name, message_id) a consumer group processed, with processed_at
``framework_saga_state``    state of sagas declared with ``sql=`` (one row per instance: version,
                            state JSON, pending timeouts; a tombstone once completed)

:func:`ddl` prints the same statements :func:`create_tables` runs, for your own migration tool.
"""

from __future__ import annotations

import hashlib
from typing import Any

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
    inspect,
    text,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.schema import CreateIndex, CreateTable

from framework.sql import DatabaseUnavailable, ping, redact_url

__all__ = [
    "DIALECTS",
    "NOTIFY_CHANNEL",
    "SHARDS",
    "check_tables",
    "create_tables",
    "ddl",
    "inbox_table",
    "lock_id",
    "metadata",
    "outbox_table",
    "saga_state_table",
    "sent_table",
    "shards_table",
]

DIALECTS = ("postgresql", "sqlite")
"""Databases the outbox supports."""

SHARDS = 64
"""Number of shards; a message's key (else its id) picks one. Part of the schema: do not change."""

NOTIFY_CHANNEL = "framework_outbox"
"""PostgreSQL channel the insert trigger notifies and relays LISTEN on."""

metadata = MetaData()
"""SQLAlchemy metadata of the outbox and inbox tables (for Alembic: include it in your target metadata)."""


def _message_columns() -> list[Column[Any]]:
    return [
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
    ]


outbox_table = Table(
    "framework_outbox",
    metadata,
    Column(
        "seq",
        BigInteger().with_variant(Integer, "sqlite"),
        Identity(),
        primary_key=True,
        comment="insertion order; per key also commit order",
    ),
    *_message_columns(),
    Column("error", Text, nullable=True, comment="why the broker refused it; set aside until retried"),
    CheckConstraint("kind IN ('command', 'event')", name="framework_outbox_kind"),
    UniqueConstraint("message_id", name="framework_outbox_message_id"),
    Index("framework_outbox_shard", "shard", "seq", postgresql_where=text("error IS NULL")).ddl_if(
        dialect="postgresql"
    ),
    sqlite_autoincrement=True,
)
"""Messages waiting to be published (``error`` NULL), or set aside because the broker refused them."""

sent_table = Table(
    "framework_outbox_sent",
    metadata,
    Column("seq", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=False),
    *_message_columns(),
    Column("sent_at", DateTime(timezone=True), nullable=False),
    # BRIN: sent_at grows with insertion order, and the index costs next to nothing to maintain
    Index("framework_outbox_sent_at", "sent_at", postgresql_using="brin"),
)
"""Published messages, moved here by the relay in the publishing transaction; kept for ``retention``."""

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

saga_state_table = Table(
    "framework_saga_state",
    metadata,
    Column("saga", String(200), primary_key=True, comment="<service>.<saga>"),
    Column("correlation", Text, primary_key=True, comment="the instance's correlation id"),
    Column("version", BigInteger, nullable=False, comment="raised by every saved step"),
    Column("state", Text, nullable=True, comment="JSON; NULL once completed"),
    Column("timeouts", Text, nullable=True, comment="JSON object: pending timeout id -> payload type"),
    Column("completed_at", DateTime(timezone=True), nullable=True, comment="set: a tombstone"),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    Index(
        "framework_saga_state_completed",
        "saga",
        "completed_at",
        postgresql_where=text("completed_at IS NOT NULL"),
        sqlite_where=text("completed_at IS NOT NULL"),
    ),
)
"""State of sagas that keep it in SQL (``Service.saga(..., sql=engine)``); see docs/sagas.md."""

_REQUIRED = ("framework_outbox", "framework_outbox_sent", "framework_outbox_shards", "framework_inbox")
# (what a relay and the SQL inbox need; a saga keeping its state in SQL checks its own table)

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
    if dialect_name not in DIALECTS:
        raise ValueError(f"no outbox DDL for {dialect_name!r}: use one of {', '.join(DIALECTS)}")
    dialect = (
        postgresql.dialect()  # type: ignore[no-untyped-call]  # SQLAlchemy: PGDialect_psycopg.__init__ unannotated
        if dialect_name == "postgresql"
        else sqlite.dialect()
    )

    def sql(construct: Any) -> str:
        return "\n".join(line.rstrip() for line in str(construct.compile(dialect=dialect)).strip().splitlines())

    out: list[str] = []
    for table in metadata.sorted_tables:
        out.append(sql(CreateTable(table, if_not_exists=True)))
        for index in sorted(table.indexes, key=lambda i: i.name or ""):
            if index.name == "framework_outbox_shard" and dialect_name != "postgresql":
                continue  # only PostgreSQL relays claim shards
            out.append(sql(CreateIndex(index, if_not_exists=True)))
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
    header = (
        f"-- framework outbox and inbox tables for {dialect_name} (framework.outbox.schema).\n"
        "-- Idempotent: safe to apply again. Generated by `framework outbox ddl`.\n\n"
    )
    return header + ";\n\n".join(_statements(dialect_name)) + ";\n"


async def create_tables(engine: AsyncEngine) -> None:
    """Create the outbox and inbox tables if they are missing (safe to run concurrently and repeatedly)."""
    async with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            await conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": lock_id("\x00create_tables")})
        for statement in _statements(conn.dialect.name):
            await conn.exec_driver_sql(statement)


async def check_tables(engine: AsyncEngine) -> None:
    """Check the database answers and holds the outbox and inbox tables; raise DatabaseUnavailable if not."""
    await ping(engine)
    names = list(_REQUIRED)
    async with engine.connect() as conn:
        missing = await conn.run_sync(lambda c: [n for n in names if not inspect(c).has_table(n)])
    if missing:
        raise DatabaseUnavailable(
            f"table(s) {', '.join(missing)} missing in {redact_url(engine.url)}: run `framework outbox migrate "
            "--database-url URL` (or apply `framework outbox ddl` with your migration tool)"
        )


def lock_id(name: str) -> int:
    """The 64-bit PostgreSQL advisory lock id the outbox uses for ``name`` (a message key, say)."""
    digest = hashlib.blake2b(b"framework_outbox\x1f" + name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)

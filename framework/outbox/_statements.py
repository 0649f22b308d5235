"""The statements the outbox relay runs: claim shards, read rows, move them to sent, clean up.

Internal to :mod:`framework.outbox.relay`. PostgreSQL statements are plain SQL for psycopg (the
hot path reads through psycopg's binary protocol: half the cost of SQLAlchemy's row layer);
SQLite statements are SQLAlchemy Core (it stores datetimes as text).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import DateTime, bindparam, delete, insert, select, tuple_, update

from framework.outbox.schema import inbox_table, outbox_table, sent_table

__all__ = [
    "MARK_REFUSED",
    "PG_CLAIM",
    "PG_MOVE",
    "PG_ROWS",
    "SQLITE_ANY_WAITING",
    "SQLITE_COPY",
    "SQLITE_DELETE",
    "SQLITE_ROWS",
    "Row",
    "cleanup_statements",
]

# A row as the relay reads it: (seq, message_id, destination, kind, type, key, headers, body, spec, created_ms)
Row = tuple[int, str, str, str, str, "str | None", str, bytes, "str | None", int]
_COLUMNS = "message_id, destination, kind, type, key, shard, headers, body, spec, created_at"

# PostgreSQL. These run on the psycopg connection under SQLAlchemy's transaction: reading through
# psycopg's binary protocol costs half of what SQLAlchemy's row layer does, and this is the hot path.
PG_CLAIM = """
    SELECT s.shard FROM framework_outbox_shards AS s
    WHERE EXISTS (SELECT 1 FROM framework_outbox AS o WHERE o.shard = s.shard AND o.error IS NULL)
    ORDER BY (SELECT min(o.seq) FROM framework_outbox AS o WHERE o.shard = s.shard AND o.error IS NULL)
    LIMIT %(limit)s
    FOR UPDATE OF s SKIP LOCKED
"""
PG_ROWS = """
    SELECT seq, message_id, destination, kind, type, key, headers, body, spec,
           (extract(epoch FROM created_at) * 1000)::bigint
    FROM framework_outbox
    WHERE error IS NULL AND shard = ANY(%(shards)s)
    ORDER BY seq LIMIT %(limit)s
"""
# Moving a row costs about a third of updating it in place: no new index entries in the outbox table.
PG_MOVE = f"""
    WITH moved AS (DELETE FROM framework_outbox WHERE seq = ANY(%(seqs)s) RETURNING seq, {_COLUMNS})
    INSERT INTO framework_outbox_sent (seq, {_COLUMNS}, sent_at) SELECT seq, {_COLUMNS}, %(now)s FROM moved
"""

# SQLite (through SQLAlchemy, which stores its datetimes as text): one writer at a time, and a
# lock-free read decides whether to take the write lock at all.
_o, _s, _i = outbox_table, sent_table, inbox_table
SQLITE_ANY_WAITING = select(_o.c.seq).where(_o.c.error.is_(None)).limit(1)
SQLITE_ROWS = (
    select(
        _o.c.seq,
        _o.c.message_id,
        _o.c.destination,
        _o.c.kind,
        _o.c.type,
        _o.c.key,
        _o.c.headers,
        _o.c.body,
        _o.c.spec,
        _o.c.created_at,
    )
    .where(_o.c.error.is_(None))
    .order_by(_o.c.seq)
    .limit(bindparam("limit"))
)
SQLITE_COPY = insert(_s).from_select(
    ["seq", *_COLUMNS.split(", "), "sent_at"],
    select(_o.c.seq, *(_o.c[c] for c in _COLUMNS.split(", ")), bindparam("now", type_=DateTime(timezone=True))).where(
        _o.c.seq.in_(bindparam("seqs", expanding=True))
    ),
)
SQLITE_DELETE = delete(_o).where(_o.c.seq.in_(bindparam("seqs", expanding=True)))
MARK_REFUSED = update(_o).where(_o.c.seq == bindparam("b_seq")).values(error=bindparam("b_error"))


def cleanup_statements(postgres: bool) -> tuple[Any, Any]:
    """DELETEs of sent rows and inbox records older than ``:cutoff``, ``:limit`` at a time."""
    sent = select(_s.c.seq).where(_s.c.sent_at < bindparam("cutoff")).limit(bindparam("limit"))
    seen = (
        select(_i.c.group_name, _i.c.message_id)
        .where(_i.c.processed_at < bindparam("cutoff"))
        .limit(bindparam("limit"))
    )
    if postgres:  # two relays cleaning at once split the rows instead of waiting for each other
        sent, seen = sent.with_for_update(skip_locked=True), seen.with_for_update(skip_locked=True)
    return (delete(_s).where(_s.c.seq.in_(sent)), delete(_i).where(tuple_(_i.c.group_name, _i.c.message_id).in_(seen)))

"""The service the SQL-effects benchmark runs: the users' path, ``ctx.sql_transaction`` per message.

A worker is ``python -m framework run benchmarks.sql_services:service``, told through its
environment which database to write to (``BENCH_DATABASE_URL``) and where to report latencies
(``BENCH_NAMESPACE``). Its one handler, per message:

1. opens ``ctx.sql_transaction(engine)`` (the framework records the message in its SQL inbox,
   ``framework_inbox``, in the same transaction: with the group's commit, in a worker);
2. does :data:`WORK_S` of work inside the transaction (``await anyio.sleep``, like a call to
   another service or a slow query): ``BENCH_WORK_MS`` milliseconds, default 2; at 0 nothing is
   awaited (the framework's own cost alone);
3. raises if the message says so (``fail``: the soak benchmark's always-failing messages, which
   go through the retries to the dead-letter stream), else inserts one row into
   :data:`EFFECTS_TABLE`; the block commits;
4. if the message asks for it (``record``), pushes ``seq:publish-to-commit ns`` to the latency
   list :func:`latency_key` after the commit (only the latency phase sets it: one round trip).

``BENCH_VARIANT`` (for :mod:`benchmarks.sql_breakdown` only) runs part of that handler, to
split its CPU between the runtime, the SQL block and the statement: ``sleep`` (the work alone, no
block), ``block`` (the block and the work, no statement), ``driver`` (the row through the psycopg
connection under the SQLAlchemy one, no SQLAlchemy layers); unset or ``full``: the handler above.

The engine is the framework's own (``framework.outbox.create_engine``: SQLAlchemy, psycopg 3,
its default pool), created lazily in the worker, as a user would. ``BENCH_INBOX=sql`` declares the
service ``inbox="sql"`` (no Redis inbox), else the Redis inbox is on (the default).
The plain consumer (:mod:`benchmarks.plain_sql_consumer`) reads the same messages and writes the
same rows, so both are measured on identical work.
"""

from __future__ import annotations

import os
import time
from typing import Any

import anyio
import attrs
from sqlalchemy import text

from framework import BatchContext, BatchPolicy, Context, Queue, Service

__all__ = [
    "EFFECTS_TABLE",
    "GROUP",
    "PLAIN_INBOX_TABLE",
    "SQL_QUEUE",
    "WORK_S",
    "AlwaysFails",
    "SqlMessage",
    "ddl",
    "latency_key",
    "service",
    "stream_key",
]

SQL_QUEUE = Queue("bench.sql")
GROUP = "sqlbench"  # the service name is the consumer group
WORK_S = float(os.environ.get("BENCH_WORK_MS", "2")) / 1000  # seconds of work per message, in the transaction
EFFECTS_TABLE = "bench_effects"
PLAIN_INBOX_TABLE = "plain_inbox"


@attrs.frozen
class SqlMessage:
    """One message of the benchmark: its sequence number, when it was published, what to do with it."""

    seq: int
    sent_ns: int
    record: bool = False  # push publish-to-commit latency to Redis after the commit
    fail: bool = False  # raise inside the transaction, every attempt (soak: 1% of messages)


class AlwaysFails(Exception):
    """Raised by the handler for messages marked ``fail``: retried, then dead-lettered."""


def stream_key(namespace: str) -> str:
    """The stream of the queue's only partition in ``namespace``."""
    return f"{namespace}:{{{SQL_QUEUE.name}:0}}"


def latency_key(namespace: str) -> str:
    """List of ``seq:latency_ns`` samples (publish to commit), written after each recorded commit."""
    return f"{namespace}:bench:sql:latency"


def ddl() -> list[str]:
    """The benchmark's own tables: the effects both consumers write, and the plain consumer's inbox.

    The effects table has no unique constraint on ``seq``, so a message applied twice shows as two rows.
    The plain inbox has the shape of the framework's (``(group_name, message_id)`` key, ``processed_at``).
    """
    return [
        f"CREATE TABLE IF NOT EXISTS {EFFECTS_TABLE} ("
        "id bigserial PRIMARY KEY, seq bigint NOT NULL, sent_ns bigint NOT NULL, "
        "created_at timestamptz NOT NULL DEFAULT now())",
        f"CREATE TABLE IF NOT EXISTS {PLAIN_INBOX_TABLE} ("
        "group_name text NOT NULL, message_id text NOT NULL, processed_at timestamptz NOT NULL DEFAULT now(), "
        "PRIMARY KEY (group_name, message_id))",
    ]


_INSERT = text(f"INSERT INTO {EFFECTS_TABLE} (seq, sent_ns) VALUES (:seq, :sent_ns)")
_engine: Any = None


def engine() -> Any:
    """The worker's engine on ``$BENCH_DATABASE_URL``, created on first use with the framework's defaults."""
    global _engine
    if _engine is None:
        from framework import outbox

        _engine = outbox.create_engine(os.environ["BENCH_DATABASE_URL"])
    return _engine


service = Service(GROUP, inbox="sql" if os.environ.get("BENCH_INBOX") == "sql" else True)
_VARIANT = os.environ.get("BENCH_VARIANT", "full")
_DRIVER_INSERT = f"INSERT INTO {EFFECTS_TABLE} (seq, sent_ns) VALUES (%s, %s)"


@service.command(SQL_QUEUE)
async def apply(msg: SqlMessage, ctx: Context) -> None:
    """The work (2 ms by default) and one row, inside the framework's SQL transaction (its inbox row with it)."""
    if _VARIANT == "sleep":
        if WORK_S:
            await anyio.sleep(WORK_S)
        return
    async with ctx.sql_transaction(engine()) as conn:
        if WORK_S:
            await anyio.sleep(WORK_S)
        if msg.fail:
            raise AlwaysFails(f"message {msg.seq} always fails")
        if _VARIANT == "block":
            return
        if _VARIANT == "driver":
            raw = (await conn.get_raw_connection()).driver_connection
            await raw.execute(_DRIVER_INSERT, (msg.seq, msg.sent_ns))
            return
        await conn.execute(_INSERT, {"seq": msg.seq, "sent_ns": msg.sent_ns})
    if msg.record:
        committed = time.time_ns()
        await ctx.redis.rpush(latency_key(os.environ["BENCH_NAMESPACE"]), f"{msg.seq}:{committed - msg.sent_ns}")


BATCH_SIZE = 100
"""Messages per batch of :data:`batch_service` (the plain consumer's batch size)."""
batch_service = Service(GROUP, inbox="sql" if os.environ.get("BENCH_INBOX") == "sql" else True)


@batch_service.command(SQL_QUEUE, batch=BatchPolicy(max_size=BATCH_SIZE, max_wait=0.005))
async def apply_batch(msgs: list[SqlMessage], ctx: BatchContext) -> None:
    """The same work and rows as :func:`apply`, as a batch handler: one transaction and one
    ``executemany`` per batch (what the plain consumer does), the work per message in turn."""
    async with ctx.sql_transaction(engine()) as conn:
        for msg in msgs:
            if WORK_S:
                await anyio.sleep(WORK_S)
            if msg.fail:
                raise AlwaysFails(f"message {msg.seq} always fails")
        if _VARIANT == "driver":  # the plain consumer's statement on the same connection, no SQLAlchemy layers
            raw = (await conn.get_raw_connection()).driver_connection
            async with raw.cursor() as cur:
                await cur.executemany(_DRIVER_INSERT, [(m.seq, m.sent_ns) for m in msgs])
        else:
            await conn.execute(_INSERT, [{"seq": m.seq, "sent_ns": m.sent_ns} for m in msgs])
    recorded = [f"{m.seq}:{time.time_ns() - m.sent_ns}" for m in msgs if m.record]
    if recorded:
        await ctx[0].redis.rpush(latency_key(os.environ["BENCH_NAMESPACE"]), *recorded)

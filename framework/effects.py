"""Exactly-once effects: handler writes committed atomically with the inbox mark and the ack.

``ctx.redis_transaction()`` collects Redis writes in a recorder the Redis transport makes
(``broker.redis.effects``); when the handler returns they run in one Lua call together with the
handler's outgoing messages, the inbox mark and the ack (``commit_effects``, which a saga step's
typed state operations go through too, on any transport with the ``state`` capability). If the
message was already processed (a duplicate that slipped past the batch check) nothing is applied.

``ctx.sql_transaction(engine)`` runs the block in a SQL transaction that records the message in
the inbox table; a message recorded before raises :class:`AlreadyProcessed`, which the runtime
acknowledges without keeping anything of the block. Messages staged inside the block are written
to the outbox table in the same transaction; the outbox relay publishes them. Everything after the
block is not exactly-once: if the handler fails after the commit, its retry finds the message
processed and skips the rest, so every effect and every send belongs inside the block (staging
after it logs a warning). Outside a worker, and on SQLite, the inbox row is the transaction's
first statement (``INSERT ... ON CONFLICT DO NOTHING``). In a worker on PostgreSQL the transaction
is shared by several handlers' blocks, their inbox rows written with its commit, and the block
returns once it committed (see :mod:`framework.group_commit`, which says when a block runs again).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from broker.capabilities import RedisTransaction
from framework._sql_block import AlreadyProcessed

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

    from framework._sql_block import SqlRun

__all__ = ["AlreadyProcessed", "RedisEffects", "sql_transaction"]


RedisEffects = RedisTransaction
"""What ``ctx.redis_transaction()`` returns: the Redis transport's recorder of Redis writes
(``broker.redis.effects.RedisEffects``), typed by :class:`broker.capabilities.RedisTransaction`:
``tx.call("HINCRBY", key, field, 5)`` or ``tx.hincrby(key, field, 5)``, ``tx.expect(key, field,
value)`` (a guard), ``tx.after_commit(fn)``."""


def sql_transaction(ctx: SqlRun, engine: AsyncEngine) -> contextlib.AbstractAsyncContextManager[AsyncConnection]:
    """See :meth:`framework.Context.sql_transaction`.

    In a running worker on PostgreSQL the block is a member of a group commit
    (:mod:`framework.group_commit`); elsewhere (SQLite, outside a runtime) it is its own transaction.
    """
    from framework import group_commit

    groups = group_commit.current()
    committer = groups.for_engine(engine) if groups is not None else None
    if committer is not None:
        return committer.transaction(ctx)
    return _own_transaction(ctx, engine)


@contextlib.asynccontextmanager
async def _own_transaction(ctx: SqlRun, engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """One transaction for the block: the inbox row first, the staged messages last."""
    from framework import outbox

    async with engine.begin() as conn:
        if not await outbox.claim_inbox(conn, ctx.service, ctx.message_id):
            raise AlreadyProcessed(f"message {ctx.message_id} was already processed by {ctx.service}")
        before = len(ctx.outgoing)
        yield conn
        staged = ctx.outgoing[before:]
        if staged:
            await outbox.stage(conn, staged)  # with their specs: the relay declares Queue/Topic layouts
            ctx._unstage_from(before)
    ctx._sql_committed()

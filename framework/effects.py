"""Exactly-once effects: handler writes committed atomically with the inbox mark and the ack.

``ctx.redis_transaction()`` collects Redis writes; when the handler returns they run in one Lua
call together with the handler's outgoing messages, the inbox mark and the ack. If the message
was already processed (a duplicate that slipped past the batch check) nothing is applied.

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
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from framework._sql_block import AlreadyProcessed

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

    from framework._sql_block import SqlRun

__all__ = ["AlreadyProcessed", "RedisEffects", "sql_transaction"]


class RedisEffects:
    """Redis writes recorded by a handler, applied atomically when it succeeds.

    ``tx.call("HINCRBY", key, field, 5)`` or ``tx.hincrby(key, field, 5)``. The first argument
    is taken as the key; pass ``keys=[...]`` for commands that touch several. Writes are applied
    after the handler returns, so read current values before (``ctx.redis``). On a Redis Cluster
    every key must carry the message's hash tag (``ctx.hash_tag``).
    """

    def __init__(self) -> None:
        self.commands: list[tuple[Any, ...]] = []
        self.keys: list[str] = []
        self.applied: list[Callable[[], object]] = []  # run once the commit applied the writes

    def after_commit(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` in the worker once these writes were applied (not when the message turned out a
        duplicate, a guard failed, the commit failed or its outcome is unknown)."""
        self.applied.append(fn)

    def call(self, command: str, *args: Any, keys: Sequence[str] | None = None) -> None:
        """Record one write command."""
        self.commands.append((command, *args))
        if keys is not None:
            self.keys += keys
        elif args:
            self.keys.append(str(args[0]))

    def expect(self, key: str, field: str, value: str | int | None) -> None:
        """A guard: apply nothing unless hash field ``key``/``field`` still holds ``value`` (None:
        absent) at commit. A changed value makes the commit raise
        :class:`~broker.errors.EffectsConflict` having written, sent and acked nothing."""
        self.commands.append(("__EXPECT__", key, field, "" if value is None else str(value)))
        self.keys.append(key)

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, keys=None: self.call(name.upper(), *args, keys=keys)


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

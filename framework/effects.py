"""Exactly-once effects: handler writes committed atomically with the inbox mark and the ack.

``ctx.redis_transaction()`` collects Redis writes; when the handler returns they run in one Lua
call together with the handler's outgoing messages, the inbox mark and the ack. If the message
was already processed (a duplicate that slipped past the batch check) nothing is applied.

``ctx.sql_transaction(engine)`` opens a SQL transaction whose first statement records the message
in the inbox table (``INSERT ... ON CONFLICT DO NOTHING``); a duplicate raises
:class:`AlreadyProcessed`, which the runtime acknowledges without running the rest. Messages staged
inside the block are written to the outbox table in the same transaction; the outbox relay
publishes them. Everything after the block is not exactly-once: if the handler fails after the
commit, its retry finds the message processed and skips the rest, so every effect and every send
belongs inside the block (staging after it logs a warning).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

    from framework.context import Context

__all__ = ["AlreadyProcessed", "RedisEffects", "sql_transaction"]


class AlreadyProcessed(Exception):
    """The message was processed before (found in the inbox): the runtime acks it, no retry."""


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

    def call(self, command: str, *args: Any, keys: Sequence[str] | None = None) -> None:
        """Record one write command."""
        self.commands.append((command, *args))
        if keys is not None:
            self.keys += keys
        elif args:
            self.keys.append(str(args[0]))

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, keys=None: self.call(name.upper(), *args, keys=keys)


@contextlib.asynccontextmanager
async def sql_transaction(ctx: Context, engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """See :meth:`framework.Context.sql_transaction`."""
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

"""The context a batch handler receives: one :class:`~framework.Context` per message, one SQL transaction.

``ctx[i]`` is the context of the batch's ``i``-th message: its metadata, and ``send``/``publish``
staging messages on its behalf (ids derived from its id, sent only if it succeeds), and
``redis_transaction()`` (its writes committed with its own ack). ``ctx.sql_transaction(engine)``
is one transaction for the whole batch: the effects, the inbox row of every message and the
messages staged inside the block (to the outbox table) commit together. See docs/batch-handlers.md.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Iterator, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from framework.batching import BatchFailed, checked_failures
from framework.context import Context
from framework.handlers import Handler, HandlerError
from framework.lifespan import RESOURCES, Resources

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

__all__ = ["BatchContext", "BatchDuplicates"]


class BatchDuplicates(Exception):
    """The batch's SQL block found these messages (indexes) processed before: nothing was applied.

    Raised by the block before its body runs; the runtime acknowledges them as duplicates and runs
    the handler again with the others, so a redelivered batch applies nothing twice.
    """

    def __init__(self, indexes: list[int]) -> None:
        self.indexes = indexes
        super().__init__(f"{len(indexes)} message(s) of the batch were processed before")


class BatchContext:
    """A batch handler's context: ``ctx[i]`` per message, ``ctx.sql_transaction(engine)`` for the batch."""

    __slots__ = ("_committed", "_handler", "_sql_used", "messages")

    def __init__(self, contexts: Sequence[Context], handler: Handler) -> None:
        self.messages: list[Context] = list(contexts)
        """One :class:`~framework.Context` per message, in the batch's order."""
        self._handler = handler
        self._sql_used = False
        self._committed: set[int] = set()  # indexes whose inbox rows the SQL block committed

    def __len__(self) -> int:
        return len(self.messages)

    def __getitem__(self, index: int) -> Context:
        return self.messages[index]

    def __iter__(self) -> Iterator[Context]:
        return iter(self.messages)

    @property
    def service(self) -> str:
        """The handling service's name."""
        return self._handler.service

    @property
    def handler(self) -> str:
        """The handler's name."""
        return self._handler.name

    @property
    def destination(self) -> str:
        """The queue or topic the batch came from."""
        return self._handler.destination.name

    @property
    def resources(self) -> Resources:
        """The services' resources open in this process: ``ctx.resources[db]`` (see :mod:`framework.lifespan`)."""
        return RESOURCES

    @property
    def partition(self) -> int:
        """The partition every message of the batch came from."""
        return self.messages[0].partition

    def send(self, *_: Any, **__: Any) -> Any:
        """Not on the batch: stage a message on behalf of the message it belongs to, ``ctx[i].send(...)``."""
        raise HandlerError("a batch handler stages messages per message: ctx[i].send(...) (sent if message i succeeds)")

    def publish(self, *_: Any, **__: Any) -> Any:
        """Not on the batch: ``ctx[i].publish(...)``."""
        raise HandlerError(
            "a batch handler stages messages per message: ctx[i].publish(...) (published if message i succeeds)"
        )

    def redis_transaction(self) -> Any:
        """Not on the batch: ``ctx[i].redis_transaction()`` commits message i's writes with its own ack."""
        raise HandlerError(
            "a batch handler records Redis writes per message: ctx[i].redis_transaction() (applied with message "
            "i's ack); for one transaction over the batch use ctx.sql_transaction(engine)"
        )

    def sql_transaction(self, engine: AsyncEngine) -> contextlib.AbstractAsyncContextManager[AsyncConnection]:
        """One SQL transaction for the batch: its effects, every message's inbox row and the messages
        staged inside the block (to the outbox table) commit together, once per batch run.

        Messages processed before (a redelivered batch) are taken out of the batch before the
        block runs (:class:`BatchDuplicates`). :class:`~framework.batching.BatchFailed` raised inside
        the block commits the block with the inbox rows (and staged messages) of the other messages
        only; with ``all_or_nothing``, and for any other exception, the block rolls back.
        """
        if self._sql_used:
            raise HandlerError("ctx.sql_transaction is one transaction per batch: open it once per handler run")
        self._sql_used = True
        return self._transaction(engine)

    @property
    def committed(self) -> set[int]:
        """Indexes of the messages whose inbox rows the batch's SQL block committed."""
        return self._committed

    @contextlib.asynccontextmanager
    async def _transaction(self, engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
        from framework import outbox

        contexts = self.messages
        service = self._handler.service
        failed: dict[int, BaseException] = {}
        raised: BatchFailed | None = None
        async with engine.begin() as conn:
            claimed = await _claim(conn, service, [c.message_id for c in contexts])
            seen = [i for i, c in enumerate(contexts) if c.message_id not in claimed]
            if seen:
                raise BatchDuplicates(seen)  # rolls back: nothing of this run is kept
            marks = [len(c.outgoing) for c in contexts]
            try:
                yield conn
            except BatchFailed as exc:
                batch = self._handler.batch
                if batch is not None and batch.all_or_nothing:
                    raise
                failed = checked_failures(exc, len(contexts))  # a bad index rolls everything back
                raised = exc
            staged = []
            for i, c in enumerate(contexts):
                if i not in failed:
                    staged += c.outgoing[marks[i] :]
                c._unstage_from(marks[i])  # a failed message's staged messages are dropped with it
            if failed:
                await _unclaim(conn, service, [contexts[i].message_id for i in failed])
            if staged:
                await outbox.stage(conn, staged)
        for i, c in enumerate(contexts):
            if i not in failed:
                c._sql_committed()
                self._committed.add(i)
        if raised is not None:
            raise raised


@functools.cache
def _pg_claim() -> Any:
    """The PostgreSQL claim of a batch: one statement (compiled once) whatever the batch's size,
    inserting in the ids' order (sorted by the caller: concurrent batches lock rows in one order)."""
    from sqlalchemy import text

    return text(
        "INSERT INTO framework_inbox (group_name, message_id, processed_at) "
        "SELECT :group, t.id, now() FROM unnest(CAST(:ids AS text[])) WITH ORDINALITY AS t(id, n) ORDER BY t.n "
        "ON CONFLICT DO NOTHING RETURNING message_id"
    )


async def _claim(conn: AsyncConnection, group: str, message_ids: list[str]) -> set[str]:
    """Insert the inbox rows of ``message_ids`` (sorted: concurrent batches lock them in one order);
    return the ids inserted now (the others were recorded before)."""
    from sqlalchemy.dialects import sqlite

    from framework.outbox import inbox_table

    ids = sorted(set(message_ids))
    if conn.dialect.name == "postgresql":
        return set((await conn.execute(_pg_claim(), {"group": group, "ids": ids})).scalars().all())
    now = datetime.now(UTC)
    rows = [{"group_name": group, "message_id": m, "processed_at": now} for m in ids]
    statement = sqlite.insert(inbox_table).values(rows).on_conflict_do_nothing().returning(inbox_table.c.message_id)
    return set((await conn.execute(statement)).scalars().all())


async def _unclaim(conn: AsyncConnection, group: str, message_ids: list[str]) -> None:
    """Take back the inbox rows of the failed messages: their retries run again."""
    from framework.outbox import inbox_table

    table = inbox_table
    await conn.execute(
        table.delete().where(table.c.group_name == group, table.c.message_id.in_(message_ids)),
    )

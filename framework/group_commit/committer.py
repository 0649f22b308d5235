"""The group committer: a handler's SQL block as a member of the transaction open on a link.

:class:`GroupCommitter` runs the members (joining, the duplicate lookup, savepoints, undoing a
failed block, waiting for the commit); :class:`~framework.group_commit.links.LinkPool`, its base,
owns the links and ends their transactions. See :mod:`framework.group_commit` for the whole.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import anyio

from framework._sql_block import AlreadyProcessed
from framework.group_commit.links import GroupCommitFailed, LinkPool, RolledBackWithGroup, _Group, _Link, _literal

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection

    from framework._sql_block import SqlRun

__all__ = ["SAVEPOINT_ABOVE", "GroupCommitter"]

SAVEPOINT_ABOVE = 0.1
"""Members open a savepoint first while the moving failure rate of blocks is above this."""
_DECAY = 1 / 64  # weight of the newest block in the failure rate

_INERROR_STATUS = 3  # psycopg.pq.TransactionStatus.INERROR: a statement failed, the transaction cannot commit


class GroupCommitter(LinkPool):
    """Group commit on one engine (see :mod:`framework.group_commit`)."""

    # -- members ----------------------------------------------------------------------------------

    def _opening(self, link: _Link, ctx: SqlRun, service: str, message_id: str) -> str | None:
        """What a joining member sends before its block runs (None: nothing, the common case)."""
        parts = []
        if link.group is None:
            link.group = _Group()
            parts.append("BEGIN")
        elif link.members and self.failure_rate > SAVEPOINT_ABOVE:
            parts.append("RELEASE SAVEPOINT fw; SAVEPOINT fw" if link.savepoint else "SAVEPOINT fw")
            link.savepoint = True
        else:  # an earlier member's savepoint is not this one's: undoing to it would undo that member too
            link.savepoint = False
        if ctx.attempt > 1:  # a retry or a redelivery: an earlier run may have committed
            parts.append(f"SELECT 1 FROM framework_inbox WHERE group_name = {service} AND message_id = {message_id}")
        return "; ".join(parts) if parts else None

    @contextlib.asynccontextmanager
    async def transaction(self, ctx: SqlRun) -> AsyncIterator[AsyncConnection]:
        """One handler's block as a member of the transaction on a link (see the module docstring)."""
        from framework import outbox

        key = (ctx.service, ctx.message_id)
        service, message_id = self._service_literal(key[0]), _literal(key[1])  # a bad id fails here, early
        link = await self._acquire()
        started = time.monotonic()
        group = link.group
        if group is not None and key in group.ids:  # a copy of an earlier member: its outcome decides
            with anyio.CancelScope(shield=True):
                await self._release(link)
            await group.done.wait()
            self._raise(ctx, group.outcome(key))
            raise AlreadyProcessed(f"message {key[1]} was already processed by {key[0]}")
        query = self._opening(link, ctx, service, message_id)
        group = link.group
        assert group is not None
        if query is not None:
            with anyio.CancelScope(shield=True):  # a link must be released, whatever happens
                try:
                    cur = link.cursor
                    await cur.execute(query)
                    if ctx.attempt > 1:
                        while cur.nextset():  # the lookup's result is the last one
                            pass
                        if cur.rowcount:
                            await self._release(link)  # nothing written: the next member goes on
                            raise AlreadyProcessed(f"message {key[1]} was already processed by {key[0]}")
                except AlreadyProcessed:
                    raise
                except BaseException as exc:
                    await self._fail_member(link, exc)
                    await self._release(link)
                    raise
        before = len(ctx.outgoing)
        try:
            yield link.conn
            if link.raw.info.transaction_status == _INERROR_STATUS:
                raise GroupCommitFailed(
                    "a statement failed inside ctx.sql_transaction and the error was caught: "
                    "the block's transaction cannot commit (let the error propagate, or use "
                    "conn.begin_nested() around statements that may fail)"
                )
            staged = ctx.outgoing[before:]
            if staged:
                with anyio.CancelScope(shield=True):
                    await outbox._stage_pg(link.cursor, staged)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self._fail_member(link, exc)
                await self._release(link)
            if isinstance(exc, GroupCommitFailed):
                ctx._sql_failed(exc)
            raise
        ctx._unstage_from(before)
        self.failure_rate -= self.failure_rate * _DECAY
        self._finished(started)
        link.members += 1
        group.ids[key] = f"({service}, {message_id}, now())"
        if link.members == 1:
            link.since = time.monotonic()
        if link not in self._links or self._must_end(link):  # this member ends it (shielded: others wait on it)
            if self._stalled():  # every handler waits for a commit: end the lingering ones too
                self._end_lingering(link)
            with anyio.CancelScope(shield=True):
                await self._release(link)
        else:  # the common case with handlers waiting: nothing to await
            self._hand_over(link)
        await group.done.wait()  # committed by whichever member ends the transaction
        self._raise(ctx, group.outcome(key))
        ctx._sql_committed()

    @staticmethod
    def _raise(ctx: SqlRun, error: BaseException | None) -> None:
        if error is None:
            return
        if isinstance(error, GroupCommitFailed):  # the runtime sees it even if the handler catches it
            ctx._sql_failed(error)
        raise error

    async def _fail_member(self, link: _Link, exc: BaseException) -> None:
        """Undo a member that raised: to its savepoint; with the transaction when it is alone in
        it; else the whole transaction, whose earlier members run again."""
        if not link.open:
            return
        self.failure_rate += (1.0 - self.failure_rate) * _DECAY
        if self._broken(link):
            await self._lose_group(link)
        elif link.members == 0:
            await self._rollback(link)
        elif link.savepoint:
            await self._undo(link)
        else:
            group = link.group
            assert group is not None
            self.rollbacks += 1
            group.error = RolledBackWithGroup(
                f"the shared transaction was rolled back because another handler's block in it failed "
                f"({type(exc).__name__}: {exc})"
            )
            await self._rollback(link)

    async def _undo(self, link: _Link) -> None:
        """Roll back to the member's savepoint (the transaction goes on)."""
        try:
            await link.cursor.execute("ROLLBACK TO SAVEPOINT fw; RELEASE SAVEPOINT fw")
            link.savepoint = False
        except Exception:
            await self._lose_group(link)

    async def _lose_group(self, link: _Link) -> None:
        """The transaction on ``link`` is lost (a broken connection): fail its members, drop the link."""
        group = link.group
        link.group, link.members, link.savepoint = None, 0, False
        if group is not None:
            group.error = GroupCommitFailed("the database connection broke before the shared transaction committed")
            group.done.set()
        await self._discard(link)

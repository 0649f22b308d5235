"""Group commit: handlers' SQL transactions as savepoints of a shared transaction, committed together.

``ctx.sql_transaction(engine)`` in a running worker (PostgreSQL) goes through a
:class:`GroupCommitter`, one per engine in the process. It holds up to ``sql_connections``
connections ("links"). A handler entering the block takes a free link (or waits for one) and runs
as a *member* of the transaction open on it:

* the first member of a transaction sends ``BEGIN`` and its inbox row in one round trip; a later
  member sends ``SAVEPOINT`` and its inbox row (releasing the previous member's savepoint in the
  same query), so each member can be undone alone;
* when its block ends, the link goes to the next waiting handler, which joins the transaction;
  the transaction commits when it holds ``group_commit_size`` members, when its first member has
  waited ``group_commit_wait`` seconds, or at once when no handler is waiting for a link;
* ``async with`` returns only once the member's transaction has committed, so the runtime's
  publish and ack after the handler follow a durable commit, exactly as with one transaction per
  message. A block that raises rolls back to its savepoint (the whole transaction for a first
  member, which is alone in it) and fails alone. A failed ``COMMIT`` fails every member (each
  is retried: nothing was committed, or the inbox row says it was). A crash before the commit
  redelivers every member, and the inbox rows make that safe.

The bound on added latency: a finished member waits at most ``group_commit_wait`` plus the rest
of the block running on its link at that moment (a transaction cannot commit half a block).
``group_commit_size=1`` is one transaction per message (no savepoints).

The framework's own statements go to the psycopg connection directly (no SQLAlchemy layers);
the handler's statements go through the SQLAlchemy connection it is given, on the same link.
Group transactions hold row locks longer than one message's: handlers that update rows in
different orders can deadlock across links, and PostgreSQL then fails one statement (after its
``deadlock_timeout``); that handler is retried like any failed attempt.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import anyio

from framework.effects import AlreadyProcessed
from framework.logs import get_logger

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

    from framework.context import Context
    from framework.settings import RuntimeSettings

__all__ = ["GroupCommitFailed", "GroupCommits", "GroupCommitter", "current"]

log = get_logger("framework.group_commit")

_current: ContextVar[GroupCommits | None] = ContextVar("framework_group_commits", default=None)


def current() -> GroupCommits | None:
    """The running runtime's group committers (None outside a runtime: one transaction per block)."""
    return _current.get()


_INERROR_STATUS = 3  # psycopg.pq.TransactionStatus.INERROR: a statement failed, the transaction cannot commit


class GroupCommitFailed(Exception):
    """The shared transaction this handler's block belonged to did not commit (the attempt is retried)."""


def _literal(value: str) -> str:
    """``value`` as an SQL string literal (the link sets ``standard_conforming_strings``)."""
    if "\x00" in value:
        raise ValueError("a message id or service name with a NUL character cannot be stored in PostgreSQL")
    return "'" + value.replace("'", "''") + "'"


class _Group:
    """One shared transaction's outcome, awaited by its members."""

    __slots__ = ("done", "error", "ids")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.error: BaseException | None = None
        self.ids: set[str] = set()


class _Link:
    """One connection of a committer and the transaction open on it."""

    __slots__ = ("conn", "cursor", "group", "members", "raw", "savepoint", "since")

    def __init__(self, conn: AsyncConnection, raw: Any) -> None:
        self.conn = conn  # what the handler's block gets
        self.raw = raw  # the psycopg AsyncConnection under it (autocommit: we send BEGIN/COMMIT)
        self.cursor = raw.cursor()
        self.group: _Group | None = None  # the open transaction's members' outcome
        self.members = 0  # members whose work is in the open transaction
        self.savepoint = False  # the last member's savepoint is not released yet
        self.since = 0.0  # monotonic time the open transaction's first member finished

    @property
    def open(self) -> bool:
        return self.group is not None


class _Waiter:
    __slots__ = ("event", "link")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.link: _Link | None = None


class GroupCommitter:
    """Group commit on one engine (see the module docstring)."""

    def __init__(self, engine: AsyncEngine, *, size: int, wait: float, connections: int) -> None:
        self.engine = engine
        self.size = size
        self.wait = wait
        self.connections = connections
        self._free: list[_Link] = []
        self._waiters: deque[_Waiter] = deque()
        self._opened = 0
        self._links: set[_Link] = set()
        self._literals: dict[str, str] = {}
        self.commits = 0  # transactions committed (observability, tests)
        self.members = 0  # members committed

    # -- links ------------------------------------------------------------------------------------

    async def _open_link(self) -> _Link:
        conn = await self.engine.connect()
        try:
            raw = (await conn.get_raw_connection()).driver_connection
            await raw.set_autocommit(True)  # BEGIN travels with the first statement: one round trip
            await raw.execute("SET standard_conforming_strings = on")
        except BaseException:
            with anyio.CancelScope(shield=True):
                await conn.close()
            raise
        link = _Link(conn, raw)
        self._links.add(link)
        return link

    async def _acquire(self) -> _Link:
        if self._free:
            return self._free.pop()
        if self._opened < self.connections:
            self._opened += 1
            try:
                return await self._open_link()
            except BaseException:
                self._opened -= 1
                raise
        waiter = _Waiter()
        self._waiters.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.link is not None:  # handed over just as we were cancelled: pass it on
                with anyio.CancelScope(shield=True):
                    await self._release(waiter.link)
            else:
                self._waiters.remove(waiter)
            raise
        assert waiter.link is not None
        return waiter.link

    async def _release(self, link: _Link) -> None:
        """A member is done with ``link``: commit if it is time, then hand it to the next waiter."""
        if link.open:
            if link.members == 0:
                await self._end(link, "ROLLBACK")  # only duplicates or failures: nothing to keep
            elif not self._waiters or link.members >= self.size or time.monotonic() - link.since >= self.wait:
                await self._end(link, "COMMIT")
        if link not in self._links:  # closed after a broken connection
            self._opened -= 1
            if self._waiters and self._opened < self.connections:
                self._opened += 1
                try:
                    link = await self._open_link()
                except Exception as exc:  # the waiter will try itself
                    self._opened -= 1
                    log.warning("could not open a database connection", error=f"{type(exc).__name__}: {exc}")
                    return
            else:
                return
        if self._waiters:
            waiter = self._waiters.popleft()
            waiter.link = link
            waiter.event.set()
        else:
            self._free.append(link)

    async def _end(self, link: _Link, command: str) -> None:
        """End the open transaction with ``COMMIT`` or ``ROLLBACK`` and tell its members."""
        group = link.group
        assert group is not None
        members = link.members
        link.group, link.members, link.savepoint = None, 0, False
        try:
            await link.cursor.execute(command)
        except Exception as exc:  # callers shield this: no cancellation here
            group.error = GroupCommitFailed(
                f"the shared transaction of {members} handler run(s) did not commit: {type(exc).__name__}: {exc}"
            )
            group.error.__cause__ = exc
            await self._discard(link)
        else:
            if command == "COMMIT":
                self.commits += 1
                self.members += members
        group.done.set()

    async def _discard(self, link: _Link) -> None:
        """Drop a link whose connection may be broken (its transaction is gone with it)."""
        self._links.discard(link)
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await link.conn.invalidate()
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await link.conn.close()

    def _broken(self, link: _Link) -> bool:
        raw = link.raw
        return bool(raw.closed or raw.broken)

    # -- members ----------------------------------------------------------------------------------

    def _group_literal(self, service: str) -> str:
        literal = self._literals.get(service)
        if literal is None:
            literal = self._literals[service] = _literal(service)
        return literal

    @contextlib.asynccontextmanager
    async def transaction(self, ctx: Context) -> AsyncIterator[AsyncConnection]:
        """One handler's block as a member of the transaction on a link (see the module docstring)."""
        from framework import outbox

        row = (  # built before a link is taken: a bad id fails here, with nothing to undo
            "INSERT INTO framework_inbox (group_name, message_id, processed_at) VALUES ("
            f"{self._group_literal(ctx.service)}, {_literal(ctx.message_id)}, now()) ON CONFLICT DO NOTHING"
        )
        link = await self._acquire()
        with anyio.CancelScope(shield=True):  # a link must be released, whatever happens
            try:
                claimed, group = await self._claim(link, row)
            except BaseException:
                await self._fail_member(link)
                await self._release(link)
                raise
            if not claimed:  # a duplicate: nothing written (a savepoint, if any, is released by the next member)
                await self._release(link)
                if ctx.message_id in group.ids:  # a copy in this very transaction: its outcome decides
                    await group.done.wait()
                    if group.error is not None:
                        raise group.error
                raise AlreadyProcessed(f"message {ctx.message_id} was already processed by {ctx.service}")
        before = len(ctx.outgoing)
        try:
            yield link.conn
            staged = ctx.outgoing[before:]
            with anyio.CancelScope(shield=True):
                if link.raw.info.transaction_status == _INERROR_STATUS:
                    raise GroupCommitFailed(
                        "a statement failed inside ctx.sql_transaction and the error was caught: "
                        "the block's transaction cannot commit (let the error propagate, or use "
                        "conn.begin_nested() around statements that may fail)"
                    )
                if staged:
                    await outbox._stage_pg(link.cursor, staged)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._fail_member(link)
                await self._release(link)
            raise
        ctx._unstage_from(before)
        with anyio.CancelScope(shield=True):
            link.members += 1
            group.ids.add(ctx.message_id)
            if link.members == 1:
                link.since = time.monotonic()
            await self._release(link)
        await group.done.wait()  # committed by whichever member ends the transaction
        if group.error is not None:
            raise group.error
        ctx._sql_committed()

    async def _claim(self, link: _Link, row: str) -> tuple[bool, _Group]:
        """Start a member: ``BEGIN`` or ``SAVEPOINT``, and its inbox ``row``; True unless a duplicate.

        A member alone in the transaction needs no savepoint (on failure the whole transaction
        rolls back); the previous member's savepoint is released in the same query.
        """
        if link.group is None:
            link.group = _Group()
            query = "BEGIN; " + row
        elif link.members == 0:
            query = row
        elif link.savepoint:
            query = "RELEASE SAVEPOINT fw; SAVEPOINT fw; " + row
        else:
            query = "SAVEPOINT fw; " + row
        link.savepoint = link.members > 0
        cur = link.cursor
        await cur.execute(query)
        while cur.nextset():  # the INSERT's result is the last one
            pass
        return cur.rowcount == 1, link.group

    async def _undo(self, link: _Link) -> None:
        """Roll back to the member's savepoint (the transaction goes on)."""
        try:
            await link.cursor.execute("ROLLBACK TO SAVEPOINT fw; RELEASE SAVEPOINT fw")
            link.savepoint = False
        except Exception:
            await self._lose_group(link)

    async def _fail_member(self, link: _Link) -> None:
        """Undo a member that raised: its savepoint, or the whole transaction when it was alone in it."""
        if not link.open:
            return
        if self._broken(link):
            await self._lose_group(link)
        elif link.members == 0:
            await self._end(link, "ROLLBACK")
        else:
            await self._undo(link)

    async def _lose_group(self, link: _Link) -> None:
        """The transaction on ``link`` is lost (a broken connection): fail its members, drop the link."""
        group = link.group
        link.group, link.members, link.savepoint = None, 0, False
        if group is not None:
            group.error = GroupCommitFailed("the database connection broke before the shared transaction committed")
            group.done.set()
        await self._discard(link)

    async def aclose(self) -> None:
        """Commit what is open (nothing, after a graceful stop) and return every connection."""
        if self.members:
            log.info("group commit", commits=self.commits, blocks=self.members, connections=self._opened)
        with anyio.CancelScope(shield=True):
            for link in list(self._links):
                if link.open:
                    await self._end(link, "COMMIT" if link.members else "ROLLBACK")
                if link in self._links:
                    self._links.discard(link)
                    with contextlib.suppress(Exception):
                        await link.raw.set_autocommit(False)
                    with contextlib.suppress(Exception):
                        await link.conn.close()
            self._free.clear()
            self._opened = 0


class GroupCommits:
    """A runtime's committers, one per engine; installed for its tasks with :meth:`installed`."""

    def __init__(self, settings: RuntimeSettings) -> None:
        self.settings = settings
        self._by_engine: dict[int, tuple[Any, GroupCommitter | None]] = {}

    def for_engine(self, engine: AsyncEngine) -> GroupCommitter | None:
        """The committer of ``engine`` (None for SQLite: one transaction per block there)."""
        entry = self._by_engine.get(id(engine))
        if entry is not None and entry[0] is engine:
            return entry[1]
        committer = None
        if engine.dialect.name == "postgresql" and engine.dialect.driver == "psycopg":
            committer = self._create(engine)
        self._by_engine[id(engine)] = (engine, committer)
        return committer

    def _create(self, engine: AsyncEngine) -> GroupCommitter:
        from framework.sql import redact_url

        settings = self.settings
        wanted = settings.sql_connections
        pool = engine.pool
        size = getattr(pool, "size", None)
        overflow = getattr(pool, "_max_overflow", 0)
        capacity = None
        if callable(size) and overflow >= 0:
            capacity = size() + overflow
        connections = wanted if capacity is None else max(1, min(wanted, capacity))
        log.info(
            "SQL transactions on this engine run at most this many at a time in this process "
            "(one connection each, held while the worker runs)",
            database=redact_url(engine.url),
            connections=connections,
            bounded_by_pool=connections < wanted,
            group_commit_size=settings.group_commit_size,
            group_commit_wait_ms=round(settings.group_commit_wait * 1000, 3),
        )
        return GroupCommitter(
            engine, size=settings.group_commit_size, wait=settings.group_commit_wait, connections=connections
        )

    @contextlib.contextmanager
    def installed(self) -> Any:
        """Make these committers the current ones for tasks started inside the block."""
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)

    async def aclose(self) -> None:
        """Close every committer (return their connections to the engines' pools)."""
        for _, committer in list(self._by_engine.values()):
            if committer is not None:
                await committer.aclose()
        self._by_engine.clear()

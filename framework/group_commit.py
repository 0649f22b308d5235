"""Group commit: handlers' SQL blocks as members of a shared transaction, committed together.

``ctx.sql_transaction(engine)`` in a running worker (PostgreSQL) goes through a
:class:`GroupCommitter`, one per engine in the process. It holds up to ``sql_connections``
connections ("links"). A handler entering the block takes a free link (or waits for one) and runs
as a *member* of the transaction open on it. Members of one transaction run one after another
(a block holds its link until it ends), so a member sees the writes of those before it and row
locks behave as in transactions run one after another.

What a member costs, in round trips to the database:

* nothing of its own in the common case: the *inbox rows* of a transaction's members are written
  with its ``COMMIT``, in one multi-row ``INSERT`` in the same round trip, and when handlers are
  waiting for the link the next transaction's ``BEGIN`` goes along too;
* a *possible duplicate* (``ctx.attempt > 1``: a retry or a redelivery, which an earlier run may
  have committed) first looks itself up in the inbox table (one round trip): found, it raises
  :class:`~framework.effects.AlreadyProcessed` and its block does not run;
* while blocks fail often (more than :data:`SAVEPOINT_ABOVE` of recent blocks, a moving average
  over about 64), every later member opens a ``SAVEPOINT`` first (one round trip), so a failing
  block rolls back alone. Below that a failure costs less than savepoints would: see below.

Outcomes stay per message:

* ``async with`` returns only once the member's transaction committed, so the runtime's publish
  and ack after the handler follow a durable commit, exactly as with one transaction per message;
* a block that raises is rolled back: to its savepoint when it has one; with the whole
  transaction when it is alone in it; otherwise the whole transaction is rolled back and the
  members before it raise :class:`RolledBackWithGroup`, which the runtime answers by running their
  handler again at once (not a failed attempt, no backoff). With 1% of blocks failing and groups
  of about 4 that is about 1.5 extra runs per 100 messages, where savepoints would cost a round
  trip on every message;
* a member whose message turns out to have been processed already (its inbox row collides at
  ``COMMIT``: a copy run concurrently, or one a worker committed before it died) rolls the
  transaction back: that member raises ``AlreadyProcessed``, the others run again;
* a failed ``COMMIT`` (a lost connection) fails every member with :class:`GroupCommitFailed`: a
  failed attempt, retried; the retry is a possible duplicate, so it finds its row if the commit
  had in fact happened. A crash before the commit redelivers every member, and the inbox rows make
  that safe. A handler that catches these errors still fails: the runtime checks the block's outcome.

When a member finishes, its transaction commits at once unless others can join it soon: while
handlers wait for a link, or while blocks have been finishing less than ``group_commit_wait``
apart (a moving average: a steady moderate load), when the link goes back free with its
transaction open and the next block to start joins it (no ``BEGIN`` of its own); a timer commits
it ``group_commit_wait`` after its first member finished. At lower rates nothing waits.

The bound on added latency: a finished member waits at most ``group_commit_wait`` plus the rest of
the block running on its link at that moment (a transaction cannot commit half a block).
``group_commit_size=1`` is one transaction per message.

The framework's own statements go to the psycopg connection directly (no SQLAlchemy layers);
the handler's statements go through the SQLAlchemy connection it is given, on the same link.
Group transactions hold row locks longer than one message's: handlers that update rows in
different orders can deadlock across links, and PostgreSQL then fails one statement (after its
``deadlock_timeout``); that handler is retried like any failed attempt.
"""

from __future__ import annotations

import asyncio
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

__all__ = ["SAVEPOINT_ABOVE", "GroupCommitFailed", "GroupCommits", "GroupCommitter", "RolledBackWithGroup", "current"]

log = get_logger("framework.group_commit")

_current: ContextVar[GroupCommits | None] = ContextVar("framework_group_commits", default=None)

SAVEPOINT_ABOVE = 0.1
"""Members open a savepoint first while the moving failure rate of blocks is above this."""
_DECAY = 1 / 64  # weight of the newest block in the failure rate


def current() -> GroupCommits | None:
    """The running runtime's group committers (None outside a runtime: one transaction per block)."""
    return _current.get()


_INERROR_STATUS = 3  # psycopg.pq.TransactionStatus.INERROR: a statement failed, the transaction cannot commit
_UNIQUE_VIOLATION = "23505"


class GroupCommitFailed(Exception):
    """The shared transaction this handler's block belonged to did not commit (the attempt is retried)."""


class RolledBackWithGroup(GroupCommitFailed):
    """Another member's failure or duplicate rolled back the shared transaction this block was in.

    Nothing of the block was kept. The runtime runs the handler again at once; this is not a
    failed attempt.
    """


def _literal(value: str) -> str:
    """``value`` as an SQL string literal (the link sets ``standard_conforming_strings``)."""
    if "\x00" in value:
        raise ValueError("a message id or service name with a NUL character cannot be stored in PostgreSQL")
    return "'" + value.replace("'", "''") + "'"


class _Group:
    """One shared transaction's outcome, awaited by its members."""

    __slots__ = ("done", "error", "ids", "lingering", "own")

    def __init__(self) -> None:
        self.done = asyncio.Event()  # (psycopg's async connections run on asyncio only)
        self.lingering = False  # a timer will end it if no member is running on its link by then
        self.error: BaseException | None = None  # every member's outcome, unless in ``own``
        self.own: dict[tuple[str, str], BaseException] = {}  # one member's outcome, by (service, message id)
        self.ids: dict[tuple[str, str], str] = {}  # finished members: (service, message id) -> inbox row values

    def outcome(self, key: tuple[str, str]) -> BaseException | None:
        """The outcome of the member ``key`` (None: committed)."""
        error = self.own.get(key)
        return error if error is not None else self.error


class _Link:
    """One connection of a committer and the transaction open on it."""

    __slots__ = ("conn", "cursor", "group", "members", "raw", "savepoint", "since")

    def __init__(self, conn: AsyncConnection, raw: Any) -> None:
        self.conn = conn  # what the handler's block gets
        self.raw = raw  # the psycopg AsyncConnection under it (autocommit: we send BEGIN/COMMIT)
        self.cursor = raw.cursor()
        self.group: _Group | None = None  # the open transaction's members' outcome (BEGIN was sent)
        self.members = 0  # members whose work is in the open transaction
        self.savepoint = False  # the running (or last) member opened a savepoint not released yet
        self.since = 0.0  # monotonic time the open transaction's first member finished

    @property
    def open(self) -> bool:
        return self.group is not None


class GroupCommitter:
    """Group commit on one engine (see the module docstring)."""

    def __init__(self, engine: AsyncEngine, *, size: int, wait: float, connections: int) -> None:
        self.engine = engine
        self.size = size
        self.wait = wait
        self.connections = connections
        self._free: list[_Link] = []
        self._waiters: deque[asyncio.Future[_Link]] = deque()  # handlers waiting for a link, first come first
        self._opened = 0
        self._links: set[_Link] = set()
        self._literals: dict[str, str] = {}
        self.failure_rate = 0.0  # moving average of blocks that failed (1) or committed their part (0)
        self.commits = 0  # transactions committed (observability, tests)
        self.members = 0  # members committed
        self.rollbacks = 0  # shared transactions rolled back for one member (its failure or duplicate)
        self.gap = wait * 2  # moving average of the time between blocks finishing (``_worth_lingering``)
        self._last_finish = 0.0
        self._enders: set[asyncio.Task[None]] = set()  # transactions ended by their linger timer

    # -- links ------------------------------------------------------------------------------------

    async def _open_link(self) -> _Link:
        conn = await self.engine.connect()
        try:
            raw = (await conn.get_raw_connection()).driver_connection
            await raw.set_autocommit(True)  # we send BEGIN ourselves, with other statements
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
        waiter: asyncio.Future[_Link] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():  # handed over just as we were cancelled: pass it on
                with anyio.CancelScope(shield=True):
                    await self._release(waiter.result())
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise

    def _must_end(self, link: _Link) -> bool:
        """Whether the member leaving ``link`` ends its transaction (commit or rollback) first."""
        if link.members:
            if link.members >= self.size or time.monotonic() - link.since >= self.wait:
                return True
            return not self._waiters and not self._worth_lingering()
        return link.open and not self._waiters

    def _worth_lingering(self) -> bool:
        """Whether, with no handler waiting, a finished member's transaction should stay open for
        blocks finishing soon (until ``wait`` after its first member): when blocks have been
        finishing less than ``wait`` apart. At lower rates nothing would join; it commits at once."""
        return self.gap < self.wait

    def _finished(self) -> None:
        """A block finished: update the moving average of the time between blocks finishing."""
        now = time.monotonic()
        sample = min(now - self._last_finish, 4 * self.wait)  # one idle spell does not count for long
        self._last_finish = now
        self.gap += (sample - self.gap) * 0.125

    def _linger(self, link: _Link) -> None:
        """``link`` goes back free with members in its transaction: end it ``wait`` after its first
        member finished, unless a member running on it then ends it."""
        group = link.group
        if group is None or group.lingering:
            return
        group.lingering = True
        delay = max(0.0, link.since + self.wait - time.monotonic())
        asyncio.get_running_loop().call_later(delay, self._linger_over, link, group)

    def _linger_over(self, link: _Link, group: _Group) -> None:
        if link.group is not group:  # ended meanwhile
            return
        if link not in self._free:  # a member runs on it: it ends it, or lingers it again (a new timer)
            group.lingering = False
            return
        if (left := link.since + self.wait - time.monotonic()) > 0:  # timers may fire a little early
            asyncio.get_running_loop().call_later(left, self._linger_over, link, group)
            return
        self._free.remove(link)
        task = asyncio.get_running_loop().create_task(self._release(link))
        self._enders.add(task)
        task.add_done_callback(self._enders.discard)

    def _hand_over(self, link: _Link) -> None:
        """Give ``link`` to the first handler waiting for one, else put it back."""
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():  # (a cancelled one leaves the queue when it runs again)
                waiter.set_result(link)
                return
        # (rarely with an empty transaction begun for a waiter that left: the next member uses it)
        self._free.append(link)
        if link.members:
            self._linger(link)

    async def _release(self, link: _Link) -> None:
        """A member is done with ``link``: commit if it is time, then hand it to the next waiter."""
        if link.members:
            if self._must_end(link):
                await self._commit(link)
        elif link.open and not self._waiters:  # nothing in it (its only member was a duplicate): end it
            await self._rollback(link)
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
        self._hand_over(link)

    async def _commit(self, link: _Link, *, reopen: bool = True) -> None:
        """Write the members' inbox rows and ``COMMIT`` in one round trip (and ``BEGIN`` the next
        transaction when handlers are waiting for the link); tell the members how it went."""
        group = link.group
        assert group is not None
        members = link.members
        again = reopen and bool(self._waiters)
        rows = ", ".join(group.ids[key] for key in sorted(group.ids))  # one order everywhere: no deadlocks
        query = f"INSERT INTO framework_inbox (group_name, message_id, processed_at) VALUES {rows}; COMMIT"
        link.group, link.members, link.savepoint = None, 0, False
        try:
            await link.cursor.execute(query + "; BEGIN" if again else query)
        except Exception as exc:  # callers shield this: no cancellation here
            if getattr(exc, "sqlstate", None) == _UNIQUE_VIOLATION and not self._broken(link):
                await self._duplicates_found(link, group, exc)
            else:
                self._fail_group(group, exc, members)
                await self._discard(link)
        else:
            self.commits += 1
            self.members += members
            if again:
                link.group = _Group()
        group.done.set()

    async def _duplicates_found(self, link: _Link, group: _Group, exc: Exception) -> None:
        """An inbox row collided at ``COMMIT``: roll back, find which messages were processed
        already (they are duplicates), and have the others run again."""
        self.rollbacks += 1
        try:
            await link.cursor.execute("ROLLBACK")
            pairs = ", ".join(f"({self._service_literal(service)}, {_literal(mid)})" for service, mid in group.ids)
            await link.cursor.execute(
                f"SELECT group_name, message_id FROM framework_inbox WHERE (group_name, message_id) IN ({pairs})"
            )
            found = {(row[0], row[1]) for row in await link.cursor.fetchall()}
        except Exception as lost:
            self._fail_group(group, lost, len(group.ids))
            await self._discard(link)
            return
        if not found:  # the collision was elsewhere (a deferred constraint): an ordinary failed commit
            self._fail_group(group, exc, len(group.ids))
            return
        for key in found:
            group.own[key] = AlreadyProcessed(f"message {key[1]} was processed by {key[0]} in another run meanwhile")
        group.error = RolledBackWithGroup(
            f"the shared transaction was rolled back: {len(found)} of its {len(group.ids)} message(s) had been "
            "processed by another run meanwhile"
        )

    @staticmethod
    def _fail_group(group: _Group, exc: BaseException, members: int) -> None:
        group.error = GroupCommitFailed(
            f"the shared transaction of {members} handler run(s) did not commit: {type(exc).__name__}: {exc}"
        )
        group.error.__cause__ = exc

    async def _rollback(self, link: _Link) -> None:
        """Roll the open transaction back and tell its members."""
        group = link.group
        assert group is not None
        link.group, link.members, link.savepoint = None, 0, False
        try:
            await link.cursor.execute("ROLLBACK")
        except Exception as exc:  # callers shield this: no cancellation here
            self._fail_group(group, exc, 0)
            await self._discard(link)
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

    def _service_literal(self, service: str) -> str:
        literal = self._literals.get(service)
        if literal is None:
            literal = self._literals[service] = _literal(service)
        return literal

    def _opening(self, link: _Link, ctx: Context, service: str, message_id: str) -> str | None:
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
    async def transaction(self, ctx: Context) -> AsyncIterator[AsyncConnection]:
        """One handler's block as a member of the transaction on a link (see the module docstring)."""
        from framework import outbox

        key = (ctx.service, ctx.message_id)
        service, message_id = self._service_literal(key[0]), _literal(key[1])  # a bad id fails here, early
        link = await self._acquire()
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
        self._finished()
        link.members += 1
        group.ids[key] = f"({service}, {message_id}, now())"
        if link.members == 1:
            link.since = time.monotonic()
        if link not in self._links or self._must_end(link):  # this member ends it (shielded: others wait on it)
            with anyio.CancelScope(shield=True):
                await self._release(link)
        else:  # the common case with handlers waiting: nothing to await
            self._hand_over(link)
        await group.done.wait()  # committed by whichever member ends the transaction
        self._raise(ctx, group.outcome(key))
        ctx._sql_committed()

    @staticmethod
    def _raise(ctx: Context, error: BaseException | None) -> None:
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

    async def aclose(self) -> None:
        """Commit what is open (nothing, after a graceful stop) and return every connection."""
        if self.members:
            log.info(
                "group commit",
                commits=self.commits,
                blocks=self.members,
                rollbacks=self.rollbacks,
                connections=self._opened,
            )
        with anyio.CancelScope(shield=True):
            for task in list(self._enders):
                with contextlib.suppress(Exception):
                    await task
            for link in list(self._links):
                if link.open:
                    if link.members:
                        await self._commit(link, reopen=False)
                    else:
                        await self._rollback(link)
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

"""A group committer's connections ("links") and the shared transactions on them: lend, linger, end.

:class:`LinkPool` is the part of :class:`~framework.group_commit.GroupCommitter` that owns the
connections: it hands a link to the next block, decides when the transaction open on it ends,
and commits (with the members' inbox rows) or rolls it back; the committer runs the members
(:mod:`framework.group_commit.committer`). See :mod:`framework.group_commit` for the whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import anyio

from framework._sql_block import AlreadyProcessed
from framework.logs import get_logger

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

__all__ = ["GroupCommitFailed", "LinkPool", "RolledBackWithGroup"]

log = get_logger("framework.group_commit")

_UNIQUE_VIOLATION = "23505"


class GroupCommitFailed(Exception):
    """The shared transaction this handler's block belonged to did not commit (the attempt is retried)."""

    __module__ = "framework.group_commit"  # its public home (and the type name dead letters record)


class RolledBackWithGroup(GroupCommitFailed):
    """Another member's failure or duplicate rolled back the shared transaction this block was in.

    Nothing of the block was kept. The runtime runs the handler again at once; this is not a
    failed attempt.
    """

    __module__ = "framework.group_commit"


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


class LinkPool:
    """A committer's links and the transactions open on them (see the module docstring)."""

    def __init__(
        self, engine: AsyncEngine, *, size: int, wait: float, connections: int, lanes: int | None = None
    ) -> None:
        self.engine = engine
        self.size = size
        self.wait = wait
        self.connections = connections
        self.lanes = lanes  # handlers the process runs at once (None: unknown): see ``_stalled``
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
        self.span = 0.0  # moving average of a block's time on its link, from taking it to finishing
        self._last_finish = 0.0
        self._enders: set[asyncio.Task[None]] = set()  # transactions ended by their linger timer

    # -- links ------------------------------------------------------------------------------------

    async def _open_link(self) -> _Link:
        conn = await self.engine.connect()
        try:
            raw: Any = (await conn.get_raw_connection()).driver_connection
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
            return not self._waiters and (self._stalled() or not self._worth_lingering())
        return link.open and not self._waiters

    def _stalled(self) -> bool:
        """Whether every handler the process can run at once is a finished member waiting for a
        commit here: no block can start before one commits, so no transaction should linger."""
        lanes = self.lanes
        return lanes is not None and sum(link.members for link in self._links) >= lanes

    def _end_lingering(self, keep: _Link) -> None:
        """End every free link's open transaction now (but ``keep``'s, which its caller ends)."""
        for link in [link for link in self._free if link is not keep and link.members]:
            self._end_in_task(link, force=True)

    def _end_in_task(self, link: _Link, *, force: bool = False) -> None:
        """Take the free ``link`` and release it in a task of its own (awaited by :meth:`aclose`)."""
        self._free.remove(link)
        task = asyncio.get_running_loop().create_task(self._release(link, force=force))
        self._enders.add(task)
        task.add_done_callback(self._enders.discard)

    def _worth_lingering(self) -> bool:
        """Whether, with no handler waiting, a finished member's transaction should stay open for
        blocks finishing soon (until ``wait`` after its first member finished): only a block that
        starts on the link later can join, and it must finish within the wait, so it is worth it
        when the next block is due (``gap``) and done (``span``) within ``wait``. Otherwise (a low
        rate, or blocks that take most of the wait) it commits at once: lingering would add
        ``wait`` to the first member's commit for hardly a joiner."""
        return self.gap + self.span < self.wait

    def _finished(self, started: float) -> None:
        """A block that took its link at ``started`` finished: update the moving averages of the
        time between blocks finishing and of a block's time on its link."""
        now = time.monotonic()
        cap = 4 * self.wait  # one idle spell or one slow block does not count for long
        sample = min(now - self._last_finish, cap)
        self._last_finish = now
        self.gap += (sample - self.gap) * 0.125
        self.span += (min(now - started, cap) - self.span) * 0.125

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
        self._end_in_task(link)

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

    async def _release(self, link: _Link, *, force: bool = False) -> None:
        """A member is done with ``link``: commit if it is time (or ``force``), then hand it to the next waiter."""
        if link.members:
            if force or self._must_end(link):
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

    def _service_literal(self, service: str) -> str:
        literal = self._literals.get(service)
        if literal is None:
            literal = self._literals[service] = _literal(service)
        return literal

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

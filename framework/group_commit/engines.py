"""A runtime's group committers, one per engine, and the ones current for its tasks."""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from framework.group_commit.committer import GroupCommitter
from framework.logs import get_logger

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from framework.settings import RuntimeSettings

__all__ = ["GroupCommits", "current"]

log = get_logger("framework.group_commit")

_current: ContextVar[GroupCommits | None] = ContextVar("framework_group_commits", default=None)


def current() -> GroupCommits | None:
    """The running runtime's group committers (None outside a runtime: one transaction per block)."""
    return _current.get()


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
            engine,
            size=settings.group_commit_size,
            wait=settings.group_commit_wait,
            connections=connections,
            lanes=settings.concurrency,  # (an isolated redelivery may run beside them: it starts a transaction)
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

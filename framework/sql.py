"""SQL databases for the outbox and inbox: engines from URLs, reachability checks, redacted URLs.

PostgreSQL is reached through psycopg 3 and SQLite through aiosqlite, both under SQLAlchemy 2
(asyncio). Without a URL and ``DATABASE_URL`` the default is a SQLite file,
``outbox.db`` in the per-user framework home (``$FRAMEWORK_HOME``, else ``~/.local/state/framework``).

Scratch databases for tests (``embedded_postgres``, ``temporary_database``) are in
:mod:`framework.testing`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

__all__ = [
    "DatabaseUnavailable",
    "create_engine",
    "default_sqlite_path",
    "libpq_url",
    "ping",
    "redact_url",
    "resolve_url",
]

_SQLITE_HINT = "sqlite:///path/to/file.db"
_PG_HINT = "postgresql://user:password@host:5432/dbname"


class DatabaseUnavailable(Exception):
    """The database cannot be reached or lacks the outbox tables; the message says what to do."""


def default_sqlite_path() -> Path:
    """``outbox.db`` in :func:`broker.urls.framework_home` (``$FRAMEWORK_HOME`` or the per-user state directory)."""
    from broker.urls import framework_home

    return framework_home() / "outbox.db"


def resolve_url(url: str | None = None) -> URL:
    """The SQLAlchemy URL to use: ``url``, else ``$DATABASE_URL``, else the default SQLite file.

    ``postgresql://`` and ``postgres://`` become ``postgresql+psycopg://``; ``sqlite://`` becomes
    ``sqlite+aiosqlite://``. Other schemes and drivers raise ``ValueError`` saying what is accepted.
    """
    raw = url or os.environ.get("DATABASE_URL") or None
    if raw is None:
        return URL.create("sqlite+aiosqlite", database=str(default_sqlite_path().absolute()))
    if raw.startswith("postgres://"):
        raw = "postgresql://" + raw.removeprefix("postgres://")
    try:
        parsed = make_url(raw)
    except ArgumentError:
        raise ValueError(f"invalid database URL {redact_url(raw)!r}: expected {_PG_HINT} or {_SQLITE_HINT}") from None
    backend, _, driver = parsed.drivername.partition("+")
    if backend == "postgresql" and driver in ("", "psycopg", "psycopg_async"):
        return parsed.set(drivername="postgresql+psycopg")
    if backend == "sqlite" and driver in ("", "aiosqlite"):
        if parsed.database in (None, "", ":memory:"):
            raise ValueError(
                f"SQLite needs a file (each connection would see its own empty in-memory database): use {_SQLITE_HINT}"
            )
        return parsed.set(drivername="sqlite+aiosqlite")
    raise ValueError(
        f"unsupported database URL scheme {parsed.drivername!r}: use {_PG_HINT} (psycopg 3) or {_SQLITE_HINT}"
    )


def redact_url(url: str | URL) -> str:
    """The URL as text with any password replaced by ``***`` (and no driver name, for messages)."""
    if isinstance(url, str):
        text = url
        try:
            url = make_url(text)
        except ArgumentError:
            return text
    return url.set(drivername=url.get_backend_name()).render_as_string(hide_password=True)


def libpq_url(url: str | URL) -> str:
    """A PostgreSQL URL as libpq/psycopg take it (no SQLAlchemy driver suffix, password kept)."""
    parsed = resolve_url(url if isinstance(url, str) else url.render_as_string(hide_password=False))
    if parsed.get_backend_name() != "postgresql":
        raise ValueError(f"not a PostgreSQL URL: {redact_url(parsed)}")
    return parsed.set(drivername="postgresql").render_as_string(hide_password=False)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")  # readers (the relay's check) never block writers
    cursor.close()


def create_engine(url: str | None = None, **options: Any) -> AsyncEngine:
    """An async engine for ``url`` (see :func:`resolve_url`); ``options`` go to ``create_async_engine``.

    PostgreSQL connections are not pinged on checkout (a round trip per transaction): a broken
    connection fails its statement, and a handler's attempt is retried like any failure
    (``pool_pre_ping=True`` to ping anyway); psycopg prepares a statement on a connection after
    its second use (``prepare_threshold``). The pool holds ``pool_size`` (default 10) connections
    plus ``max_overflow`` (default 10): size it to what uses the engine (a worker's
    ``ctx.sql_transaction`` blocks take ``RuntimeSettings.sql_connections``, default 8).
    SQLite files are created with their directory, in WAL mode, waiting up to 30 s for the write lock.
    """
    resolved = resolve_url(url)
    if resolved.get_backend_name() == "sqlite":
        assert resolved.database is not None
        # the default file holds message bodies: its directory is for the user alone
        Path(resolved.database).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        options.setdefault("connect_args", {}).setdefault("timeout", 30)
        engine = create_async_engine(resolved, **options)
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        return engine
    options.setdefault("pool_size", 10)
    options.setdefault("max_overflow", 10)
    options.setdefault("connect_args", {}).setdefault("prepare_threshold", 2)
    return create_async_engine(resolved, **options)


async def ping(engine: AsyncEngine) -> None:
    """Check the database answers; raise :class:`DatabaseUnavailable` saying how to fix it."""
    try:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
    except (SQLAlchemyError, OSError) as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        if engine.dialect.name == "postgresql":
            hint = (
                "Start PostgreSQL or point --database-url / DATABASE_URL at a running one "
                f"({_PG_HINT}); without either the SQLite file {default_sqlite_path()} is used."
            )
        else:
            hint = f"Check the file's directory exists and is writable, or use {_PG_HINT}."
        raise DatabaseUnavailable(f"cannot reach the database at {redact_url(engine.url)}: {reason}. {hint}") from exc

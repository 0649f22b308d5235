"""Saga state in a SQL table (``Service.saga(..., sql=engine)``): load, save, complete.

Every statement runs on the step's ``ctx.sql_transaction`` connection, so the state commits or
rolls back with the inbox row, the outbox rows (the step's messages and timeouts) and whatever the
step itself wrote. The row is read ``FOR UPDATE`` (PostgreSQL): a step of the same instance in
another transaction waits for this one to end and then reads the new version. Saving checks the
version read (``UPDATE ... WHERE version = :read``, or an insert that finds the row already
there), so a save on a stale read changes nothing and raises
:class:`~broker.errors.EffectsConflict`: the step runs again on the new state.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import attrs
from sqlalchemy import and_, bindparam, delete, select, tuple_, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import ProgrammingError

from broker.errors import EffectsConflict
from framework.outbox.schema import saga_state_table as table
from framework.sql import DatabaseUnavailable

__all__ = ["Row", "complete", "load", "save"]

TOMBSTONES_PER_CLEAN = 100
"""Expired tombstones a completing step deletes at most (the ones older than ``keep_completed``)."""

# (bind names differ from the columns': an UPDATE reserves the column names for its SET clause)
_KEY = and_(table.c.saga == bindparam("in_saga"), table.c.correlation == bindparam("in_correlation"))
_LOAD = select(table.c.version, table.c.state, table.c.timeouts, table.c.completed_at).where(_KEY).with_for_update()
_INSERT = {  # a new instance: nothing is written when a concurrent step created it first (rowcount 0)
    name: dialect.insert(table).on_conflict_do_nothing().execution_options(preserve_rowcount=True)
    for name, dialect in (("postgresql", postgresql), ("sqlite", sqlite))
}
_UPDATE = (
    update(table)
    .where(_KEY, table.c.version == bindparam("read"))
    .values(
        version=bindparam("new_version"),
        state=bindparam("new_state"),
        timeouts=bindparam("new_timeouts"),
        completed_at=bindparam("new_completed_at"),
        updated_at=bindparam("new_updated_at"),
    )
)
_EXPIRED = (
    select(table.c.saga, table.c.correlation)
    .where(table.c.saga == bindparam("in_saga"), table.c.completed_at < bindparam("cutoff"))
    .limit(TOMBSTONES_PER_CLEAN)
    .with_for_update(skip_locked=True)  # another completing step's: it deletes them
)
_CLEAN = delete(table).where(tuple_(table.c.saga, table.c.correlation).in_(_EXPIRED))


@attrs.frozen
class Row:
    """An instance's row as loaded: ``version`` 0 and no state when there is none (or only an
    expired tombstone, whose version a new instance continues from)."""

    stored: int | None  # the version in the table (None: no row)
    version: int  # what the step sees: 0 = a new instance
    state: str | None
    timeouts: str | None
    completed: bool  # a live tombstone: the instance ended


def _hint(exc: ProgrammingError) -> Exception:
    if "framework_saga_state" in str(exc):
        return DatabaseUnavailable(
            "table framework_saga_state is missing: run `framework outbox migrate --database-url URL` "
            "(or apply `framework outbox ddl` with your migration tool)"
        )
    return exc


async def load(conn: Any, saga: str, correlation: str, keep: timedelta) -> Row:
    """The instance's row, locked for this transaction (PostgreSQL)."""
    try:
        found = (await conn.execute(_LOAD, {"in_saga": saga, "in_correlation": correlation})).first()
    except ProgrammingError as exc:
        raise _hint(exc) from exc
    if found is None:
        return Row(None, 0, None, None, False)
    version, state, timeouts, completed_at = found
    if completed_at is not None:
        if completed_at.tzinfo is None:  # SQLite hands back naive UTC
            completed_at = completed_at.replace(tzinfo=UTC)
        if datetime.now(UTC) - completed_at < keep:
            return Row(version, version, None, None, True)
        return Row(version, 0, None, None, False)  # an expired tombstone: a new instance
    return Row(version, version, state, timeouts, False)


async def save(conn: Any, saga: str, correlation: str, row: Row, state: str, timeouts: str) -> None:
    """Write the step's state as version ``row.stored + 1``; EffectsConflict if it moved meanwhile."""
    now = datetime.now(UTC)
    await _write(conn, saga, correlation, row, state, timeouts, None, now)


async def complete(conn: Any, saga: str, correlation: str, row: Row, keep: timedelta) -> None:
    """Replace the state by a tombstone, and delete some of the saga's expired tombstones."""
    now = datetime.now(UTC)
    await _write(conn, saga, correlation, row, None, None, now, now)
    await conn.execute(_CLEAN, {"in_saga": saga, "cutoff": now - keep})


async def _write(
    conn: Any,
    saga: str,
    correlation: str,
    row: Row,
    state: str | None,
    timeouts: str | None,
    completed_at: datetime | None,
    now: datetime,
) -> None:
    version = (row.stored or 0) + 1
    if row.stored is None:
        values = {"version": version, "state": state, "timeouts": timeouts, "completed_at": completed_at}
        result = await conn.execute(
            _INSERT[conn.dialect.name], {"saga": saga, "correlation": correlation, "updated_at": now, **values}
        )
    else:
        params = {"in_saga": saga, "in_correlation": correlation, "read": row.stored, "new_version": version}
        params.update(new_state=state, new_timeouts=timeouts, new_completed_at=completed_at, new_updated_at=now)
        result = await conn.execute(_UPDATE, params)
    if result.rowcount != 1:
        raise EffectsConflict(
            f"saga {saga} instance {correlation!r} was saved by another step since this one read it: "
            "the step runs again on the new state"
        )

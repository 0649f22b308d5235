"""Refused outbox rows: why the broker refuses a message for good, and what an operator does about it.

A row is *refused* when the relay set it aside with the reason in ``error`` (a name declared as a
queue used as a topic, an invalid name, a stored spec that conflicts with the declared one):
:func:`refusal` is that check, shared by the relay and :func:`retry`. The operator lists them
(:func:`refused_rows`), looks at one (:func:`get_row`), puts them back in line once the cause is fixed
(:func:`retry`: a row the broker would refuse again at once stays set aside, with its reason
brought up to date, and is counted) or deletes them for good (:func:`discard`: refused rows only,
never one still waiting).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import orjson
from sqlalchemy import delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from broker import Broker, ConfigurationError, DestinationSpec, validate_name
from framework.outbox._statements import MARK_REFUSED
from framework.outbox.schema import outbox_table

__all__ = ["RefusedRow", "RetryResult", "discard", "get_row", "refusal", "refused_rows", "retry"]

_o = outbox_table


async def refusal(broker: Broker, destination: str, kind: str, spec: str | None) -> str | None:
    """Why ``broker`` refuses ``kind`` messages to ``destination`` for good (None: it takes them).

    ``spec`` is the row's stored spec (JSON), declared first as the relay does.
    """
    try:
        validate_name("destination", destination)
        if spec is not None:
            await broker.declare(DestinationSpec.from_json(orjson.loads(spec)))
        declared = await broker.get_destination(destination)
        if declared is not None and declared.kind != kind:
            noun = "a queue (commands)" if declared.kind == "command" else "a topic (events)"
            raise ConfigurationError(f"{destination!r} is declared as {noun}, but this message is a {kind}")
    except (ConfigurationError, ValueError, TypeError) as exc:
        return str(exc)
    return None


@attrs.frozen
class RefusedRow:
    """An outbox row as an operator sees it (``error`` None: still waiting to be published)."""

    seq: int
    message_id: str
    destination: str
    kind: str
    type: str
    key: str | None
    headers: dict[str, Any]
    body: bytes
    created_at: str
    error: str | None

    @classmethod
    def from_row(cls, row: Any) -> RefusedRow:
        created = row.created_at.isoformat() if row.created_at is not None else ""
        headers = orjson.loads(row.headers) if row.headers else {}
        body = row.body if type(row.body) is bytes else bytes(row.body)
        return cls(
            row.seq, row.message_id, row.destination, row.kind, row.type, row.key, headers, body, created, row.error
        )


_COLUMNS = (
    _o.c.seq,
    _o.c.message_id,
    _o.c.destination,
    _o.c.kind,
    _o.c.type,
    _o.c.key,
    _o.c.headers,
    _o.c.body,
    _o.c.created_at,
    _o.c.error,
)


async def refused_rows(engine: AsyncEngine, *, limit: int | None = None) -> tuple[list[RefusedRow], int]:
    """The refused rows, oldest first (at most ``limit``), and how many there are in all."""
    stmt = select(*_COLUMNS).where(_o.c.error.isnot(None)).order_by(_o.c.seq)
    async with engine.connect() as conn:
        rows = (await conn.execute(stmt.limit(limit) if limit else stmt)).all()
        total = (await conn.execute(select(func.count()).where(_o.c.error.isnot(None)))).scalar_one()
    return [RefusedRow.from_row(r) for r in rows], int(total)


async def get_row(engine: AsyncEngine, message_id: str) -> RefusedRow | None:
    """The outbox row of ``message_id`` (refused or waiting), or None."""
    async with engine.connect() as conn:
        row = (await conn.execute(select(*_COLUMNS).where(_o.c.message_id == message_id))).first()
    return RefusedRow.from_row(row) if row is not None else None


@attrs.frozen
class RetryResult:
    """What :func:`retry` did: rows put back in line, and those still refused with their reason."""

    requeued: int
    still_refused: dict[str, str]  # message id -> reason
    unknown: list[str]  # ids given that are not refused rows


async def retry(engine: AsyncEngine, broker: Broker, message_ids: Sequence[str] | None = None) -> RetryResult:
    """Put refused rows (``message_ids``, else all) back in line, except those ``broker`` would refuse
    again at once: their ``error`` is brought up to date and they stay set aside."""
    stmt = select(_o.c.seq, _o.c.message_id, _o.c.destination, _o.c.kind, _o.c.spec).where(_o.c.error.isnot(None))
    if message_ids:
        stmt = stmt.where(_o.c.message_id.in_(list(message_ids)))
    async with engine.connect() as conn:
        rows = (await conn.execute(stmt)).all()
    reasons: dict[tuple[str, str, str | None], str | None] = {}
    ok: list[int] = []
    still: dict[str, str] = {}
    updates: list[dict[str, Any]] = []
    for seq, message_id, destination, kind, spec in rows:
        k = (destination, kind, spec)
        if k not in reasons:
            reasons[k] = await refusal(broker, destination, kind, spec)
        reason = reasons[k]
        if reason is None:
            ok.append(seq)
        else:
            still[message_id] = reason
            updates.append({"b_seq": seq, "b_error": reason})
    async with engine.begin() as conn:
        if ok:
            await conn.execute(update(_o).where(_o.c.seq.in_(ok), _o.c.error.isnot(None)).values(error=None))
        if updates:
            await conn.execute(MARK_REFUSED, updates)
    found = {r.message_id for r in rows}
    return RetryResult(len(ok), still, [m for m in message_ids or () if m not in found])


async def discard(engine: AsyncEngine, message_ids: Sequence[str] | None = None) -> int:
    """Delete refused rows (``message_ids``, else all) for good; return how many. Waiting rows are kept."""
    stmt = delete(_o).where(_o.c.error.isnot(None))
    if message_ids:
        stmt = stmt.where(_o.c.message_id.in_(list(message_ids)))
    async with engine.begin() as conn:
        return int((await conn.execute(stmt)).rowcount)

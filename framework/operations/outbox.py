"""The outbox backlog for operators: messages waiting to be published, refused ones, the oldest wait;
and the refused rows themselves, retried or discarded by message id.

The same figures and rules as ``framework outbox status|list|retry|discard``, read from the services'
outbox database (the ``sql`` extra); the dashboard shows them when it is given a database URL.
Retry and discard act only on the message ids named (the rows the operator saw and ticked), go
through :mod:`framework.outbox.refusals` (a row the broker would refuse again stays set aside; a row
still waiting is never deleted) and are written to the audit log with who asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from broker import Broker
from framework.operations.actions import ActionResult, audit

__all__ = ["discard_refused", "outbox_backlog", "refused_outbox", "retry_refused"]


async def outbox_backlog(engine: Any) -> dict[str, Any]:
    """``waiting``, ``refused``, ``sent`` and ``oldest_waiting_seconds`` of the outbox behind ``engine``
    (an SQLAlchemy async engine); ``{"error": ...}`` in one line when the database cannot tell."""
    from sqlalchemy import func, select

    from framework.outbox.schema import outbox_table, sent_table

    o = outbox_table
    try:
        async with engine.connect() as conn:
            waiting = (await conn.execute(select(func.count()).where(o.c.error.is_(None)))).scalar_one()
            refused = (await conn.execute(select(func.count()).where(o.c.error.isnot(None)))).scalar_one()
            oldest = (await conn.execute(select(func.min(o.c.created_at)).where(o.c.error.is_(None)))).scalar()
            sent = (await conn.execute(select(func.count()).select_from(sent_table))).scalar_one()
    except Exception as exc:  # a missing table, a database down: said on the page, not a crash
        text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        return {"error": text[0] if text else type(exc).__name__}
    if oldest is not None and oldest.tzinfo is None:
        oldest = oldest.replace(tzinfo=UTC)
    age = (datetime.now(UTC) - oldest).total_seconds() if oldest is not None else None
    return {"waiting": waiting, "refused": refused, "sent": sent, "oldest_waiting_seconds": age}


async def refused_outbox(engine: Any, *, limit: int = 200) -> tuple[list[dict[str, Any]], int]:
    """The refused rows oldest first (at most ``limit``), each with ``id``, ``destination``, ``kind``,
    ``type``, ``reason``, ``created_at`` and its body redacted as the dead-letter view shows it; and
    how many there are in all."""
    from framework.dead_letters import body_view
    from framework.outbox.refusals import refused_rows

    rows, total = await refused_rows(engine, limit=limit)
    return [
        {
            "id": r.message_id,
            "destination": r.destination,
            "kind": r.kind,
            "type": r.type,
            "reason": r.error or "",
            "created_at": r.created_at[:19],
            **body_view(r.body),
        }
        for r in rows
    ], total


def _named(message_ids: Sequence[str], verb: str) -> list[str]:
    ids = list(dict.fromkeys(m for m in message_ids if m))
    if not ids:  # never "all": an empty selection must not turn into every refused row
        raise ValueError(f"nothing selected: tick the refused outbox rows to {verb}")
    return ids


async def retry_refused(engine: Any, broker: Broker, message_ids: Sequence[str], *, who: str) -> Any:
    """Put exactly these refused rows back in line, except those ``broker`` would refuse again at once
    (they stay, reason brought up to date); the :class:`~framework.outbox.refusals.RetryResult`."""
    from framework.outbox.refusals import retry

    ids = _named(message_ids, "retry")
    result = await retry(engine, broker, ids)
    audit(
        who,
        "outbox.retry",
        asked=len(ids),
        requeued=result.requeued,
        still_refused=len(result.still_refused),
        gone=len(result.unknown),
        ids=ids[:20],
    )
    return result


async def discard_refused(engine: Any, message_ids: Sequence[str], *, who: str) -> ActionResult:
    """Delete exactly these refused rows for good (a row waiting again, or gone, is left and counted)."""
    from framework.outbox.refusals import discard

    ids = _named(message_ids, "discard")
    removed = await discard(engine, ids)
    audit(who, "outbox.discard", asked=len(ids), discarded=removed, ids=ids[:20])
    return ActionResult("discard", len(ids), removed)

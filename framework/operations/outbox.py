"""The outbox backlog for operators: messages waiting to be published, refused ones, the oldest wait.

The same figures as ``framework outbox status``, read from the services' outbox database (the
``sql`` extra); the dashboard shows them when it is given a database URL.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

__all__ = ["outbox_backlog"]


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

"""Scheduled messages: what every transport that stores messages until a due time reports.

A message whose ``deliver-at`` header lies ahead is stored by ``publish`` and moved to its
destination atomically when due (:class:`broker.capabilities.Scheduler`).
"""

from __future__ import annotations

import attrs

from broker.envelope import Envelope
from broker.headers import DELIVER_AT

__all__ = ["MoveResult", "ScheduledMessage", "due_of"]


def due_of(env: Envelope) -> int | None:
    """The envelope's due time (Unix ms) from its ``deliver-at`` header, or None when it has none."""
    value = env.headers.get(DELIVER_AT) if env.headers else None
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"header {DELIVER_AT!r} must be Unix milliseconds, got {value!r}") from None


@attrs.frozen
class ScheduledMessage:
    """A message waiting for its due time."""

    message_id: str
    destination: str
    partition: int
    due_ms: int
    envelope: Envelope | None  # None when its entry could not be decoded (shown as such, never hidden)


@attrs.frozen
class MoveResult:
    """What one pass of :meth:`~broker.capabilities.Scheduler.move_scheduled` did."""

    moved: int
    next_due_ms: int | None  # earliest due time the index knows of after the pass (a hint), None: nothing
    more: bool  # some partition hit the per-call limit: call again at once

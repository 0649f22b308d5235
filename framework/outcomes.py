"""How a handler attempt ended (Outcome), and the message it handled as middleware sees it.

The types of :mod:`framework.middleware` that the runtime and the observer read too; import them
from :mod:`framework` or :mod:`framework.middleware`, which re-export them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Any, Literal

import attrs

from broker import Delivery

__all__ = ["CallNext", "InboundMessage", "Outcome", "Status"]

Status = Literal["success", "duplicate", "retry", "dead_letter"]


@attrs.frozen(slots=True)
class Outcome:
    """How one handler attempt ended, and what the runtime does next.

    ``status``:

    * ``success``: the handler returned; its staged messages are published, then the message is
      acknowledged;
    * ``duplicate``: the message was processed before (``ctx.sql_transaction`` found it, or its
      Redis effects were already applied); acknowledged, nothing is sent twice;
    * ``retry``: the attempt failed and the message runs again after ``delay`` seconds: in its
      lane (``in_place``: at once for immediate retries, or with a policy's ``in_place``) or
      through the group's retry path;
    * ``dead_letter``: the attempt failed for good (``reason`` says why); the message moves to
      the dead-letter queue.

    ``exception`` is what failed the attempt (None on success), ``attempt`` its number (from 1).
    """

    status: Status
    attempt: int
    exception: BaseException | None = None
    delay: float = 0.0
    in_place: bool = False
    reason: str = ""

    @property
    def ok(self) -> bool:
        """Whether the message is settled as processed (success or duplicate)."""
        return self.status in ("success", "duplicate")

    @classmethod
    def retry_later(cls, attempt: int, delay: float, exception: BaseException | None = None) -> Outcome:
        """A retry through the group's retry path after ``delay`` seconds (the lane moves on)."""
        return cls("retry", attempt, exception, delay=delay)


@attrs.frozen(slots=True)
class InboundMessage:
    """The message an attempt handles, as middleware sees it (headers are read-only)."""

    id: str
    type: str
    key: str | None
    destination: str
    partition: int
    attempt: int
    headers: Mapping[str, str]
    payload: Any

    @classmethod
    def of(cls, delivery: Delivery, payload: Any, attempt: int) -> InboundMessage:
        """The view of ``delivery`` for attempt ``attempt``."""
        env = delivery.envelope
        assert env is not None
        return cls(
            env.id,
            env.type,
            env.key,
            env.destination,
            delivery.source.partition,
            attempt,
            MappingProxyType(env.headers),
            payload,
        )


CallNext = Callable[[], Awaitable[Outcome]]
"""Runs the rest of the chain and the handler; returns the attempt's :class:`Outcome`."""

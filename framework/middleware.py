"""Middleware: code that wraps every handler attempt, sees the message and learns the outcome.

A middleware is ``async def mw(message, ctx, call_next) -> Outcome``::

    async def timing(message: InboundMessage, ctx: Context, call_next: CallNext) -> Outcome:
        started = time.perf_counter()
        outcome = await call_next()  # the rest of the chain, then the handler
        log.info("handled", message_id=message.id, status=outcome.status, seconds=time.perf_counter() - started)
        return outcome

* ``message`` (:class:`InboundMessage`) is the incoming message: id, type, key, destination,
  partition, attempt, headers (read-only) and the decoded payload.
* ``ctx`` is the handler's :class:`~framework.Context` for this attempt: what middleware writes
  onto outgoing messages goes through it (``ctx.set_outgoing_header(name, value)`` applies to
  every message this attempt stages, before or after the call; ``ctx.outgoing`` lists them).
* ``call_next()`` runs the rest of the chain and the handler and returns an :class:`Outcome`; it
  does not raise for a failed attempt. The innermost call catches the handler's exception (a
  timeout too: :class:`~framework.retries.HandlerTimeout`) and applies the handler's
  :class:`~framework.retries.RetryPolicy`, so every middleware learns whether the attempt
  succeeded, will be retried (``delay`` seconds later, in place or through the retry path) or is
  dead-lettered. A middleware that raises fails the attempt like a handler exception: the
  middleware outside it gets the resulting ``retry``/``dead_letter`` outcome from its call_next.
* The runtime carries out the outcome the outermost middleware returns. Return what call_next
  returned; a middleware may also answer without calling it (the handler does not run): success
  acknowledges the message, ``Outcome.retry_later(...)`` reschedules it.

Order: the runtime's middleware (``Runtime(..., middleware=[...])``) is outermost, then the
service's (``Service(..., middleware=[...])`` and ``@service.middleware``), each in registration
order; the first registered sees the call first and the outcome last. A retry in place is a new
attempt: the chain runs again. Duplicates found by the Redis inbox before any handler runs do not
pass through middleware (nothing runs); a duplicate found by ``ctx.sql_transaction`` and Redis
effects already applied do (``status == "duplicate"``).

The framework's own per-message work (the failure log, handler counters, the inbox, acks) is not
middleware: any chain member, even an empty one, costs a coroutine frame and a closure per
message, and a handler with no middleware runs without a chain at all. The failure log and the
retry/dead-letter settlement read the same :class:`Outcome` a middleware sees.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

import attrs

from broker import Delivery

if TYPE_CHECKING:
    from framework.context import Context

__all__ = ["CallNext", "InboundMessage", "Middleware", "Outcome", "Status"]

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

Middleware = Callable[[InboundMessage, "Context", CallNext], Awaitable[Outcome]]
"""``async def mw(message, ctx, call_next) -> Outcome``; see the module docstring."""

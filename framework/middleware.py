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

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from framework.outcomes import CallNext, InboundMessage, Outcome, Status

if TYPE_CHECKING:
    from framework.context import Context

__all__ = ["CallNext", "InboundMessage", "Middleware", "Outcome", "Status"]

Middleware = Callable[[InboundMessage, "Context", CallNext], Awaitable[Outcome]]
"""``async def mw(message, ctx, call_next) -> Outcome``; see the module docstring."""

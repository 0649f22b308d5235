"""Attempt: run the handler for one message, inside the middleware chain, and decide what's next.

:meth:`Attempts.run` calls the handler (async, or sync in a worker thread) with a fresh
:class:`~framework.Context` per attempt. On success it returns the context (the lane batches the
settlement); a handler that recorded Redis effects is committed right here, since a failed commit
is a failed attempt. On failure the handler's :class:`~framework.retries.RetryPolicy` decides: an
immediate or in-place retry runs again in the lane; a delayed retry or a dead letter is handed to
the settle stage. Every failed attempt is logged once, from the same :class:`Outcome` middleware sees.

Timeouts: the watchdog (see the upkeep stage) cancels a run past the handler's timeout through
its slot's cancel scope. Without middleware that is the lane's scope around many runs (no scope
per message; :meth:`Attempts.timed_out` settles the run); with middleware each attempt has its own
scope inside the innermost ``call_next``, so the chain sees the timeout as a ``retry`` or
``dead_letter`` outcome with a :class:`~framework.retries.HandlerTimeout`.

With no middleware, no chain is built: the handler is called directly, as fast as before.
"""

from __future__ import annotations

import functools
from typing import Any

import anyio
import attrs

from broker import Delivery, now_ms
from broker.headers import REPLY_TO
from framework.context import Context
from framework.effects import AlreadyProcessed
from framework.group_commit import RolledBackWithGroup
from framework.middleware import CallNext, InboundMessage, Middleware, Outcome
from framework.retries import Decision, HandlerTimeout
from framework.runtime.ledger import Ledger, Slot
from framework.runtime.settle import SETTLED, Settlement
from framework.runtime.wiring import Wiring

__all__ = ["MAX_RERUNS", "Attempts", "outcome_of"]

MAX_RERUNS = 10
"""Runs of one attempt whose SQL block was rolled back with its shared transaction through no fault
of its own (:class:`~framework.group_commit.RolledBackWithGroup`) run again at once, not counted as
failed attempts, this many times; then such a rollback counts as a failed attempt."""


def outcome_of(decision: Decision, attempt: int, exc: BaseException, *, in_place: bool = False) -> Outcome:
    """The :class:`Outcome` of a failed attempt the retry policy decided on."""
    if decision.action == "dead":
        return Outcome("dead_letter", attempt, exc, reason=decision.reason)
    return Outcome("retry", attempt, exc, delay=decision.seconds, in_place=decision.action == "retry" or in_place)


class Attempts:
    """The attempt stage of one consumer."""

    def __init__(self, wiring: Wiring, settle: Settlement) -> None:
        self.wiring = wiring
        self.settle = settle
        self.handler = wiring.handler
        self.stats = wiring.stats
        self.log = wiring.log
        self.middleware: tuple[Middleware, ...] = tuple(wiring.middleware)
        self.run = self._run_chain if self.middleware else self._run_direct
        # tracing/metrics without middleware: the direct path calls the observer around each attempt
        self.observer: Any = None if self.middleware else wiring.observer

    # -- deciding ---------------------------------------------------------------------------------

    def failed(self, attempt: int, exc: BaseException, *, timed_out: bool = False) -> Outcome:
        """Count a failed attempt and decide what follows (a timeout is never retried in place)."""
        self.stats.failed += 1
        policy = self.handler.retry
        decision = policy.decide(attempt, exc)
        if timed_out:
            if decision.action == "retry":  # the lane must move on
                decision = attrs.evolve(decision, action="delay")
            return outcome_of(decision, attempt, exc)
        return outcome_of(decision, attempt, exc, in_place=policy.in_place)

    def log_failure(self, d: Delivery, outcome: Outcome) -> None:
        """The one log line per failed attempt."""
        if outcome.status == "dead_letter":
            what = "moving to the dead-letter queue"
        elif outcome.in_place and not outcome.delay:
            what = "retrying now"
        else:
            what = f"retrying in {outcome.delay:.2f}s"
        exc = outcome.exception
        self.log.warning(
            f"handler failed; {what}",
            message_id=d.message_id,
            attempt=outcome.attempt,
            max_attempts=self.handler.retry.max_attempts,
            error=f"{type(exc).__name__}: {exc}",
            exc_info=exc,
        )

    async def _call_sync(self, payload: Any, ctx: Context) -> Any:
        args = (payload, ctx) if self.handler.takes_context else (payload,)
        # A thread cannot be interrupted: on a timeout or a forced shutdown it is abandoned.
        return await anyio.to_thread.run_sync(
            functools.partial(self.handler.fn, *args), limiter=self.wiring.thread_limiter, abandon_on_cancel=True
        )

    # -- without middleware: the hot path -----------------------------------------------------------------

    async def _run_direct(self, ledger: Ledger, d: Delivery, payload: Any, attempt: int, slot: Slot) -> Any:
        """Call the handler until it succeeds (its context) or the failure is settled (None).

        Returns ``SETTLED`` when the run committed its effects together with its ack.
        """
        handler = self.handler
        fn = handler.fn
        broker = self.wiring.broker
        observer = self.observer
        watch = None
        first_failed: int | None = None
        reruns = 0
        while True:
            ctx = Context(d, handler, attempt, broker, ledger.fence, slot.flush)
            if observer is not None:
                watch = observer.begin(d, attempt, slot)
            slot.delivery = d
            slot.attempt = attempt
            slot.runs += 1
            try:
                if not handler.is_async:
                    result = await self._call_sync(payload, ctx)
                elif handler.takes_context:
                    result = await fn(payload, ctx)
                else:
                    result = await fn(payload)
                if ctx._sql_error is not None:  # its SQL block did not commit, and the handler caught that
                    raise ctx._sql_error
                if result is not None or REPLY_TO in ctx.envelope.headers:  # a request: its reply
                    ctx._set_result(result)
                slot.delivery = None
                if ctx.redis_effects is not None:  # a failed commit (the broker unreachable) is a failed attempt
                    await self.settle.commit_effects(ledger, d, ctx, attempt)
                    if watch is not None:
                        observer.end(watch, "success")
                    return SETTLED
                if ctx._ack_write is not None:  # written with the ack (a saga step's state)
                    d.settle_write = ctx._ack_write
                if handler.sql_inbox:
                    self._check_sql_inbox(d, ctx)
            except AlreadyProcessed:
                # A SQL transaction found the message recorded: acked like a success, counted as a
                # duplicate. What it staged before the block is published (same derived ids).
                slot.delivery = None
                self.stats.duplicates += 1
                ctx.mark_duplicate()
                if watch is not None:
                    observer.end(watch, "duplicate")
                return ctx
            except (Exception, SystemExit) as exc:  # sys.exit() in a handler fails its attempt, not the process
                slot.delivery = None
                if isinstance(exc, RolledBackWithGroup) and reruns < MAX_RERUNS:  # another block's doing
                    reruns += 1
                    if watch is not None:
                        observer.end(watch, "retry", Outcome("retry", attempt, exc, delay=0.0, in_place=True))
                    continue
                first_failed = first_failed or now_ms()
                outcome = self.failed(attempt, exc)
                if watch is not None:
                    observer.end(watch, outcome.status, outcome)
                if await self._retried_in_place(d, outcome):
                    attempt += 1
                    continue
                await self.settle.failure(ledger, d, outcome, first_failed)
                return None
            except BaseException:  # cancelled: by the watchdog (settled by timed_out) or at shutdown
                if watch is not None:
                    observer.interrupted(watch)
                    slot.watch = watch
                raise
            if watch is not None:
                observer.end(watch, "duplicate" if ctx.duplicate else "success")
            return ctx

    def _check_sql_inbox(self, d: Delivery, ctx: Context) -> None:
        """Say loudly when an ``inbox="sql"`` handler finished without its SQL transaction:
        nothing recorded this message, so a redelivered copy runs again."""
        if not ctx._sql_done and not ctx.duplicate:
            self.log.warning(
                "handler declared inbox='sql' finished without ctx.sql_transaction: nothing records this message "
                "as processed, so a redelivered copy would run again. Put its effects in the block, or declare "
                "the handler with inbox=True",
                message_id=d.message_id,
            )

    async def _retried_in_place(self, d: Delivery, outcome: Outcome) -> bool:
        """Log a failed attempt; for a retry in place, wait its delay and return True."""
        self.log_failure(d, outcome)
        if outcome.status != "retry" or not outcome.in_place:
            return False
        self.stats.retried += 1
        if outcome.delay:
            await anyio.sleep(outcome.delay)
        return True

    async def timed_out(self, ledger: Ledger, d: Delivery, slot: Slot) -> None:
        """Settle a run the watchdog cancelled in the lane's scope: a failed attempt, retried
        through the retry path (never in place) or dead-lettered."""
        slot.delivery = None
        outcome = self.failed(slot.attempt, self._timeout_error(), timed_out=True)
        if slot.watch is not None:  # the attempt's span ends with its timeout
            watch, slot.watch = slot.watch, None
            self.observer.end(watch, outcome.status, outcome)
        self.log_failure(d, outcome)
        with anyio.CancelScope(shield=True):
            await self.settle.failure(ledger, d, outcome, None)

    def _timeout_error(self) -> HandlerTimeout:
        handler = self.handler
        sync = "" if handler.is_async else " (a sync handler's thread cannot be stopped: it was abandoned)"
        timeout = handler.timeout or 0.0
        return HandlerTimeout(f"{handler.label} ran longer than its {timeout:g} s timeout and was cancelled{sync}")

    # -- with middleware ------------------------------------------------------------------------------------

    async def _run_chain(self, ledger: Ledger, d: Delivery, payload: Any, attempt: int, slot: Slot) -> Any:
        """Like :meth:`_run_direct`, each attempt inside the middleware chain (see the module docstring)."""
        first_failed: int | None = None
        while True:
            ctx = Context(d, self.handler, attempt, self.wiring.broker, ledger.fence, slot.flush)
            message = InboundMessage.of(d, payload, attempt)
            settled: list[bool] = []  # the innermost call committed effects together with the ack
            innermost = functools.partial(self._innermost, ledger, d, payload, ctx, slot, settled)
            outcome = await self._layer(0, message, ctx, innermost)
            if settled:
                return SETTLED  # acknowledged with its effects: nothing a middleware does undoes that
            if outcome.status == "success":
                if ctx._ack_write is not None:  # written with the ack (a saga step's state), only
                    d.settle_write = ctx._ack_write  # when the chain let the run succeed
                return ctx
            if outcome.status == "duplicate":
                if not ctx.duplicate:
                    self.stats.duplicates += 1
                    ctx.mark_duplicate()
                return ctx
            first_failed = first_failed or now_ms()
            if await self._retried_in_place(d, outcome):
                attempt += 1
                continue
            await self.settle.failure(ledger, d, outcome, first_failed)
            return None

    async def _layer(self, index: int, message: InboundMessage, ctx: Context, innermost: CallNext) -> Outcome:
        """Run middleware ``index`` with the rest of the chain as its call_next; its exception fails the attempt."""
        if index == len(self.middleware):
            return await innermost()
        call_next = functools.partial(self._layer, index + 1, message, ctx, innermost)
        try:
            outcome = await self.middleware[index](message, ctx, call_next)
        except (Exception, SystemExit) as exc:
            return self.failed(message.attempt, exc)
        if not isinstance(outcome, Outcome):
            error = TypeError(f"middleware {self.middleware[index]!r} returned {outcome!r}, not an Outcome")
            return self.failed(message.attempt, error)
        return outcome

    async def _innermost(
        self, ledger: Ledger, d: Delivery, payload: Any, ctx: Context, slot: Slot, settled: list[bool]
    ) -> Outcome:
        """The handler (with its own timeout scope) and its effects commit, as an Outcome."""
        handler = self.handler
        attempt = ctx.attempt
        with anyio.CancelScope() as scope:
            slot.scope = scope
            slot.delivery = d
            slot.attempt = attempt
            slot.runs += 1
            try:
                mark = ctx._run_mark()
                for rerun in range(MAX_RERUNS + 1):
                    try:
                        if not handler.is_async:
                            result = await self._call_sync(payload, ctx)
                        elif handler.takes_context:
                            result = await handler.fn(payload, ctx)
                        else:
                            result = await handler.fn(payload)
                        if ctx._sql_error is not None:  # its SQL block did not commit, and the handler caught that
                            raise ctx._sql_error
                        if result is not None or REPLY_TO in ctx.envelope.headers:  # a request: its reply
                            ctx._set_result(result)
                        break
                    except RolledBackWithGroup:  # another block's doing: run again, not a failed attempt
                        if rerun == MAX_RERUNS:
                            raise
                        ctx._reset_run(mark)
                slot.delivery = None
                if ctx.redis_effects is not None:
                    outcome = await self.settle.commit_effects(ledger, d, ctx, attempt)
                    settled.append(True)
                    return outcome
                if handler.sql_inbox:
                    self._check_sql_inbox(d, ctx)
            except AlreadyProcessed:
                self.stats.duplicates += 1
                ctx.mark_duplicate()
                return Outcome("duplicate", attempt)
            except (Exception, SystemExit) as exc:
                return self.failed(attempt, exc)
            finally:
                slot.delivery = None
                slot.scope = None
        if scope.cancelled_caught:
            return self.failed(attempt, self._timeout_error(), timed_out=True)
        return Outcome("duplicate" if ctx.duplicate else "success", attempt)

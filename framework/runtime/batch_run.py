"""Running one batch: call the batch handler with the list, then settle every message on its own.

:meth:`BatchRunner.run` calls the handler (async, or sync in a worker thread) with the payloads
and a :class:`~framework.batch_context.BatchContext`, within the handler's timeout. Then each
message is settled as a per-message handler's would be:

* success: its staged messages are published and it is acknowledged (its
  ``ctx[i].redis_transaction()`` writes committed with its ack);
* :class:`~framework.batching.BatchFailed`: only the messages it names failed, each with its own
  exception, each through the retry policy (retried in place as a smaller batch, parked for a
  delayed retry, or dead-lettered with its own reason); an index outside the batch (or not an
  int) fails the whole batch with that reason instead, so no message is acked in another's place;
* any other exception, a timeout, or ``all_or_nothing``: every message of the batch failed;
* :class:`~framework.batch_context.BatchDuplicates` (the batch's SQL block found messages
  processed before): those are acked as duplicates, the handler runs again with the others.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import anyio

from broker import Delivery, now_ms
from framework.batch_context import BatchContext, BatchDuplicates
from framework.batching import BatchAborted, BatchFailed, checked_failures
from framework.context import Context
from framework.retries import HandlerTimeout
from framework.runtime.admit import Admission, Work
from framework.runtime.attempt import Attempts
from framework.runtime.ledger import Ledger
from framework.runtime.settle import Finished, Settlement
from framework.runtime.supervisor import is_connection_error
from framework.runtime.wiring import Wiring

__all__ = ["BatchRunner"]


class BatchRunner:
    """Runs a batch handler's batches and settles their messages (see the module docstring)."""

    def __init__(self, wiring: Wiring, settle: Settlement, attempts: Attempts, admission: Admission) -> None:
        self.wiring = wiring
        self.handler = wiring.handler
        self.policy = wiring.handler.batch
        self.settle = settle
        self.attempts = attempts
        self.admission = admission
        self.stats = wiring.stats
        self.log = wiring.log

    async def run(self, ledger: Ledger, works: list[Work], *, suspect: bool = False) -> None:
        """Run ``works`` (one partition's, in order) until each message is settled; never raises for
        handler failures. A suspect (one message) is counted before it runs and acked at once."""
        settled: set[int] = set()  # id() of the deliveries settled or queued for their acks
        try:
            if suspect and not await self.admission.count_suspect_run(ledger, works[0][0]):
                return
            attempt = {id(d): d.attempt for d, _ in works}
            first_failed: dict[int, int] = {}
            while works:
                works, delay = await self._run_once(ledger, works, attempt, first_failed, settled, suspect)
                if delay:
                    await anyio.sleep(delay)
        except Exception as exc:  # the broker unreachable, or a framework bug: unsettled messages are redelivered
            what = "batch not settled; its unsettled messages will be redelivered"
            if is_connection_error(exc):
                self.log.warning(what, error=f"{type(exc).__name__}: {exc}")
            else:
                self.log.error(what, exc_info=exc)
            ledger.forget(d for d, _ in works if id(d) not in settled)
            ledger.broken()

    async def _call(self, payloads: list[Any], ctx: BatchContext) -> None:
        """The handler's call, cancelled past its timeout (raised as HandlerTimeout)."""
        handler = self.handler
        args = (payloads, ctx) if handler.takes_context else (payloads,)
        timeout = handler.timeout
        with anyio.CancelScope(deadline=anyio.current_time() + timeout if timeout else float("inf")) as scope:
            if handler.is_async:
                await handler.fn(*args)
            else:  # a thread cannot be interrupted: past the timeout it is abandoned
                call = functools.partial(handler.fn, *args)
                await anyio.to_thread.run_sync(call, limiter=self.wiring.thread_limiter, abandon_on_cancel=True)
        if scope.cancelled_caught:
            raise self.attempts._timeout_error()

    async def _run_once(
        self,
        ledger: Ledger,
        works: list[Work],
        attempt: dict[int, int],
        first_failed: dict[int, int],
        settled: set[int],
        suspect: bool,
    ) -> tuple[list[Work], float]:
        """One handler run over ``works`` and the settling it decides; returns the works to run again
        at once (in-place retries, or the rest after duplicates) and the delay before that run."""
        handler = self.handler
        broker = self.wiring.broker
        contexts = [Context(d, handler, attempt[id(d)], broker, ledger.fence) for d, _ in works]
        ctx = BatchContext(contexts, handler)
        failures: dict[int, BaseException] = {}
        timed_out = False
        try:
            await self._call([payload for _, payload in works], ctx)
        except BatchDuplicates as dup:  # nothing of the run was kept: ack those, run the rest again
            await self._duplicates(ledger, works, contexts, dup.indexes, settled, suspect)
            dropped = set(dup.indexes)
            return [w for i, w in enumerate(works) if i not in dropped], 0.0
        except BatchFailed as exc:
            failures = self._failures(exc, len(works))
        except (Exception, SystemExit) as exc:  # sys.exit() in a handler fails the batch, not the process
            timed_out = isinstance(exc, HandlerTimeout)
            failures = dict.fromkeys(range(len(works)), exc)
        done = Finished()
        for i, c in enumerate(contexts):
            if i in failures:
                continue
            d = works[i][0]
            if c.redis_effects is not None:  # its writes with its own ack
                try:
                    await self.settle.commit_effects(ledger, d, c, c.attempt)
                    settled.add(id(d))
                except Exception as exc:
                    failures[i] = exc
                continue
            if handler.sql_inbox and i not in ctx.committed:
                self.attempts._check_sql_inbox(d, c)
            settled.add(id(d))
            if suspect:
                await self.settle.at_once(ledger, d, c)
            else:
                done.add(d, c, time.monotonic())
        await self.settle.finished(ledger, done)  # the successes first: published, acks queued
        return await self._failed(ledger, works, failures, ctx, attempt, first_failed, settled, timed_out)

    def _failures(self, exc: BatchFailed, size: int) -> dict[int, BaseException]:
        """Which messages a BatchFailed fails: those it names; all (all_or_nothing, or a bad index)."""
        try:
            named = checked_failures(exc, size)
        except ValueError as bad:
            return dict.fromkeys(range(size), bad)
        assert self.policy is not None
        if not self.policy.all_or_nothing:
            return named
        first, error = next(iter(named.items()))
        aborted = BatchAborted(
            f"the batch failed as a whole (all_or_nothing): message {first} failed with {type(error).__name__}: {error}"
        )
        return {i: named.get(i, aborted) for i in range(size)}

    async def _failed(
        self,
        ledger: Ledger,
        works: list[Work],
        failures: dict[int, BaseException],
        ctx: BatchContext,
        attempt: dict[int, int],
        first_failed: dict[int, int],
        settled: set[int],
        timed_out: bool,
    ) -> tuple[list[Work], float]:
        """Settle each failed message per the retry policy; return those retried in place now."""
        again: list[Work] = []
        delay = 0.0
        late = sorted(i for i in failures if i in ctx.committed)
        if late:
            self.log.warning(
                "messages failed after the batch's SQL block committed their inbox rows: their retries find them "
                "processed. Raise BatchFailed inside ctx.sql_transaction to keep them out of the commit",
                indexes=late,
            )
        for i, exc in sorted(failures.items()):
            d: Delivery = works[i][0]
            outcome = self.attempts.failed(attempt[id(d)], exc, timed_out=timed_out)
            first_failed.setdefault(id(d), now_ms())
            self.attempts.log_failure(d, outcome)
            if outcome.status == "retry" and outcome.in_place:
                self.stats.retried += 1
                attempt[id(d)] += 1
                again.append(works[i])
                delay = max(delay, outcome.delay)
                continue
            settled.add(id(d))
            await self.settle.failure(ledger, d, outcome, first_failed[id(d)])
        return again, delay

    async def _duplicates(
        self,
        ledger: Ledger,
        works: list[Work],
        contexts: list[Context],
        indexes: list[int],
        settled: set[int],
        suspect: bool,
    ) -> None:
        """Acknowledge the messages the batch's SQL block found processed before (counted as duplicates)."""
        done = Finished()
        for i in indexes:
            d, c = works[i][0], contexts[i]
            self.stats.duplicates += 1
            c.mark_duplicate()
            settled.add(id(d))
            if suspect:
                await self.settle.at_once(ledger, d, c)
            else:
                done.add(d, c, time.monotonic())
        await self.settle.finished(ledger, done)

"""Settle: carry out how a message's attempt ended, and send the acks.

* success (:meth:`Settlement.finished`): publish what the handlers staged, then queue the acks
  (the ack flusher, :meth:`Settlement.ack_loop`, sends one XACK, with the inbox marks made final,
  for many);
* a run's recorded writes (:meth:`Settlement.commit_effects`: ``ctx.redis_transaction()``, a saga
  step's state): writes, outgoing messages, inbox mark and ack in one atomic step (one Lua call on Redis);
* a request's reply (``reply-to``, see :mod:`framework.replies`): sent after the staged messages and
  before the ack (after the commit, for a run with recorded writes); a dead-lettered request's error
  reply before its dead-letter move;
* failure (:meth:`Settlement.failure`): the retry path (acknowledged and parked until due) or
  the dead-letter queue, each atomic with the ack; :meth:`Settlement.dead_letter` also takes
  messages that cannot run at all (undecodable, crash loops).

Whatever cannot be settled (the broker unreachable) is forgotten by the ledger and stays pending:
it is redelivered after the visibility timeout, and the inbox drops a second run. On an owned
partition (:mod:`framework.runtime.ownership`) every settle call carries the tenure's fencing token;
a call refused by the fencing check (:class:`~broker.LeaseLost`: another instance owns the
partition now) changes nothing, and the tenure ends (:meth:`Settlement.lost`), as it does when a
message cannot be settled at all (:meth:`~framework.runtime.ledger.Ledger.broken`).
"""

from __future__ import annotations

from typing import Any

import anyio

from broker import Delivery, EffectsFailed, Envelope, GuardedWrite, LeaseLost, now_ms
from broker import headers as h
from broker.headers import DELIVER_AT
from framework.context import Context
from framework.dead_letters.reasons import exception_reason
from framework.logs import debug_enabled
from framework.middleware import Outcome
from framework.observability import hooks
from framework.replies import error_reply, send_replies
from framework.runtime.connectivity import healthy
from framework.runtime.ledger import Ledger
from framework.runtime.supervisor import is_connection_error
from framework.runtime.wiring import Wiring

__all__ = ["SETTLED", "Finished", "Settlement"]

SETTLED: Any = object()  # an attempt whose message is settled already (effects committed with the ack)


class Finished:
    """Runs that finished in a lane and wait to be settled: published, then acknowledged."""

    __slots__ = ("credits", "deliveries", "duplicate_ids", "duplicates", "outgoing", "publishing", "replies", "since")

    def __init__(self) -> None:
        self.credits: list[Any] = []  # counters of other handlers of a shared group, one per success of theirs
        self.deliveries: list[Delivery] = []
        self.outgoing: list[Any] = []
        self.replies: list[Envelope] = []  # replies to requests: sent after the outgoing messages, before the acks
        self.duplicates = 0
        self.duplicate_ids: list[int] = []  # id() of the duplicate deliveries (for the debug lines)
        self.since = 0.0
        # set while a settle of these runs publishes their staged messages: the lane and the watchdog
        # (settling runs a long next run holds back) both settle them, one after the other, in order
        self.publishing: anyio.Event | None = None

    def add(self, d: Delivery, ctx: Context, now: float, stats: Any = None) -> None:
        """Record a successful run finished at ``now`` (monotonic); ``stats``: the counters of the
        handler that ran it, when not the settling consumer's (a shared group's member)."""
        if not self.deliveries:
            self.since = now
        self.deliveries.append(d)
        if ctx.outgoing:
            self.outgoing += ctx.outgoing
        if ctx._reply is not None:
            self.replies.append(ctx._reply)
        if ctx.duplicate:
            self.duplicates += 1
            self.duplicate_ids.append(id(d))
        elif stats is not None:
            self.credits.append(stats)


class Settlement:
    """The settle stage of one consumer."""

    def __init__(self, wiring: Wiring) -> None:
        self.wiring = wiring
        self.broker = wiring.broker
        self.stats = wiring.stats
        self.handler = wiring.handler
        self.log = wiring.log
        self.debug = debug_enabled()  # a line per message settled
        self._reasons: dict[int, tuple[Any, dict[str, str]]] = {}  # id(source) -> (source, its reason fields)

    def lost(self, ledger: Ledger) -> None:
        """A settle call was fenced: this tenure of the partition is over (the ownership loop logs it)."""
        if ledger.lease is not None:
            ledger.lease.lose("a settle call was refused by the fencing check: another instance owns it now")

    def log_settled(self, d: Delivery, outcome: str, attempt: int | None = None, **fields: Any) -> None:
        """The debug line per message settled, with its outcome (and its last attempt, when known)."""
        if attempt is not None:
            fields["attempt"] = attempt
        self.log.debug("message settled", message_id=d.message_id, outcome=outcome, **fields)

    # -- success ---------------------------------------------------------------------------------

    async def finished(self, ledger: Ledger, done: Finished) -> None:
        """Publish what finished handlers staged, then queue their acks (one flush for many)."""
        while done.publishing is not None:  # an earlier settle of this lane's runs is publishing: keep order
            await done.publishing.wait()
        if not done.deliveries:
            return
        deliveries, outgoing, duplicates = done.deliveries, done.outgoing, done.duplicates
        duplicate_ids, replies, credits = done.duplicate_ids, done.replies, done.credits
        done.deliveries, done.outgoing, done.duplicates = [], [], 0
        if duplicate_ids:
            done.duplicate_ids = []
        if replies:
            done.replies = []
        if credits:
            done.credits = []
        if outgoing or replies:
            done.publishing = publishing = anyio.Event()
            try:
                if outgoing:
                    await self.wiring.publish(outgoing)
                if replies:  # before the acks: a crash between them sends a reply twice, never none
                    await send_replies(self.broker, replies)
            except Exception as exc:
                self.log.error(
                    "could not publish staged messages; they will be redelivered", count=len(deliveries), exc_info=exc
                )
                ledger.forget(deliveries)
                ledger.broken()
                return
            finally:
                done.publishing = None
                publishing.set()
        for stats in credits:  # successes of other handlers sharing the group: counted as theirs
            stats.processed += 1
        self.stats.processed += len(deliveries) - duplicates - len(credits)
        ledger.queue_acks(deliveries)  # processed: room to fetch more while the ack is on its way
        if self.debug:
            for d in deliveries:
                self.log_settled(d, "duplicate" if id(d) in duplicate_ids else "success")

    async def at_once(self, ledger: Ledger, d: Delivery, ctx: Context) -> None:
        """Publish and acknowledge one successful run now (a suspect: see the admit stage)."""
        if ctx.outgoing:
            await self.wiring.publish(ctx.outgoing)
        if ctx._reply is not None:
            await send_replies(self.broker, [ctx._reply])
        try:
            await self.broker.ack(ledger.view, [d], inbox=self.handler.inbox, token=ledger.fence)
        except LeaseLost:
            self.lost(ledger)
            ledger.forget([d])
            self.writes_settled(ledger, [d])
            return
        ledger.forget([d])
        if self.writes_settled(ledger, [d]):
            return
        if not ctx.duplicate:  # a duplicate was counted when it was found
            self.stats.processed += 1
        if self.debug:
            self.log_settled(d, "duplicate" if ctx.duplicate else "success", ctx.attempt)

    async def commit_effects(self, ledger: Ledger, d: Delivery, ctx: Context, attempt: int) -> Outcome:
        """Commit a run's recorded writes, outgoing messages, inbox mark and ack in one step (in a
        tenure that is over, nothing: the message stays pending for the next one).

        Raises if the broker call fails (the attempt failed: the caller applies the retry policy).
        """
        effects = ctx.redis_effects
        assert effects is not None
        lease = ledger.lease
        if lease is not None and lease.lost:  # the tenure is over: its next one runs the message again
            ledger.forget([d])
            return Outcome("duplicate", attempt, reason="lost ownership of the partition: not settled here")
        store = self.wiring.effects_store
        staged = ctx.outgoing
        outgoing = [env for env, _ in staged]
        # Other slots (a Cluster), or scheduled messages (publish stores those until due): publish first
        # (deterministic ids dedup a repeat).
        if outgoing and (not store.commits_outgoing or any(DELIVER_AT in env.headers for env in outgoing)):
            await self.wiring.publish(staged)
            outgoing = []
        else:
            for _, spec in staged:
                if spec is not None:
                    await self.broker.ensure_declared(spec)
        try:
            applied = await store.commit_effects(
                d,
                effects,
                outgoing,
                reason=self._effects_reason(d, attempt),
                token=ledger.fence,
            )
        except LeaseLost:  # fenced: nothing applied; the partition's new owner runs the message
            self.lost(ledger)
            ledger.forget([d])
            return Outcome("duplicate", attempt, reason="lost ownership of the partition: not settled here")
        except EffectsFailed as exc:  # dead-lettered by the same script: a retry would apply them again
            self.stats.dead_lettered += 1
            self.log.error(
                "Redis effects failed part-way; message dead-lettered (Redis has no rollback)",
                message_id=d.message_id,
                error=exc.error,
                applied=exc.applied,
                dlq_entry=exc.dlq_entry,
            )
            outcome = Outcome("dead_letter", attempt, exc, reason="Redis effects failed part-way")
        else:
            if applied:
                self.stats.processed += 1
                outcome = Outcome("success", attempt)
                for fn in effects.applied:
                    try:
                        fn()
                    except Exception as err:  # the writes are committed: the message succeeded all the same
                        self.log.error("an after_commit callback failed", message_id=d.message_id, exc_info=err)
                if outgoing and hooks.METRICS:  # published by the same script
                    hooks.count_sent(outgoing)
                if ctx._reply is not None:  # after the commit: a reply never announces effects not applied
                    await self._reply_after_commit(d, ctx._reply)
            else:
                self.stats.duplicates += 1
                outcome = Outcome("duplicate", attempt)
        ledger.forget([d])
        if self.debug:
            self.log_settled(d, outcome.status, attempt)
        return outcome

    def _effects_reason(self, d: Delivery, attempt: int) -> dict[str, str]:
        """The dead-letter fields an effects commit needs should its writes fail part-way: those
        of :func:`~framework.dead_letters.reasons.base_reason` but the ones the script fills in
        itself (entry id, dead-at, first-failed-at), built once per source."""
        source = d.source
        cached = self._reasons.get(id(source))
        if cached is None or cached[0] is not source:
            fields = {
                h.DLQ_HANDLER: self.handler.label,
                h.DLQ_DESTINATION: source.spec.name,
                h.DLQ_PARTITION: str(source.partition),
                h.DLQ_GROUP: source.group,
            }
            if len(self._reasons) >= 4096:  # (views come and go with partitions' tenures)
                self._reasons.clear()
            cached = self._reasons[id(source)] = (source, fields)
        return {**cached[1], h.DLQ_ATTEMPTS: str(attempt)}

    # -- failure ---------------------------------------------------------------------------------

    async def failure(self, ledger: Ledger, d: Delivery, outcome: Outcome, first_failed: int | None) -> None:
        """Park a failed message for a delayed retry, or dead-letter it; ``first_failed``: Unix ms
        of the first failure this process saw (immediate and in-place retries carry no field)."""
        try:
            if outcome.status == "retry":
                await self.broker.retry_later(
                    d, now_ms() + int(outcome.delay * 1000), attempt=outcome.attempt, token=ledger.fence
                )
                self.stats.retried += 1
                if self.debug:
                    self.log_settled(d, "retry", outcome.attempt, delay=outcome.delay)
            else:
                exc = outcome.exception or RuntimeError(outcome.reason or "dead-lettered by middleware")
                reason = exception_reason(
                    self.handler, d, outcome.attempt, exc, outcome.reason, first_failed_ms=first_failed
                )
                await self.dead_letter(ledger, d, reason, forget=False)
        except LeaseLost:
            self.lost(ledger)
        except Exception as err:
            self.log.error(
                "could not settle a failed message; it stays pending and will be redelivered",
                message_id=d.message_id,
                exc_info=err,
            )
            ledger.broken()
        ledger.forget([d])

    async def dead_letter(self, ledger: Ledger, d: Delivery, reason: dict[str, str], *, forget: bool = True) -> None:
        """Move ``d`` to the dead-letter queue with ``reason`` (atomic with its ack); a request
        gets its error reply first."""
        try:
            fault = error_reply(d.envelope, reason)
            if fault is not None:
                await send_replies(self.broker, [fault])
            entry = await self.broker.dead_letter(d, reason, token=ledger.fence)
        except LeaseLost:
            self.lost(ledger)
        except Exception as err:
            self.log.error("could not dead-letter a message; it stays pending", message_id=d.message_id, exc_info=err)
            ledger.broken()
        else:
            if entry is not None:
                self.stats.dead_lettered += 1
                self.log.error(
                    "message dead-lettered", message_id=d.message_id, reason=reason.get("dlq-reason"), dlq_entry=entry
                )
                if self.debug:
                    self.log_settled(d, "dead_letter", int(reason.get("dlq-attempts") or d.attempt))
        if forget:
            ledger.forget([d])

    async def _reply_after_commit(self, d: Delivery, reply: Envelope) -> None:
        """Send a request's reply once its effects committed (with the ack): if that fails, the
        requester's timeout tells it (its request ran; asking again runs it again)."""
        try:
            await send_replies(self.broker, [reply])
        except Exception as exc:
            self.log_unsettled("could not send the reply after the effects committed", exc, message_id=d.message_id)

    def log_unsettled(self, what: str, exc: BaseException, **fields: Any) -> None:
        """Log a broker call that failed: one warning line for a lost connection (the
        connectivity log says the rest), an error with the traceback for anything else."""
        if is_connection_error(exc):
            self.log.warning(what, error=f"{type(exc).__name__}: {exc}", **fields)
        else:
            self.log.error(what, exc_info=exc, **fields)

    # -- acks --------------------------------------------------------------------------------------

    async def ack_loop(self, ledger: Ledger) -> None:
        """Send queued acks, batched over ``ack_interval``, on a connection of its own (forever)."""
        interval = self.wiring.settings.ack_interval
        ledger.ack_channel = channel = self.broker.channel()
        try:
            while True:
                if not ledger.ack_buffer:  # after a failed flush the buffer is not empty: go at once
                    await ledger.ack_wakeup.wait()
                ledger.ack_wakeup = anyio.Event()
                if ledger.in_flight and len(ledger.ack_buffer) < 1000:
                    await anyio.sleep(interval)  # let the acks of messages in flight join this call
                await self.flush(ledger)
                healthy()
        finally:
            ledger.ack_channel = None
            if channel is not None:
                with anyio.CancelScope(shield=True):
                    await channel.aclose()

    async def flush(self, ledger: Ledger) -> None:
        """Send every queued ack now (one flush at a time per partition)."""
        async with ledger.ack_lock:
            if not ledger.ack_buffer:
                return
            batch = ledger.take_acks()
            try:
                await self.broker.ack(
                    ledger.view, batch, inbox=self.handler.inbox, channel=ledger.ack_channel, token=ledger.fence
                )
            except LeaseLost:  # fenced: nothing acked; the new owner has these entries now
                self.lost(ledger)
                ledger.acked(batch)
                self.writes_settled(ledger, batch)
                return
            except BaseException:
                ledger.requeue_acks(batch)
                raise
            ledger.acked(batch)
            self.stats.processed -= self.writes_settled(ledger, batch)  # (counted when queued)

    def writes_settled(self, ledger: Ledger, batch: list[Delivery]) -> int:
        """After an ack call (or its refusal): tell each state write sent with it (a saga step's,
        :class:`~broker.GuardedWrite`) how it went. A message whose write was not applied (its
        guard failed, or the server refused it) stays pending: it runs again, and with ownership
        the tenure ends so it runs before the later messages of its key. Returns how many stayed."""
        held = 0
        for d in batch:
            w = d.settle_write
            if w is None:
                continue
            if w.note is not None:
                try:
                    w.note(w)
                except Exception as exc:
                    self.log.error("a state write's callback failed", message_id=d.message_id, exc_info=exc)
            if w.outcome == GuardedWrite.CONFLICT or w.outcome == GuardedWrite.FAILED:
                held += 1
                self.stats.retried += 1
                self.log.warning(
                    "state write sent with the ack was not applied; the message stays pending and runs again",
                    message_id=d.message_id,
                    reason="version conflict" if w.outcome == GuardedWrite.CONFLICT else w.error,
                )
        if held:
            ledger.broken()
        return held

"""The consumer actor: one per handler, wiring its stages over the partitions of its destination it runs.

A message crosses each stage module once::

    fetch -> admit -> lanes -> attempt (middleware chain, handler) -> settle (publish, ack | retry, DLQ)

with the upkeep duties beside them (claim, extend, move due retries, trim, watchdog) and a
:class:`~framework.runtime.ledger.Ledger` per partition holding the accounts. This module starts
the tasks and runs the lanes' batches (:meth:`Consumer.process`): take a work, attempt it, batch
the successes for the settle stage.

Which partitions: every one, or, with partition ownership (:mod:`framework.runtime.ownership`),
the ones this instance holds a lease on; each of those runs in a *tenure* (:meth:`Consumer.serve`
under a fresh ledger) from acquiring the lease to losing or handing it back.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from typing import Any

import anyio

from broker import GroupPartition
from framework.logs import get_logger
from framework.observability import logcontext
from framework.runtime.admit import Admission, Work
from framework.runtime.attempt import Attempts
from framework.runtime.dispatch import Routed, Routes
from framework.runtime.fetch import Fetcher
from framework.runtime.lanes import Batch
from framework.runtime.ledger import ConsumerStats, Ledger, Slot
from framework.runtime.ownership import Ownership
from framework.runtime.settle import SETTLED, Finished, Settlement
from framework.runtime.supervisor import is_connection_error, supervise
from framework.runtime.upkeep import Upkeep, every, every_local
from framework.runtime.wiring import Wiring

__all__ = ["Consumer", "ConsumerStats"]

log = get_logger("framework.runtime.consumer")

_STRAGGLERS = 0.25
"""Seconds a finished run may wait behind a long run of its lane before the watchdog settles it."""


class Consumer:
    """Runs one handler of one service over the partitions of its destination (all, or those it owns)."""

    def __init__(self, wiring: Wiring, views: list[GroupPartition]) -> None:
        self.wiring = wiring
        self.handler = wiring.handler
        self.stats = wiring.stats
        self.views = list(views)  # every partition of the destination
        owned = bool(views) and wiring.settings.owns_partitions(views[0].spec.partitions)
        # partition -> its ledger: every partition, or (ownership) the ones held now
        self.states: dict[int, Ledger] = {} if owned else {v.partition: Ledger(v) for v in views}
        self._all = [Ledger(v) for v in views] if owned else list(self.states.values())  # for trim only
        self.settle = Settlement(wiring)
        self.attempts = Attempts(wiring, self.settle)
        self.admission = Admission(wiring, self.settle, self)
        self.fetcher = Fetcher(wiring, self.admission)
        self.upkeep = Upkeep(wiring, self.admission)
        self.ownership = Ownership(wiring, self, self.views) if owned else None
        self._fetch_scopes: list[anyio.CancelScope] = []
        self._fetching = True
        self._log = wiring.log
        self.members: list[Consumer] = []  # handlers sharing this group (see route), this one first

    def route(self, members: Sequence[Consumer]) -> None:
        """Share this consumer's group with ``members`` (this one among them): it reads, each
        member runs the messages its filter takes (see :mod:`framework.runtime.dispatch`)."""
        self.members = list(members)
        self.admission.routes = Routes(self.members)

    # -- actor tree ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Run every task of this consumer until cancelled (fetching stops on :meth:`stop_fetching`)."""
        settings = self.wiring.settings
        upkeep = self.upkeep
        label = self.handler.label
        if not self.views:  # a member of a shared group: the lead reads and looks after its partitions
            return
        async with anyio.create_task_group() as tg:
            if self.ownership is None:
                for ledger in self.states.values():
                    tg.start_soon(self.serve, ledger)
            else:
                tg.start_soon(supervise, f"{label}.ownership", self.ownership.run)
            tg.start_soon(supervise, f"{label}.trim", every, settings.trim_interval, upkeep.trim, self._all)
            timeouts = [m.handler.timeout for m in self.members or [self] if m.handler.timeout is not None]
            interval = _STRAGGLERS if not timeouts else min(_STRAGGLERS, min(timeouts) / 4)
            watch = functools.partial(self._watch, interval, bool(timeouts))
            tg.start_soon(supervise, f"{label}.watchdog", every_local, interval, watch)

    async def _watch(self, interval: float, timeouts: bool) -> None:
        """The watchdog's pass: cancel runs past their timeout (``timeouts``: some handler here has one),
        then settle runs a lane finished that wait behind a long run (it cannot settle them until that
        run ends) for ``interval`` or more."""
        ledgers = list(self.states.values())
        if timeouts:
            await self.upkeep.watch(ledgers)
        now = time.monotonic()
        for ledger in ledgers:
            for slot in list(ledger.slots):
                done = slot.pending
                if done is not None and done.deliveries and slot.delivery is not None and now - done.since >= interval:
                    await self.settle.finished(ledger, done)

    async def serve(
        self, ledger: Ledger, intake: anyio.CancelScope | None = None, intake_done: anyio.Event | None = None
    ) -> None:
        """Run one partition's tasks until cancelled: fetch, acks, claims, extend, due retries.

        ``intake`` (ownership: a hand-back cancels it first) scopes the tasks that bring messages in
        (fetch, claims, due retries); acks and the extender go on until the whole call is cancelled.
        ``intake_done`` is set once those have ended (the fetcher's connection is closed: no read of
        it is still blocked on the server).
        """
        settings = self.wiring.settings
        upkeep = self.upkeep
        name = f"{self.handler.label}[{ledger.partition}]"
        async with anyio.create_task_group() as tg:
            tg.start_soon(supervise, f"{name}.acks", self.settle.ack_loop, ledger)
            tg.start_soon(supervise, f"{name}.extend", every, settings.extend_interval, upkeep.extend, ledger)
            try:
                with intake or anyio.CancelScope():
                    async with anyio.create_task_group() as intake_tg:
                        intake_tg.start_soon(self._fetch_guarded, ledger, name)
                        intake_tg.start_soon(
                            supervise, f"{name}.claims", every, settings.claim_interval, upkeep.claim, ledger
                        )
                        intake_tg.start_soon(
                            supervise, f"{name}.retries", every, settings.retry_interval, upkeep.move_due, ledger
                        )
                        intake_tg.start_soon(supervise, f"{name}.copies", self._admit_copies, ledger)
            finally:
                if intake_done is not None:
                    intake_done.set()

    async def _admit_copies(self, ledger: Ledger) -> None:
        """Admit again the copies the inbox deferred (:meth:`Ledger.defer_copies`) once the run of their
        message here has settled: the inbox then finds it processed (a duplicate) or free again."""
        give_up = self.wiring.lease_ms / 2000  # (then left pending for the visibility timeout, as before)
        while True:
            await ledger.copies_wakeup.wait()
            await anyio.sleep(0.01)
            ready = ledger.settled_copies(give_up)
            if ready:
                with anyio.move_on_after(30, shield=True):
                    await self.admission.admit(ledger, ready)

    async def _fetch_guarded(self, ledger: Ledger, name: str) -> None:
        with anyio.CancelScope() as scope:
            self._fetch_scopes.append(scope)
            try:
                if not self._fetching:
                    scope.cancel()
                await supervise(f"{name}.fetch", self.fetcher.run, ledger)
            finally:
                self._fetch_scopes.remove(scope)

    def stop_fetching(self) -> None:
        """Stop reading new entries (graceful shutdown); in-flight work goes on."""
        self._fetching = False
        if self.ownership is not None:
            self.ownership.stopped = True  # acquire nothing more; the leases are freed at the hand-over
        for scope in self._fetch_scopes:
            scope.cancel()

    @property
    def in_flight(self) -> int:
        """Messages fetched and not yet processed or settled."""
        return sum(ledger.in_flight for ledger in self.states.values())

    async def flush_acks(self) -> None:
        """Send every buffered ack now."""
        # (a copy: a partition lost meanwhile, a lease run out during a pause, leaves the dict)
        for ledger in list(self.states.values()):
            await self.settle.flush(ledger)

    async def hand_over(self) -> int:
        """At shutdown: make what this consumer holds but does not run claimable by others at once
        (and, with ownership, free its leases and leave the group's members)."""
        released = await self.upkeep.hand_over(list(self.states.values()))  # (a copy, as above)
        if self.ownership is not None:
            await self.ownership.leave()
        return released

    # -- the lanes' side (framework.runtime.lanes.Worker) -------------------------------------------

    async def process(self, ledger: Ledger, batch: Batch) -> None:
        """Take works from ``batch`` in order and attempt each, settling as it goes.

        Several lanes may take from one keyless batch at once (see :mod:`framework.runtime.lanes`); each
        settles what it ran. A finished message is acknowledged (after its staged messages are
        published) within about ``ack_interval`` of finishing, not when the whole batch is done,
        so a crash re-runs as little finished work as possible. A handler past its timeout is
        cancelled by the watchdog; its attempt fails and the lane goes on with the next work. A
        suspect batch (one redelivered message, isolated) is counted before it runs and settled
        at once (:meth:`_run_suspect`).
        """
        works = batch.works
        done = Finished()
        slot = Slot()
        slot.timeout = self.handler.timeout or math.inf  # the watchdog may be another handler's (shared group)
        slot.flush = functools.partial(self._settle_now, ledger, done)
        slot.pending = done
        ledger.slots.add(slot)
        started = time.perf_counter()
        context = logcontext.enter(slot, self.handler)  # log lines name the slot's current run
        try:
            more = True
            while more:
                with anyio.CancelScope() as scope:  # only handler runs await inside: the watchdog's handle
                    slot.scope = scope
                    more = await self._process_from(ledger, batch, slot, done)
                if scope.cancelled_caught:
                    d, payload = works[slot.index]
                    if slot.delivery is d and d is not None:  # the watchdog cut its handler short
                        runner = payload.member if type(payload) is Routed else self
                        await runner.attempts.timed_out(ledger, d, slot)
                    else:  # a handler swallowed the cancellation, which then hit its settling: unknown state
                        ledger.forget([d])  # pending: redelivered after the visibility timeout
                    more = True
                await self.settle.finished(ledger, done)
                slot.index = -1
        except Exception as exc:  # the broker unreachable, or a framework bug: unsettled works are redelivered
            if is_connection_error(exc):
                self._log.warning("broker unreachable while settling; unsettled messages will be redelivered")
            else:
                log.error("processing failed; unsettled messages will be redelivered", exc_info=exc)
            finished = {id(d) for d in done.deliveries}  # settled below; earlier ones are settled already
            current = [works[slot.index][0]] if slot.index >= 0 else []
            rest, batch.next = works[batch.next :], len(works)  # not taken by any lane: given up too
            ledger.forget([d for d in current + [d for d, _ in rest] if id(d) not in finished])
            ledger.broken()
        finally:
            slot.delivery = None
            if slot.watch is not None:  # a run cancelled at shutdown: its span ends unsettled
                self.attempts.observer.abandon(slot.watch)
                slot.watch = None
            if slot.observed is not None:
                self.attempts.observer.release(slot.observed)
            ledger.slots.discard(slot)
            self.stats.handler_seconds += time.perf_counter() - started
            logcontext.leave(context)
        await self.settle.finished(ledger, done)

    async def _settle_now(self, ledger: Ledger, done: Finished) -> None:
        """Settle the runs this lane finished (publish, queue their acks) and send the acks now."""
        await self.settle.finished(ledger, done)
        await self.settle.flush(ledger)

    async def _process_from(self, ledger: Ledger, batch: Batch, slot: Slot, done: Finished) -> bool:
        """Take and attempt works of ``batch``; return False when none is left, True once finished
        runs have waited ``ack_interval`` to be settled (raises if cancelled)."""
        interval = self.wiring.settings.ack_interval
        run = self.attempts.run
        clock = time.monotonic
        works = batch.works
        count = len(works)
        suspect = batch.suspect
        lease = ledger.lease
        began = clock()
        while True:
            index = batch.next
            if index >= count:
                return False
            if lease is not None and not lease.usable(clock()):  # lost or handed back: start nothing more
                batch.next = count
                ledger.forget([d for d, _ in works[index:]])
                return False
            batch.next = index + 1  # taken: no other lane runs it
            d, payload = works[index]
            slot.index = index
            runner = self
            if type(payload) is Routed:  # a shared group's work: run by the handler its filter picked
                runner = payload.member
                ctx = await self._run_routed(runner, ledger, d, payload.payload, slot, suspect)
            elif suspect:
                ctx = await self._run_suspect(ledger, d, payload, slot)
            else:
                ctx = await run(ledger, d, payload, d.attempt, slot)
            ended = clock()
            if ctx is not None and ctx is not SETTLED:
                done.add(d, ctx, ended, None if runner is self else runner.stats)
                # Settle now when finished runs waited long enough, or when this run was slow: the
                # next one likely is too, and a finished message must not wait for it.
                if ended - done.since >= interval or ended - began >= interval:
                    return True
            began = ended

    async def _run_routed(
        self, runner: Consumer, ledger: Ledger, d: Any, payload: Any, slot: Slot, suspect: bool
    ) -> Any:
        """Run a shared group's work with the stages of ``runner``, the member its filter picked: its
        attempt, retry policy, timeout and log context (the lead's ledger and lanes)."""
        slot.timeout = runner.handler.timeout or math.inf
        token = logcontext.enter(slot, runner.handler)
        try:
            if suspect:
                return await runner._run_suspect(ledger, d, payload, slot)
            return await runner.attempts.run(ledger, d, payload, d.attempt, slot)
        finally:
            logcontext.leave(token)

    async def _run_suspect(self, ledger: Ledger, d: Any, payload: Any, slot: Slot) -> Any:
        """Run a suspect (see :meth:`Admission.sort_redeliveries`): counted first, settled at once.

        The lane pool runs one suspect at a time in the process, so a message that crashes its
        worker takes down no other suspect with it: only the culprit's count of started runs
        grows towards its ``max_attempts``.
        """
        if not await self.admission.count_suspect_run(ledger, d):
            return None
        ctx = await self.attempts.run(ledger, d, payload, d.attempt, slot)
        if ctx is None or ctx is SETTLED:
            return ctx
        # Settle before the next suspect starts: if that one kills the process, this one's
        # success is already durable and is not counted against it.
        await self.settle.at_once(ledger, d, ctx)
        return SETTLED

    def abandon(self, ledger: Ledger, works: Sequence[Work]) -> None:
        """Forget works after an internal error; they stay pending and are claimed again later."""
        ledger.forget([d for d, _ in works])

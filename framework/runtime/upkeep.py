"""Upkeep: the duties beside a consumer's message flow, each run every few seconds.

* claim (:meth:`Upkeep.claim`): take over entries other consumers left idle past the visibility
  timeout (and, every ten minutes, prune consumers gone for good);
* extend (:meth:`Upkeep.extend`): keep entries held here from being claimed while they wait or run;
* move due retries (:meth:`Upkeep.move_due`): delayed retries back to this group's stream;
* trim (:meth:`Upkeep.trim`): a topic's retention, and inbox ids older than the dedup window;
  its first pass (and one every ten minutes) checks the inbox's memory against the budget and
  logs one warning when the group's rate times its window needs more;
* watchdog (:meth:`Upkeep.watch`): cancel handler runs past their timeout.

Broker duties run under :func:`every` (each pass that worked marks progress); the watchdog,
which needs no broker, under :func:`every_local`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import anyio
import attrs

from broker import LeaseLost, now_ms
from broker.capabilities import INTROSPECTION, as_introspection
from broker.introspection import InboxMemory
from framework.runtime.admit import Admission
from framework.runtime.connectivity import healthy
from framework.runtime.ledger import Ledger
from framework.runtime.wiring import Wiring

__all__ = ["Upkeep", "every", "every_local"]

_PRUNE_EVERY = 600.0  # seconds between sweeps of departed consumers
_PRUNE_IDLE = 3600.0  # a consumer idle this long with nothing pending has gone
_BUDGET_EVERY = 600.0  # seconds between checks of the inbox's memory against the budget


async def every(interval: float, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
    """Run a broker duty every ``interval`` seconds; each pass that worked is progress."""
    while True:
        await fn(*args)
        healthy()
        await anyio.sleep(interval)


async def every_local(interval: float, fn: Callable[[], Awaitable[Any]]) -> None:
    """Run a duty that needs no broker (the watchdog): it says nothing about connectivity."""
    while True:
        await fn()
        await anyio.sleep(interval)


class Upkeep:
    """The upkeep duties of one consumer."""

    def __init__(self, wiring: Wiring, admission: Admission) -> None:
        self.wiring = wiring
        self.admission = admission
        self.handed_over = False  # set at shutdown: the extender must not touch released entries again
        self.budget_at = 0.0  # when to check the inbox's memory against the budget next
        self.budget_warned = False  # one warning per process

    async def claim(self, ledger: Ledger) -> None:
        """Claim entries idle past the visibility timeout and admit them like fetched ones.

        On an owned partition only its owner claims, and only once its tenure's take-over is done."""
        if ledger.lease is not None and (not ledger.taken_over or not ledger.lease.usable(time.monotonic())):
            return
        wiring = self.wiring
        settings = wiring.settings
        broker = wiring.broker
        if time.monotonic() >= ledger.prune_at:  # forget consumers gone for good (see prune_consumers)
            ledger.prune_at = time.monotonic() + _PRUNE_EVERY
            idle_ms = int(max(_PRUNE_IDLE, 10 * settings.visibility_timeout) * 1000)
            pruned = await broker.prune_consumers(ledger.view, idle_ms, keep=wiring.consumer_name)
            if pruned:
                wiring.log.info("removed departed consumers", partition=ledger.partition, count=pruned)
        if ledger.in_flight > settings.prefetch:
            return
        token = ledger.lease.token if ledger.lease is not None else None
        try:
            deliveries = await broker.claim_idle(
                ledger.view, wiring.consumer_name, wiring.lease_ms, settings.prefetch, token=token
            )
        except LeaseLost:
            assert ledger.lease is not None
            ledger.lease.lose("a claim was refused: another instance holds the partition's lease")
            return
        held = ledger.held
        fresh = [d for d in deliveries if d.entry_id not in held]
        for d in deliveries:  # held here and ours again (taken, then claimed back): extend it again
            if d.entry_id in held and held[d.entry_id][1] == math.inf:
                held[d.entry_id] = (held[d.entry_id][0], time.monotonic())
        if fresh:
            wiring.log.info(
                "claimed entries idle past the visibility timeout", partition=ledger.partition, count=len(fresh)
            )
            await self.admission.admit(ledger, fresh)

    async def extend(self, ledger: Ledger) -> None:
        """Keep every entry held here longer than an extend interval from being claimed.

        Entries settled while the call was on its way (an ack in flight) are no longer pending:
        that is not a take-over. Entries pending under another consumer were claimed (this process
        stalled past the visibility timeout): they are logged once and no longer extended. They
        stay held, so the fetcher's budget stays right and this process does not claim them back
        while its own copy is queued or running; that copy's settlement settles the entry.
        """
        if self.handed_over:
            return
        wiring = self.wiring
        horizon = time.monotonic() - wiring.settings.extend_interval
        old = [d for d, t in list(ledger.held.values()) if t < horizon]
        if not old:
            return
        found = await wiring.broker.extend(ledger.view, wiring.consumer_name, old, lease_ms=wiring.lease_ms)
        if found.taken:
            held = ledger.held
            taken = [d for d in old if d.entry_id in found.taken]
            for d in taken:
                if d.entry_id in held:  # never "old" again: not extended, not logged again
                    held[d.entry_id] = (held[d.entry_id][0], math.inf)
            wiring.log.warning(
                "entries were claimed by another consumer while held here",
                partition=ledger.partition,
                count=len(taken),
                message_ids=[d.message_id for d in taken[:10]],
            )

    async def move_due(self, ledger: Ledger) -> None:
        """Move this group's delayed retries that are due back to its stream."""
        await self.wiring.broker.move_due(ledger.view, now_ms())

    async def trim(self, ledgers: Iterable[Ledger]) -> None:
        """Apply the topic's retention and forget inbox records older than the dedup window."""
        wiring = self.wiring
        spec = wiring.handler.destination.spec()
        now = now_ms()
        ledgers = list(ledgers)
        for ledger in ledgers:
            await wiring.broker.trim(spec, ledger.partition, now)
            if wiring.handler.inbox:
                await wiring.inbox_store.trim_inbox(ledger.view, now - int(wiring.settings.inbox_window * 1000))
        if wiring.handler.inbox and not self.budget_warned and time.monotonic() >= self.budget_at:
            self.budget_at = time.monotonic() + _BUDGET_EVERY
            await self.check_inbox_budget(ledgers)

    async def check_inbox_budget(self, ledgers: Iterable[Ledger]) -> InboxMemory:
        """Log one warning when the group's inbox needs more server memory over its window than the
        budget (``inbox_memory_budget``): the recent rate (from the inbox's own slot counts) times the
        window times the bytes one id costs. Returns the figures."""
        wiring = self.wiring
        settings = wiring.settings
        total = InboxMemory()
        if INTROSPECTION not in wiring.broker.capabilities:
            return total
        inspect = as_introspection(wiring.broker)
        for ledger in ledgers:
            total += await inspect.inbox_memory(ledger.view)
        total = attrs.evolve(total, window_ms=int(settings.inbox_window * 1000))
        if total.bytes > settings.inbox_memory_budget:
            self.budget_warned = True
            wiring.log.warning(
                "the inbox needs more server memory than its budget: shorten inbox_window or raise "
                "inbox_memory_budget (docs/idempotency.md)",
                inbox_mib=round(total.bytes / 2**20, 1),
                budget_mib=round(settings.inbox_memory_budget / 2**20, 1),
                ids_per_s=round(total.ids_per_s, 1),
                window_h=round(settings.inbox_window / 3600, 2),
                ids=total.ids,
            )
        return total

    async def watch(self, ledgers: Iterable[Ledger]) -> None:
        """Cancel handler runs past their timeout (the watchdog).

        A run is timed from when the watchdog first sees it, so it is cancelled between
        ``timeout`` and ``timeout`` plus two watchdog intervals after it started.
        """
        default = self.wiring.handler.timeout or math.inf  # the watchdog runs only for handlers with a timeout
        now = time.monotonic()
        for ledger in ledgers:
            for slot in ledger.slots:
                if slot.delivery is None or slot.scope is None:
                    continue
                timeout = default if slot.timeout is None else slot.timeout  # handlers sharing the group
                if slot.seen_run != slot.runs:
                    slot.seen_run, slot.seen_at = slot.runs, now
                elif now - slot.seen_at >= timeout:
                    slot.scope.cancel()

    async def hand_over(self, ledgers: Iterable[Ledger]) -> int:
        """At shutdown: make what this consumer holds but does not run claimable by others at once."""
        idle_ms = self.wiring.lease_ms + 1
        self.handed_over = True  # the extender must not touch the released entries again
        released = 0
        for ledger in ledgers:
            released += await self.wiring.broker.release_own_pending(
                ledger.view, self.wiring.consumer_name, idle_ms, keep=ledger.running()
            )
        return released

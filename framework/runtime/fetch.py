"""Fetch: read a partition's entries for one consumer, with flow control.

A fetcher first re-reads the entries it already owns (pending under its consumer name: it is back
after a crash or restart), then reads new ones (XREADGROUP ``>``) on a connection of its own,
at most ``prefetch`` per read, and only while at most ``prefetch`` messages are in flight
(:meth:`~framework.runtime.ledger.Ledger.wait_for_capacity`), so memory stays bounded. Each batch
goes to the admit stage; every broker round trip that worked marks progress (``healthy()``).

On an owned partition (:mod:`framework.runtime.ownership`) a tenure starts with the take-over
instead: every entry pending in the partition for any consumer (what earlier owners left: dead,
paused, or handed back) is claimed at once, oldest first, and admitted before anything new is
read, so a key's messages run in the order they were published across owners. Its reads and
claims carry the lease's fencing token, checked on the server atomically with taking the entries
(the broker's fenced read; ``broker/redis/lua/owned_intake.lua``): a command that reaches the server
after the lease moved (sent by a process resumed after a pause, past its local lease check)
takes nothing, so no entry is left pending with a former owner while the new one runs later
entries of its keys.
"""

from __future__ import annotations

import functools
import time

import anyio
import anyio.lowlevel

from broker import LeaseLost
from framework.runtime.admit import Admission
from framework.runtime.connectivity import healthy
from framework.runtime.ledger import Ledger
from framework.runtime.wiring import Wiring

__all__ = ["Fetcher"]

_READ_MARGIN_MS = 50  # an owned partition's reads end this long before the lease's local end
_START_FIRST_BELOW = 64
"""A read of fewer entries than this (a low rate: latency matters) lets the lanes start its handlers
before the next read is sent: sending a read takes the fetcher about 70 µs of Python, which
otherwise lies between a message's arrival and its handler's start (p50 publish -> handler start
0.56 -> 0.48 ms, inbox off, one worker at 500 msg/s). A fuller read is the throughput case: the
next read's round trip overlaps the handlers, as before."""


class Fetcher:
    """The fetch stage of one consumer."""

    def __init__(self, wiring: Wiring, admission: Admission) -> None:
        self.wiring = wiring
        self.admission = admission

    async def run(self, ledger: Ledger) -> None:
        """Fetch ``ledger``'s partition until cancelled."""
        if ledger.lease is not None:
            await self.take_over(ledger)
        else:
            await self.read_own_pending(ledger)
        await self.read_new(ledger)

    async def take_over(self, ledger: Ledger) -> None:
        """Claim and admit every entry pending in an owned partition, oldest first (a tenure's start)."""
        ownership = self.wiring.ownership_store
        consumer = self.wiring.consumer_name
        prefetch = self.wiring.settings.prefetch
        lease = ledger.lease
        assert lease is not None
        token = lease.token
        cursors: dict[str, str] = {}
        total = 0
        while True:
            if ledger.in_flight > prefetch:
                await ledger.wait_for_capacity(prefetch)
            try:
                deliveries = await ownership.take_over(ledger.view, consumer, prefetch, cursors, token=token)
            except LeaseLost:
                lease.lose("its take-over was refused: another instance holds the partition's lease")
                return
            healthy()
            fresh = [d for d in deliveries if d.entry_id not in ledger.held]
            if fresh:
                total += len(fresh)
                with anyio.move_on_after(30, shield=True):
                    await self.admission.admit(ledger, fresh)
            if ownership.taken_over(cursors):
                break
        ledger.taken_over = True  # the claimer may run now: it never overtakes the take-over's order
        if total:
            self.wiring.log.info(
                "took over pending entries of an owned partition", partition=ledger.partition, count=total
            )

    async def read_own_pending(self, ledger: Ledger) -> None:
        """Re-read the entries still pending under this consumer's name (not held here already)."""
        broker = self.wiring.broker
        consumer = self.wiring.consumer_name
        prefetch = self.wiring.settings.prefetch
        after: dict[str, str] = {}
        while True:
            deliveries = await broker.read_own_pending(ledger.view, consumer, prefetch, after)
            healthy()  # a broker round trip worked: progress (resets the restart backoff)
            if not deliveries:
                return
            fresh = [d for d in deliveries if d.entry_id not in ledger.held]
            for d in deliveries:
                after[d.stream] = d.entry_id
            if fresh:
                self.wiring.log.info("re-reading own pending entries", partition=ledger.partition, count=len(fresh))
                await self.admission.admit(ledger, fresh)

    async def read_new(self, ledger: Ledger) -> None:
        """Read new entries forever, while the ledger has room."""
        broker = self.wiring.broker
        consumer = self.wiring.consumer_name
        settings = self.wiring.settings
        prefetch, block = settings.prefetch, settings.block_ms
        admit = self.admission.admit
        lease = ledger.lease
        token = lease.token if lease is not None else None
        clock = time.monotonic
        channel = broker.channel()  # this fetcher's own connection: reads and inbox checks
        read = broker.read
        if self.wiring.handler.inbox:  # the read takes the inbox leases of what it reads (one round trip)
            read = functools.partial(
                self.wiring.inbox_store.read_leased,
                lease_ms=self.wiring.lease_ms,
                window_ms=int(settings.inbox_window * 1000),
            )
        try:
            while True:
                if ledger.in_flight > prefetch:
                    await ledger.wait_for_capacity(prefetch)
                wait = block
                if lease is not None:
                    # The read is fenced on the server (it takes nothing once the lease moved); its
                    # wait still ends before the lease's local end, so the lease is checked again in time.
                    now = clock()
                    if not lease.usable(now):
                        return  # lost or handed back: the tenure ends
                    wait = min(block, int((lease.valid_until - now) * 1000) - _READ_MARGIN_MS)
                    if wait < 1:
                        await anyio.sleep(0.01)  # the next renewal extends it
                        continue
                try:
                    deliveries = await read(ledger.view, consumer, prefetch, wait, channel=channel, token=token)
                except LeaseLost:  # fenced: the server refused the read (nothing taken)
                    assert lease is not None
                    lease.lose("a read was refused: another instance holds the partition's lease")
                    return
                healthy()
                if deliveries:  # what was read is dispatched even if fetching stops meanwhile
                    with anyio.move_on_after(30, shield=True):
                        await admit(ledger, deliveries, channel)
                    if len(deliveries) < _START_FIRST_BELOW:
                        await anyio.lowlevel.checkpoint()  # the lanes woken by admit run first
        finally:
            if channel is not None:
                with anyio.CancelScope(shield=True):
                    await channel.aclose()

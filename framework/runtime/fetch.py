"""Fetch: read a partition's entries for one consumer, with flow control.

A fetcher first re-reads the entries it already owns (pending under its consumer name: it is back
after a crash or restart), then reads new ones (XREADGROUP ``>``) on a connection of its own,
at most ``prefetch`` per read, and only while at most ``prefetch`` messages are in flight
(:meth:`~framework.runtime.ledger.Ledger.wait_for_capacity`), so memory stays bounded. Each batch
goes to the admit stage; every broker round trip that worked marks progress (``healthy()``).
"""

from __future__ import annotations

import anyio

from framework.runtime.admit import Admission
from framework.runtime.connectivity import healthy
from framework.runtime.ledger import Ledger
from framework.runtime.wiring import Wiring

__all__ = ["Fetcher"]


class Fetcher:
    """The fetch stage of one consumer."""

    def __init__(self, wiring: Wiring, admission: Admission) -> None:
        self.wiring = wiring
        self.admission = admission

    async def run(self, ledger: Ledger) -> None:
        """Fetch ``ledger``'s partition until cancelled."""
        await self.read_own_pending(ledger)
        await self.read_new(ledger)

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
        channel = broker.channel()  # this fetcher's own connection: reads and inbox checks
        try:
            while True:
                if ledger.in_flight > prefetch:
                    await ledger.wait_for_capacity(prefetch)
                deliveries = await broker.read(ledger.view, consumer, prefetch, block, channel=channel)
                healthy()
                if deliveries:  # what was read is dispatched even if fetching stops meanwhile
                    with anyio.CancelScope(shield=True), anyio.move_on_after(30):
                        await admit(ledger, deliveries, channel)
        finally:
            if channel is not None:
                with anyio.CancelScope(shield=True):
                    await channel.aclose()

"""The ledger: what one consumer holds and has in flight on one partition.

Every stage accounts through it, so "how many messages may the fetcher still read" and "which
entries must the extender keep" have one answer:

* ``held``: entry id -> (delivery, fetched at) for every entry read and not yet acknowledged
  (``fetched at`` is ``math.inf`` once another consumer took the entry over: never extended again);
* ``in_flight``: held entries not yet processed; the fetcher reads more only while it is at most
  ``prefetch`` (:meth:`Ledger.wait_for_capacity`), which bounds memory;
* the ack buffer: processed entries waiting for the ack flusher (one XACK for many);
* ``slots``: what each lane running this partition's messages runs right now (the watchdog, the
  extender and the hand-over at shutdown read them).

With partition ownership (:mod:`framework.runtime.ownership`) a ledger lives for one *tenure*: from
acquiring the partition's lease to losing or releasing it; ``lease`` holds the tenure's fencing
token, which every settle call passes. Without ownership ``lease`` is None for the process's life.

A processed message leaves ``in_flight`` when its ack is queued (:meth:`Ledger.queue_acks`) and
``held`` once the ack is sent (:meth:`Ledger.take_acks` / :meth:`Ledger.acked`); a message that
stays pending (an unreachable broker, a lease held elsewhere) is forgotten at once
(:meth:`Ledger.forget`) and redelivered later.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import anyio
import attrs

from broker import Delivery, GroupPartition

__all__ = ["ConsumerStats", "Lease", "Ledger", "Slot"]


@attrs.define
class ConsumerStats:
    """Counters of one handler in this process (exported as metrics by the tracing layer)."""

    fetched: int = 0
    processed: int = 0
    failed: int = 0
    retried: int = 0
    dead_lettered: int = 0
    duplicates: int = 0
    unwanted: int = 0  # events no handler of the service wanted (filters): acknowledged, never run
    expired: int = 0  # requests whose deadline passed before their handler started: acked unrun
    handler_seconds: float = 0.0


class Slot:
    """What one lane is running for a consumer right now (the watchdog and shutdown read it).

    The hot path only sets ``delivery``, ``index`` and ``attempt`` and counts ``runs``; the watchdog
    notes when it first saw a run (``seen_run``, ``seen_at``), so no clock is read per message.
    ``scope`` is what the watchdog cancels: the lane's scope around its handler runs, or, when
    middleware is installed, the scope of the one attempt (so the chain sees the timeout).
    """

    __slots__ = (
        "attempt",
        "delivery",
        "flush",
        "index",
        "observed",
        "pending",
        "runs",
        "scope",
        "seen_at",
        "seen_run",
        "timeout",
        "watch",
    )

    def __init__(self) -> None:
        self.delivery: Delivery | None = None  # set only while the handler itself runs
        self.index = -1  # of the work being run in the lane's batch; -1: none taken and unsettled
        self.attempt = 0
        self.runs = 0  # handler runs started in this slot
        self.seen_run = -1
        self.seen_at = 0.0
        self.timeout: float | None = None  # of the handler this lane runs (the watchdog reads it)
        self.scope: anyio.CancelScope | None = None
        self.watch: Any = None  # the observer's watch of a run cut short, until its timeout is settled
        self.observed: Any = None  # tracing or metrics: the observer's watch this lane reuses
        # settles the runs this lane finished and sends the partition's queued acks now (a saga step
        # whose commit builds on a state write its instance's earlier step sent with its ack)
        self.flush: Callable[[], Awaitable[None]] | None = None
        self.pending: Any = None  # the lane's finished, unsettled runs (framework.runtime.settle.Finished)


class Lease:
    """This instance's hold on a partition for one tenure (partition ownership).

    ``token`` is the fencing token of the acquisition; ``valid_until`` (monotonic) the local time up
    to which the lease surely holds (the renewal's send time plus the lease length, less a margin), so a
    process resumed after a pause past it knows it at once, without a round trip. ``lost`` is sticky:
    a tenure that lost its lease (taken over, expired locally, or a message of it could not be
    settled) never runs another message; the partition is taken again in a new tenure, which starts
    over from the oldest pending entry, so a key's messages are never run out of order. ``releasing``:
    handed back (rebalance, shutdown): queued messages are not started.
    """

    __slots__ = ("lost", "on_lost", "releasing", "token", "valid_until", "why")

    def __init__(self, token: int, valid_until: float, on_lost: Any = None) -> None:
        self.token = token
        self.valid_until = valid_until
        self.lost = False
        self.why = ""  # what ended the tenure (logged once, when the ownership loop ends it)
        self.releasing = False
        self.on_lost = on_lost  # called once when lost (wakes the ownership loop)

    def usable(self, now: float) -> bool:
        """Whether a message of this tenure may start at ``now`` (monotonic); marks it lost once expired."""
        if self.lost or self.releasing:
            return False
        if now >= self.valid_until:
            self.lose("its lease ran out on the local clock (a pause, or no renewal in time)")
            return False
        return True

    def lose(self, why: str) -> bool:
        """Mark the tenure lost for ``why``; True the first time."""
        if self.lost:
            return False
        self.lost = True
        self.why = why
        if self.on_lost is not None:
            self.on_lost()
        return True


class Ledger:
    """One consumer's accounts for one partition (see the module docstring)."""

    __slots__ = (
        "ack_buffer",
        "ack_channel",
        "ack_lock",
        "ack_wakeup",
        "capacity",
        "copies",
        "copies_wakeup",
        "held",
        "in_flight",
        "lease",
        "prune_at",
        "slots",
        "taken_over",
        "view",
    )

    def __init__(self, view: GroupPartition) -> None:
        self.view = view
        self.held: dict[str, tuple[Delivery, float]] = {}  # entry id -> (delivery, fetched at)
        self.in_flight = 0
        self.capacity = anyio.Event()
        self.ack_buffer: list[Delivery] = []
        self.ack_wakeup = anyio.Event()
        self.ack_channel: Any = None  # the ack flusher's dedicated connection
        self.ack_lock = anyio.Lock()  # one flush at a time (the flusher and shutdown share the channel)
        self.slots: set[Slot] = set()  # one per lane running this partition's messages
        self.prune_at = 0.0  # monotonic time of the next sweep of departed consumers
        self.lease: Lease | None = None  # set for an owned partition's tenure
        self.taken_over = False  # an owned tenure has claimed what earlier owners left pending
        self.copies: list[tuple[Delivery, float]] = []  # (copy, deferred at) of messages running here
        self.copies_wakeup = anyio.Event()

    @property
    def fence(self) -> int | None:
        """The fencing token settle calls pass (None: the partition is not owned)."""
        lease = self.lease
        return None if lease is None else lease.token

    def broken(self) -> None:
        """A message of this partition stays pending while later ones could run: with ownership the
        tenure ends (the next one starts from the oldest pending entry, keeping per-key order)."""
        if self.lease is not None:
            self.lease.lose("a message could not be settled (it stays pending)")

    @property
    def partition(self) -> int:
        """The partition this ledger accounts for."""
        return self.view.partition

    # -- fetching -------------------------------------------------------------------------------

    def hold(self, deliveries: Sequence[Delivery], now: float) -> None:
        """Record fetched deliveries: held (extended while here) and in flight."""
        held = self.held
        for d in deliveries:
            held[d.entry_id] = (d, now)
        self.in_flight += len(deliveries)

    async def wait_for_capacity(self, limit: int) -> None:
        """Return once at most ``limit`` messages are in flight (the fetcher's flow control)."""
        while self.in_flight > limit:
            self.capacity = anyio.Event()
            await self.capacity.wait()

    # -- settling ---------------------------------------------------------------------------------

    def release(self, count: int) -> None:
        """``count`` held messages are processed: the fetcher may read that many more."""
        self.in_flight -= count
        self.capacity.set()

    def forget(self, deliveries: Iterable[Delivery]) -> None:
        """Drop deliveries that stay pending (or were settled with their own ack) from the books."""
        held = self.held
        for d in deliveries:
            if held.pop(d.entry_id, None) is not None:
                self.in_flight -= 1
        self.capacity.set()

    def defer_copies(self, copies: Sequence[Delivery]) -> None:
        """Copies of messages this partition is running now (their inbox lease is the run's): checked
        again once the run has settled (:meth:`settled_copies`), not left for the visibility timeout."""
        now = time.monotonic()
        self.copies += [(d, now) for d in copies]
        self.copies_wakeup.set()

    def settled_copies(self, give_up_after: float) -> list[Delivery]:
        """The deferred copies whose message no longer runs here (their inbox status reset, to be
        admitted again); copies deferred longer than ``give_up_after`` seconds are dropped (they stay
        pending, claimed after the visibility timeout as any entry left pending)."""
        running = {d.message_id for d, _ in self.held.values()}
        now = time.monotonic()
        ready: list[Delivery] = []
        waiting: list[tuple[Delivery, float]] = []
        for d, at in self.copies:
            if d.message_id not in running:
                d.inbox_status = None
                ready.append(d)
            elif now - at < give_up_after:
                waiting.append((d, at))
        self.copies = waiting
        if not waiting:
            self.copies_wakeup = anyio.Event()
        return ready

    def queue_acks(self, deliveries: list[Delivery]) -> None:
        """Processed deliveries: queue their acks for the flusher and release them."""
        self.ack_buffer += deliveries
        self.ack_wakeup.set()
        self.release(len(deliveries))

    def take_acks(self) -> list[Delivery]:
        """Empty the ack buffer and return what it held (give it back with :meth:`requeue_acks`)."""
        batch, self.ack_buffer = self.ack_buffer, []
        return batch

    def requeue_acks(self, batch: list[Delivery]) -> None:
        """Put back acks a flush could not send (acks are idempotent: the next flush sends them)."""
        self.ack_buffer[:0] = batch

    def acked(self, batch: Iterable[Delivery]) -> None:
        """The broker acknowledged ``batch``: no longer held (already released when processed)."""
        held = self.held
        for d in batch:
            held.pop(d.entry_id, None)

    # -- what the lanes run ----------------------------------------------------------------------------

    def running(self) -> list[str]:
        """Entry ids whose handlers run right now."""
        return [s.delivery.entry_id for s in self.slots if s.delivery is not None]

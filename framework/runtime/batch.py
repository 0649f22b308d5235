"""The batch path: a batch handler's consumer collects admitted work per partition into batches.

A batch handler (``batch=BatchPolicy(...)``, see :mod:`framework.batching`) shares the stages of a
per-message one up to the lanes: fetch, admit (undecodable messages dead-lettered, duplicates
dropped by the inbox, redeliveries counted, suspects isolated). Then, instead of queuing each
message on the lane of its key, :class:`BatchConsumer` keeps the partition's admitted work in
arrival order and hands a lane one batch at a time: up to ``max_size`` messages, once that many
wait or ``max_wait`` seconds after the first one arrived. The next batch of the partition starts
only after the previous one is settled, so per-key order holds across batches. A suspect (a
redelivered message whose earlier redelivered run never completed) runs alone, on the isolation
lane. :mod:`framework.runtime.batch_run` runs a batch and settles each message.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import anyio
import attrs

from broker import GroupPartition
from framework.runtime.admit import Work
from framework.runtime.batch_run import BatchRunner
from framework.runtime.consumer import Consumer
from framework.runtime.lanes import Batch, Worker
from framework.runtime.ledger import Ledger
from framework.runtime.wiring import Wiring

__all__ = ["BatchConsumer", "consumer_for"]


def consumer_for(wiring: Wiring, views: list[GroupPartition]) -> Consumer:
    """The consumer of ``wiring``'s handler: a :class:`BatchConsumer` for a batch handler."""
    return Consumer(wiring, views) if wiring.handler.batch is None else BatchConsumer(wiring, views)


class _Partition:
    """One partition's collected work and whether a batch of it is queued or running."""

    __slots__ = ("first_at", "ledger", "pending", "running", "wakeup")

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.pending: deque[tuple[Work, bool]] = deque()  # (work, suspect) in arrival order
        self.running = False
        self.first_at = 0.0  # monotonic time the oldest pending work arrived
        self.wakeup = anyio.Event()


class BatchConsumer(Consumer):
    """A :class:`~framework.runtime.consumer.Consumer` whose lanes run batches (see the module docstring)."""

    def __init__(self, wiring: Wiring, views: list[GroupPartition]) -> None:
        policy = wiring.handler.batch
        assert policy is not None
        if wiring.settings.prefetch < policy.max_size:  # a batch can only be as large as what is fetched
            wiring = attrs.evolve(wiring, settings=attrs.evolve(wiring.settings, prefetch=policy.max_size))
        if wiring.middleware:
            wiring.log.warning("middleware does not wrap batch handlers (a batch is not one message): it is skipped")
        super().__init__(wiring, views)
        self.policy = policy
        self.runner = BatchRunner(wiring, self.settle, self.attempts, self.admission)
        self.admission.submit = self._collect
        self._parts: dict[int, _Partition] = {}  # id(ledger) -> its collected work

    # -- collecting ------------------------------------------------------------------------------------

    async def serve(
        self, ledger: Ledger, intake: anyio.CancelScope | None = None, intake_done: anyio.Event | None = None
    ) -> None:
        """Run the partition's tasks (see :meth:`Consumer.serve`) and its batch timer."""
        part = self._parts[id(ledger)] = _Partition(ledger)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._timer, part)
                await super().serve(ledger, intake, intake_done)
                tg.cancel_scope.cancel()
        finally:
            del self._parts[id(ledger)]
            ledger.forget(work[0] for work, _ in part.pending)  # left pending: redelivered

    def _collect(
        self,
        worker: Worker,
        view: Any,
        by_key: dict[Any, list[Work]],
        keyless: list[Work] | None = None,
        isolated: Iterable[tuple[Work, bool, Hashable]] = (),
        scope: int = 0,
    ) -> None:
        """Admitted work (the admit stage's ``submit``): kept in arrival order until it forms a batch.

        Each key's works arrive in order (the admit stage keeps it per key, and isolates suspects
        with the later works of their keys), so appending key by key keeps every key's order."""
        part = self._parts.get(id(view))
        if part is None:  # the partition's tenure is over: its work stays pending
            view.forget([d for works in by_key.values() for d, _ in works])
            view.forget([d for d, _ in keyless or ()])
            view.forget([w[0] for w, _, _ in isolated])
            return
        arrived = [(w, False) for works in by_key.values() for w in works]
        arrived += [(w, False) for w in keyless or ()]
        arrived += [(w, suspect) for w, suspect, _ in isolated]
        if not arrived:
            return
        if not part.pending:
            part.first_at = time.monotonic()
        part.pending.extend(arrived)
        self._dispatch(part)
        part.wakeup.set()

    async def _timer(self, part: _Partition) -> None:
        """Hand over a partition's batch once ``max_wait`` passed since its first message arrived."""
        wait = self.policy.max_wait
        while True:
            part.wakeup = anyio.Event()
            if part.pending and not part.running:
                due = part.first_at + wait - time.monotonic()
                if due > 0:
                    with anyio.move_on_after(due):
                        await part.wakeup.wait()
                    continue
                self._dispatch(part, force=True)
                continue
            await part.wakeup.wait()

    def _dispatch(self, part: _Partition, *, force: bool = False) -> None:
        """Queue the partition's next batch on a lane if none is running and one is due (full, or
        ``force``: its wait is over, or fetching stopped)."""
        if part.running or not part.pending:
            return
        size = self.policy.max_size
        if not (force or not self._fetching or len(part.pending) >= size):
            return
        pending = part.pending
        (work, suspect) = pending[0]
        lanes = self.wiring.lanes
        part.running = True
        if suspect:  # alone, on the isolation lane: one suspect at a time in the process
            pending.popleft()
            lanes.submit(self, part.ledger, {}, None, [([work], True, None)], self.wiring.scope)
        else:
            batch: list[Work] = []
            ids: set[str] = set()
            skipped: list[tuple[Work, bool]] = []
            while pending and len(batch) < size and not pending[0][1]:
                item = pending.popleft()
                d = item[0][0]
                if d.message_id in ids:  # a copy of a message of this batch: the next batch's inbox decides
                    skipped.append(item)
                    continue
                ids.add(d.message_id)
                batch.append(item[0])
            pending.extendleft(reversed(skipped))
            lanes.submit(self, part.ledger, {("batch", part.ledger.partition): [batch]}, None, (), self.wiring.scope)
        if pending:
            part.first_at = time.monotonic()

    def stop_fetching(self) -> None:
        """Stop reading (see :meth:`Consumer.stop_fetching`); what is collected is handed over at once."""
        super().stop_fetching()
        for part in list(self._parts.values()):
            self._dispatch(part, force=True)

    # -- the lanes' side ----------------------------------------------------------------------------------

    async def process(self, ledger: Ledger, batch: Batch) -> None:
        """Run the lane's batch (one list of works) and settle each message; then the partition's next one."""
        works: list[Work] = batch.works[batch.next]
        batch.next = len(batch.works)
        started = time.perf_counter()
        lease = ledger.lease
        try:
            if lease is not None and not lease.usable(time.monotonic()):  # lost or handed back: start nothing
                ledger.forget(d for d, _ in works)
                return
            await self.runner.run(ledger, works, suspect=batch.suspect)
        finally:
            self.stats.handler_seconds += time.perf_counter() - started
            part = self._parts.get(id(ledger))
            if part is not None:
                part.running = False
                self._dispatch(part, force=time.monotonic() >= part.first_at + self.policy.max_wait)
                part.wakeup.set()

    def abandon(self, ledger: Ledger, works: Sequence[Any]) -> None:
        """Forget batches after an internal error; their messages stay pending and are redelivered."""
        ledger.forget(d for batch in works for d, _ in batch)

"""Lanes: the process's fixed set of worker loops that run handlers.

A process has ``concurrency`` lanes; that is its global bound on handlers running at once. Work is
queued in :class:`Batch` es, which a lane runs by calling handlers directly, one after another (no
task is spawned per message):

* work with a key runs on one lane at a time, so messages with one key run one at a time, in the
  order they were fetched: on the lane where earlier works of its key are still queued or running
  (the key is bound to it until they are done), else on a free lane (asleep, nothing to do), else
  on the lane its key hashes to. A key with nothing in flight thus never waits behind another
  key's slow handler while a lane is free (with a fixed lane per key, keys sharing a lane waited
  for each other: one worker, 600 msg/s of 2 ms SQL blocks, p99 from admission to the handler's
  start 7.5-14.5 ms then, 0.9-1.4 ms now). Keys beyond a fetch's free lanes fall back to the
  hash, so a burst still spreads over every lane;
* work without a key needs no order: its batch goes to a shared queue, and every lane with
  nothing of its own to do takes works from it one at a time, so no keyless message waits behind
  a slow handler while a lane is free;
* isolated work (redelivered messages that may be what killed a worker, see
  :meth:`framework.runtime.consumer.Consumer._sort_redeliveries`) runs one work at a time in the whole
  process on an isolation lane of its own, beside the others, so neither waiting for isolation
  nor a slow isolated handler holds a lane other keys need (while one runs, the process runs up
  to ``concurrency + 1`` handlers). Later works with the same key are isolated behind it
  (``gated``), which keeps their order.

Queues are bounded by the consumers' in-flight limits (``prefetch``): a consumer fetches more
only when its earlier messages have been settled.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, Protocol

import anyio

from framework.logs import get_logger

__all__ = ["Batch", "LanePool", "Worker"]

log = get_logger("framework.runtime.lanes")


class Batch:
    """Works of one consumer partition, taken in order through :attr:`next` by the lanes running it.

    A keyed batch is run by its one lane; a keyless batch by every lane that takes from it; an
    isolated batch holds one work, and ``suspect`` says whether that one needs counting first.
    """

    __slots__ = ("done", "gate", "isolated", "keys", "next", "running", "suspect", "view", "worker", "works")

    def __init__(
        self,
        worker: Worker,
        view: Any,
        works: list[Any],
        *,
        suspect: bool = False,
        gate: Hashable = None,
        keys: list[Hashable] | None = None,
    ) -> None:
        self.worker = worker
        self.view = view
        self.works = works
        self.next = 0  # index of the next work to take; a lane takes one by raising it
        self.running = 0  # lanes running this batch now
        self.done = False  # every work taken and every lane that took one has returned
        self.isolated = False  # queued for isolation (set by the pool)
        self.suspect = suspect
        self.gate = gate  # (scope, key) this isolated work holds the order of, if keyed
        self.keys = keys  # the (scope, key)s of its works, bound to its lane until it is done


class Worker(Protocol):
    """What a lane runs: a consumer's processing of a batch."""

    async def process(self, view: Any, batch: Batch) -> None:
        """Take works from ``batch`` (raising ``batch.next``) until none is left; handle and settle
        each; must not raise for handler failures."""
        ...

    def abandon(self, view: Any, works: Sequence[Any]) -> None:
        """Forget ``works`` after an internal error (they stay pending and are redelivered)."""
        ...


class _Lane:
    __slots__ = ("index", "mailbox", "wakeup")

    def __init__(self, index: int) -> None:
        self.index = index
        self.mailbox: deque[Batch] = deque()
        self.wakeup = anyio.Event()


class LanePool:
    """A fixed set of lanes; see the module docstring."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("concurrency must be at least 1")
        self.size = size
        self._lanes = [_Lane(i) for i in range(size)]
        self._keyless: deque[Batch] = deque()  # shared by every lane
        self._isolated: deque[Batch] = deque()  # one work each, run one at a time by the isolation lane
        self._isolation = _Lane(-1)  # its wakeup is set when isolated work is queued
        self.gates: dict[Hashable, int] = {}  # (scope, key) -> isolated works of that key not finished
        self.bound: dict[Hashable, list[int]] = {}  # (scope, key) -> [its lane, its batches not done]
        # Lanes asleep with nothing to do, most recent last. Keyless work wakes only as many of
        # them as it has works: waking every lane per submit cost 64 task switches per message
        # at low rates (the profile of issue #10), and busy lanes take from the shared queue anyway.
        self._asleep: dict[_Lane, None] = {}
        self._queued = 0  # batches queued or running
        self._idle = anyio.Event()
        self._idle.set()

    def gated(self, scope: int, key: Hashable) -> bool:
        """Whether isolated work of this key is queued or running: later work of the key must follow it."""
        return bool(self.gates) and (scope, key) in self.gates

    def submit(
        self,
        worker: Worker,
        view: Any,
        by_key: dict[Hashable, list[Any]],
        keyless: list[Any] | None = None,
        isolated: Iterable[tuple[Any, bool, Hashable]] = (),
        scope: int = 0,
    ) -> None:
        """Queue work: ``by_key`` maps a key to its works in order (each key's to one lane, see the
        module docstring); ``keyless`` works go to any free lane; ``isolated`` is (work, suspect,
        key or None) in order, run one at a time."""
        count = 0
        asleep = self._asleep
        for index, (works, keys) in self._place(by_key, scope).items():
            lane = self._lanes[index]
            lane.mailbox.append(Batch(worker, view, works, keys=keys))
            if asleep.pop(lane, 0) is None:
                lane.wakeup.set()
            count += 1
        if keyless:
            self._keyless.append(Batch(worker, view, keyless))
            count += 1
            for _ in range(min(len(keyless), len(asleep))):
                asleep.popitem()[0].wakeup.set()
        for work, suspect, key in isolated:
            gate = None if key is None else (scope, key)
            if gate is not None:
                self.gates[gate] = self.gates.get(gate, 0) + 1
            batch = Batch(worker, view, [work], suspect=suspect, gate=gate)
            batch.isolated = True
            self._isolated.append(batch)
            self._isolation.wakeup.set()
            count += 1
        if count:
            if self._queued == 0:
                self._idle = anyio.Event()
            self._queued += count

    def _place(self, by_key: dict[Hashable, list[Any]], scope: int) -> dict[int, tuple[list[Any], list[Hashable]]]:
        """Each key's lane (and its binding there): lane number -> (its works, their keys)."""
        bound = self.bound
        placed: dict[int, tuple[list[Any], list[Hashable]]] = {}
        idle: list[_Lane] | None = None
        for key, works in by_key.items():
            k = (scope, key)
            hold = bound.get(k)
            if hold is not None:  # earlier works of the key are queued or running there: after them
                index = hold[0]
                hold[1] += 1
            else:
                if idle is None:
                    idle = list(self._asleep)  # most recently asleep last: taken first
                while idle and idle[-1].index in placed:
                    idle.pop()
                index = idle.pop().index if idle else hash(k) % self.size
                bound[k] = [index, 1]
            entry = placed.get(index)
            if entry is None:
                placed[index] = (works, [k])  # (the caller's list: it hands it over)
            else:
                entry[0].extend(works)
                entry[1].append(k)
        return placed

    @property
    def busy(self) -> bool:
        """Whether any lane has queued or running work."""
        return self._queued > 0

    async def wait_idle(self) -> None:
        """Return once every lane is empty and idle."""
        while self._queued:
            await self._idle.wait()

    async def run(self) -> None:
        """Run every lane until cancelled."""
        async with anyio.create_task_group() as tg:
            for lane in self._lanes:
                tg.start_soon(self._run_lane, lane)
            tg.start_soon(self._run_lane, self._isolation)

    def _next_batch(self, lane: _Lane) -> Batch | None:
        """What ``lane`` runs next: its own keyed work, then keyless (the isolation lane: isolated work)."""
        if lane is self._isolation:
            return self._isolated.popleft() if self._isolated else None
        if lane.mailbox:
            return lane.mailbox.popleft()
        shared = self._keyless
        while shared:
            batch = shared[0]
            if batch.next < len(batch.works):
                return batch  # stays queued: other free lanes take from it too
            shared.popleft()  # every work taken; the lanes running it finish it
        return None

    async def _run_lane(self, lane: _Lane) -> None:
        while True:
            batch = self._next_batch(lane)
            if batch is None:
                lane.wakeup = anyio.Event()
                if lane is not self._isolation:
                    self._asleep[lane] = None
                await lane.wakeup.wait()
                continue
            batch.running += 1
            try:
                await batch.worker.process(batch.view, batch)
            except Exception as exc:  # a framework bug, not a handler failure: keep the lane alive
                log.error("lane failed while processing a batch; its messages will be redelivered", exc_info=exc)
                rest, batch.next = batch.works[batch.next :], len(batch.works)
                batch.worker.abandon(batch.view, rest)
            finally:
                batch.running -= 1
                self._finished(batch)

    def _finished(self, batch: Batch) -> None:
        """Account for a lane returning from ``batch``; the batch is done once no work is left in it."""
        if batch.done or batch.running or batch.next < len(batch.works):
            return
        batch.done = True
        if batch.keys is not None:  # its keys are free to go to any lane once nothing of theirs is left
            bound = self.bound
            for k in batch.keys:
                hold = bound[k]
                if hold[1] == 1:
                    del bound[k]
                else:
                    hold[1] -= 1
        if batch.isolated:
            gate = batch.gate
            if gate is not None:
                left = self.gates[gate] - 1
                if left:
                    self.gates[gate] = left
                else:
                    del self.gates[gate]
        self._queued -= 1
        if self._queued == 0:
            self._idle.set()

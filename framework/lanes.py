"""Per-key lanes: the process's fixed set of worker loops that run handlers.

A process has ``concurrency`` lanes; that is its global bound on handlers running at once. Work
with a key always goes to the lane its key hashes to, so messages with one key run one at a time,
in the order they were fetched; work without a key is spread round-robin. A lane takes whole
sub-batches from its mailbox and calls handlers directly, one after another, so there is no task
spawned per message. Mailboxes are bounded by the consumers' in-flight limits (``prefetch``):
a consumer fetches more only when its earlier messages have been settled.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import anyio

from framework.logs import get_logger

__all__ = ["LanePool", "Worker"]

log = get_logger("framework.lanes")


class Worker(Protocol):
    """What a lane runs: a consumer's processing of one sub-batch."""

    async def process(self, view: Any, works: Sequence[Any]) -> None:
        """Handle and settle ``works``; must not raise for handler failures."""
        ...

    def abandon(self, view: Any, works: Sequence[Any]) -> None:
        """Forget ``works`` after an internal error (they stay pending and are redelivered)."""
        ...


class _Lane:
    __slots__ = ("mailbox", "wakeup")

    def __init__(self) -> None:
        self.mailbox: deque[tuple[Worker, Any, list[Any]]] = deque()
        self.wakeup = anyio.Event()


class LanePool:
    """A fixed set of lanes; see the module docstring."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("concurrency must be at least 1")
        self.size = size
        self._lanes = [_Lane() for _ in range(size)]
        self._next = 0
        self._queued = 0  # sub-batches queued or running
        self._idle = anyio.Event()
        self._idle.set()

    def lane_for(self, scope: int, key: str | None) -> int:
        """The lane of a message: fixed for (scope, key); round-robin without a key."""
        if key is None:
            self._next = (self._next + 1) % self.size
            return self._next
        return hash((scope, key)) % self.size

    def submit(self, worker: Worker, view: Any, by_lane: dict[int, list[Any]]) -> None:
        """Queue sub-batches: ``by_lane`` maps a lane number to the works it gets, in order."""
        for index, works in by_lane.items():
            lane = self._lanes[index]
            lane.mailbox.append((worker, view, works))
            lane.wakeup.set()
        if by_lane:
            if self._queued == 0:
                self._idle = anyio.Event()
            self._queued += len(by_lane)

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

    async def _run_lane(self, lane: _Lane) -> None:
        mailbox = lane.mailbox
        while True:
            if not mailbox:
                lane.wakeup = anyio.Event()
                await lane.wakeup.wait()
                continue
            worker, view, works = mailbox.popleft()
            try:
                await worker.process(view, works)
            except Exception as exc:  # a framework bug, not a handler failure: keep the lane alive
                log.error("lane failed while processing a batch; its messages will be redelivered", exc_info=exc)
                worker.abandon(view, works)
            finally:
                self._queued -= 1
                if self._queued == 0:
                    self._idle.set()

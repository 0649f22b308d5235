"""The scheduler: moves due scheduled messages to their destinations, and fires recurring jobs' ticks.

Every runtime runs one :class:`Scheduler` in its root task group. Its mover moves the due
scheduled messages of the whole namespace, whatever their destination (the broker keeps one index
of the partitions holding scheduled messages, see :mod:`broker.redis.scheduling`): any live
worker of the namespace delivers any scheduled message, and several workers moving at once never
deliver one twice (the move is one Lua script). A pass runs every ``interval`` seconds, sooner
when the index says something falls due earlier, and again at once while a pass hit its limit;
once a second it sweeps every indexed partition (a hint overwritten by a racing mover costs at
most that second).

Its tickers, one per recurring job of the runtime's services, sleep until the job's next tick
and ask the broker to fire it (``job_tick.lua``): the first instance to ask appends the tick's
message, the others find it fired. A broker error is logged and retried; it never stops the
runtime.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio

from broker import Broker, now_ms
from broker.capabilities import as_scheduler
from framework.logs import get_logger
from framework.scheduling import Job
from framework.service import Service

__all__ = ["Scheduler"]

log = get_logger("framework.scheduler")

_SWEEP_EVERY = 1.0  # seconds between passes over every indexed partition
_ERROR_BACKOFF = 1.0  # seconds to wait after a broker error


class Scheduler:
    """The mover of scheduled messages and the tickers of recurring jobs, for one runtime."""

    def __init__(
        self, broker: Broker, services: Sequence[Service], *, interval: float = 0.2, limit: int = 1000
    ) -> None:
        self.broker = broker
        self.scheduler = as_scheduler(broker)
        self.jobs: list[Job] = [job for s in services for job in getattr(s, "jobs", ())]
        self.interval = interval
        self.limit = limit
        self.moved = 0  # messages this process moved
        self.fired = 0  # ticks this process fired

    async def run(self) -> None:
        """Move and tick until cancelled."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.move_forever)
            for job in self.jobs:
                tg.start_soon(self.tick_forever, job)

    async def move_forever(self) -> None:
        """The mover loop."""
        sweep_at = 0.0
        failing = False
        while True:
            try:
                sweep = time.monotonic() >= sweep_at
                if sweep:
                    sweep_at = time.monotonic() + _SWEEP_EVERY
                result = await self.scheduler.move_scheduled(now_ms(), limit=self.limit, sweep=sweep)
            except Exception as exc:
                if not failing:
                    log.warning("could not move scheduled messages; retrying", error=str(exc))
                failing = True
                await anyio.sleep(_ERROR_BACKOFF)
                continue
            if failing:
                log.info("moving scheduled messages again")
                failing = False
            self.moved += result.moved
            if result.more:
                continue
            pause = self.interval
            if result.next_due_ms is not None:
                pause = min(pause, max(0.0, (result.next_due_ms - now_ms()) / 1000))
            await anyio.sleep(max(pause, 0.005))

    async def tick_forever(self, job: Job) -> None:
        """One job's ticker: fire each tick as it falls (at most once across instances)."""
        failing = False
        while True:
            now = now_ms()
            tick = job.last_tick(now)
            try:
                outcome = await self.scheduler.fire_tick(job.queue, tick, job.tick_envelope(tick))
            except Exception as exc:
                if not failing:
                    log.warning("could not fire a recurring job's tick; retrying", job=job.label, error=str(exc))
                failing = True
                await anyio.sleep(_ERROR_BACKOFF)
                continue
            failing = False
            if outcome == 1:
                self.fired += 1
                log.debug("recurring job tick fired", job=job.label, tick=tick)
            elif outcome < 0:
                log.info("recurring job registered: it fires from its next tick on", job=job.label)
            await anyio.sleep(max(0.0, (job.next_tick(now_ms()) - now_ms()) / 1000) + 0.002)

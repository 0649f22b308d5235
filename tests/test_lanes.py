"""The lane pool alone (no broker: it is in-process scheduling): keyed work keeps each key's order,
one run at a time, without waiting behind another key's slow handler while a lane is free."""

from __future__ import annotations

import random
import time
from typing import Any

import anyio
import pytest

from framework.runtime.lanes import Batch, LanePool

pytestmark = pytest.mark.anyio


class Recorder:
    """A lanes' Worker whose works are (key, n, seconds): it runs each in turn and records when."""

    def __init__(self) -> None:
        self.runs: list[tuple[Any, int, float, float]] = []  # key, n, started, ended
        self.running: set[Any] = set()
        self.overlaps: list[Any] = []  # keys found running twice at once

    async def process(self, view: Any, batch: Batch) -> None:
        while batch.next < len(batch.works):
            key, n, seconds = batch.works[batch.next]
            batch.next += 1
            if key in self.running:
                self.overlaps.append(key)
            self.running.add(key)
            started = time.monotonic()
            await anyio.sleep(seconds)
            self.running.discard(key)
            self.runs.append((key, n, started, time.monotonic()))

    def abandon(self, view: Any, works: Any) -> None:
        raise AssertionError("nothing fails here")


async def _run(pool: LanePool, body: Any) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.run)
        await anyio.sleep(0.01)  # every lane asleep
        with anyio.fail_after(30):
            await body()
            await pool.wait_idle()
        tg.cancel_scope.cancel()


def _by_key(works: list[tuple[Any, int, float]]) -> dict[Any, list[tuple[Any, int, float]]]:
    out: dict[Any, list[tuple[Any, int, float]]] = {}
    for w in works:
        out.setdefault(w[0], []).append(w)
    return out


async def test_a_key_with_nothing_in_flight_does_not_wait_behind_another_keys_slow_handler() -> None:
    """With a lane per key hash, keys sharing a lane waited for each other's handlers even with the
    other lanes free (the latency tail of keyed messages with slow handlers). Two keys that hash to
    one lane: the second, submitted while the first's slow handler runs, starts at once."""
    pool = LanePool(2)
    worker = Recorder()
    slow = "k0"
    other = next(f"k{i}" for i in range(1, 1000) if hash((0, f"k{i}")) % 2 == hash((0, slow)) % 2)

    async def body() -> None:
        pool.submit(worker, None, {slow: [(slow, 0, 2.0)]})
        await anyio.sleep(0.1)  # the slow handler runs
        pool.submit(worker, None, {other: [(other, 1, 0.0)]})

    await _run(pool, body)
    started = {key: s for key, _, s, _ in worker.runs}
    assert started[other] - started[slow] < 1.0, "the second key waited for the first one's handler"
    assert pool.bound == {}  # nothing in flight: every key free to go to any lane


async def test_each_keys_works_run_one_at_a_time_in_order_across_submits_and_lanes() -> None:
    """Many submits of a few keys with random handler times on few lanes: per key, runs never
    overlap and follow the submit order, though a key moves between lanes once it has nothing
    in flight; keyless work runs beside it; nothing stays bound after."""
    pool = LanePool(3)
    worker = Recorder()
    rng = random.Random(7)
    sent: dict[Any, list[int]] = {}
    n = 0

    async def body() -> None:
        nonlocal n
        for _ in range(60):
            works = []
            for _ in range(rng.randint(1, 6)):
                key = f"k{rng.randint(0, 4)}"
                works.append((key, n, rng.choice((0.0, 0.001, 0.005))))
                sent.setdefault(key, []).append(n)
                n += 1
            keyless = [(f"free{n + i}", n + i, 0.001) for i in range(rng.randint(0, 2))]
            n += len(keyless)
            pool.submit(worker, None, _by_key(works), keyless)
            await anyio.sleep(rng.choice((0.0, 0.002, 0.01)))

    await _run(pool, body)
    assert worker.overlaps == []
    for key, order in sent.items():
        assert [m for k, m, _, _ in sorted(worker.runs, key=lambda r: r[2]) if k == key] == order, key
    assert pool.bound == {}


async def test_keys_of_one_submit_spread_over_the_free_lanes() -> None:
    """A submit's keys with nothing in flight take the free lanes, one key each, before any lane
    gets a second key: four 0.5 s handlers of keys that hash to one lane run on four lanes at once."""
    pool = LanePool(4)
    worker = Recorder()
    keys = [k for k in (f"k{i}" for i in range(1000)) if hash((0, k)) % 4 == 0][:4]

    async def body() -> None:
        pool.submit(worker, None, {k: [(k, i, 0.5)] for i, k in enumerate(keys)})

    began = time.monotonic()
    await _run(pool, body)
    assert time.monotonic() - began < 0.9  # two keys one after another on a lane would take 1 s or more

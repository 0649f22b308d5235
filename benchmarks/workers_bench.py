"""``framework run --workers 2`` against two separate ``framework run`` processes (issue #36).

    python -m benchmarks --only workers

Both drain the same backlog (a 4-partition queue, 1,000 keys, inbox on, partitions owned) in the
same round, order alternating: once as one supervisor with two worker processes, once as two
workers started by hand. The consumer names are the same both ways (``w-0``, ``w-1``), so the
partitions split the same way. The backlog is sent once every partition is owned (start-up and
the join rebalance left out); the rate is what is left when the sending ends over the time to
the last entry consumed. The supervisor only watches its
children (no message passes through it), so the ratio should be 1 within noise.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import time
from typing import Any

import anyio
import redis

from benchmarks.drain import (
    DRAIN_TIMEOUT,
    entries_left,
    lease_holders,
    partition_streams,
    send_backlog,
    timed_drain,
    wait_until,
    worker_args,
)
from benchmarks.procs import child
from framework import Queue, Service
from framework.testing import delete_namespace, unique_namespace

__all__ = ["QUEUE", "run", "trial"]

QUEUE = Queue("bench.workers", partitions=4)
MODES = ("supervisor", "separate")

pool = Service("pool")  # the inbox is on (the default)


@pool.command(QUEUE, key=lambda c: c["k"])
async def handle(cmd: dict[str, Any]) -> None:
    """Does nothing: the benchmark measures the runtime's own cost per message."""


def trial(url: str, n: int, mode: str) -> dict[str, Any]:
    """Drain ``n`` commands with two workers, under a supervisor or as two processes (msg/s, see the module)."""
    namespace = unique_namespace("bench-workers")
    r = redis.Redis.from_url(url)
    streams = partition_streams(namespace, QUEUE)

    def settled() -> bool:
        held = lease_holders(r, streams, "pool")
        return len(held) == len(streams) and sorted(set(held)) == ["w-0", "w-1"] and held.count("w-0") == 2

    try:
        args = worker_args("benchmarks.workers_bench:pool", url, namespace)
        with contextlib.ExitStack() as stack:
            if mode == "supervisor":
                procs = [stack.enter_context(child("workers-supervisor", [*args, "--workers", "2", "--consumer", "w"]))]
            else:
                procs = [
                    stack.enter_context(child(f"workers-separate-{i}", [*args, "--consumer", f"w-{i}"]))
                    for i in range(2)
                ]
            deadline = time.monotonic() + DRAIN_TIMEOUT
            wait_until(settled, procs, deadline, "workers", poll=0.05)
            anyio.run(functools.partial(send_backlog, url, namespace, QUEUE, n))  # consumed while it is sent
            first_left, seconds = timed_drain(lambda: entries_left(r, streams), procs, deadline, "workers")
        return {"n": n, "measured": first_left, "mode": mode, "msgs_per_s": first_left / seconds}
    finally:
        r.close()
        delete_namespace(url, namespace)


def run(url: str, *, messages: int = 50_000, repeats: int = 1) -> dict[str, Any]:
    """Both modes ``repeats`` times, back to back, order alternating; the ratio paired within a round."""
    runs: dict[str, list[float]] = {m: [] for m in MODES}
    ratios: list[float] = []
    for round_ in range(repeats):
        order = MODES if round_ % 2 == 0 else MODES[::-1]
        got = {mode: trial(url, messages, mode)["msgs_per_s"] for mode in order}
        for mode, rate in got.items():
            runs[mode].append(rate)
        ratios.append(got["supervisor"] / got["separate"])
    return {
        "messages": messages,
        "cores": os.cpu_count(),
        "runs": runs,
        "medians": {k: statistics.median(v) for k, v in runs.items()},
        "ratio": statistics.median(ratios),
    }


if __name__ == "__main__":  # a quick look without the benchmark runner
    import sys

    import orjson

    print(orjson.dumps(run(sys.argv[1], messages=int(sys.argv[2]) if len(sys.argv) > 2 else 20_000)).decode())

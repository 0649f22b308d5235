"""Partition ownership (#12): one service over 8 partitions, inbox on, 1, 2 and 4 worker processes.

    python -m benchmarks --only ownership

Each trial drains a backlog of commands (1,000 keys) on an 8-partition queue with
``python -m framework run`` workers started with ``FRAMEWORK_OWNERSHIP=partitioned`` (each partition
owned by one worker at a time: leases, fencing tokens on every settle call) or ``off`` (every worker
reads every partition: the behaviour before ownership). The workers start and settle first (every
partition owned, each worker holding its share) on a backlog sent before they start; the rate runs
from then to the last entry consumed (what was left at that point over the time). The cost of ownership is
``1 - owned / unowned`` per worker count, paired within a round. The machine's core count bounds
the curve: on 2 cores, 2 workers plus the server share them.
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

__all__ = ["OWNED", "run", "trial"]

OWNED = Queue("bench.owned", partitions=8)

owned = Service("owned")  # the inbox is on (the default)


@owned.command(OWNED, key=lambda c: c["k"])
async def handle(cmd: dict[str, Any]) -> None:
    """Does nothing: the benchmark measures the runtime's own cost per message."""


def trial(url: str, n: int, workers: int, ownership: str) -> dict[str, Any]:
    """Drain ``n`` commands with ``workers`` processes; msgs/s from first consumed to last.

    The backlog is sent first; the rate is measured only once the workers have settled (with
    ownership: every partition owned, each worker holding its share; without: every worker
    reading), from what is left then to empty, so start-up and the join rebalance are not in it.
    """
    namespace = unique_namespace("bench-owned")
    r = redis.Redis.from_url(url)
    streams = partition_streams(namespace, OWNED)
    names = [f"w{i}" for i in range(workers)]

    def settled() -> bool:
        if ownership == "off":
            try:
                return len(r.xinfo_consumers(streams[0], "owned")) >= workers
            except redis.ResponseError:  # no group yet
                return False
        held = lease_holders(r, streams, "owned")
        share = -(-len(streams) // workers)
        return len(held) == len(streams) and all(held.count(w) <= share for w in names)

    try:
        anyio.run(functools.partial(send_backlog, url, namespace, OWNED, n))
        env = {"FRAMEWORK_OWNERSHIP": ownership}
        args = worker_args("benchmarks.ownership_bench:owned", url, namespace)
        with contextlib.ExitStack() as stack:
            procs = [
                stack.enter_context(child(f"owned-{ownership}-{name}", [*args, "--consumer", name], env, grace=10))
                for name in names
            ]
            deadline = time.monotonic() + DRAIN_TIMEOUT
            wait_until(settled, procs, deadline, "ownership", poll=0.05)
            time.sleep(0.3)
            first_left, seconds = timed_drain(lambda: entries_left(r, streams), procs, deadline, "ownership")
        return {
            "n": n,
            "measured": first_left,
            "workers": workers,
            "ownership": ownership,
            "msgs_per_s": first_left / seconds,
        }
    finally:
        r.close()
        delete_namespace(url, namespace)


def run(url: str, *, messages: int = 50_000, repeats: int = 1, workers: tuple[int, ...] = (1, 2, 4)) -> dict[str, Any]:
    """Every configuration ``repeats`` times (owned and unowned back to back, order alternating)."""
    runs: dict[str, list[float]] = {}
    costs: dict[int, list[float]] = {w: [] for w in workers}
    for round_ in range(repeats):
        for w in workers:
            order = ("partitioned", "off") if round_ % 2 == 0 else ("off", "partitioned")
            got = {mode: trial(url, messages, w, mode)["msgs_per_s"] for mode in order}
            for mode, rate in got.items():
                runs.setdefault(f"{mode}:{w}", []).append(rate)
            costs[w].append(1 - got["partitioned"] / got["off"])
    return {
        "messages": messages,
        "cores": os.cpu_count(),
        "runs": runs,
        "medians": {k: statistics.median(v) for k, v in runs.items()},
        "cost": {str(w): statistics.median(c) for w, c in costs.items()},
    }


if __name__ == "__main__":  # a quick look without the benchmark runner
    import sys

    import orjson

    print(orjson.dumps(run(sys.argv[1], messages=int(sys.argv[2]) if len(sys.argv) > 2 else 20_000)).decode())

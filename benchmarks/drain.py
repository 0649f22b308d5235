"""A keyed backlog drained by ``framework run`` worker processes: what the ownership, cluster and
workers benchmarks share.

Each sends commands over 1,000 keys to a partitioned queue (:func:`send_backlog`), starts workers
with one command line (:func:`worker_args`), waits for them to settle (:func:`wait_until`) and
times the drain from what is left then to empty (:func:`timed_drain`). A wait raises as soon as a
worker exits, or once the trial's deadline (:data:`DRAIN_TIMEOUT` seconds after the workers start)
has passed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import redis

from benchmarks.procs import Child
from framework import Client, Queue

__all__ = [
    "DRAIN_TIMEOUT",
    "KEYS",
    "WORKER_OPTS",
    "entries_left",
    "lease_holders",
    "partition_streams",
    "send_backlog",
    "timed_drain",
    "wait_until",
    "worker_args",
]

KEYS = 1000
WORKER_OPTS = ("--concurrency", "64", "--prefetch", "500")
DRAIN_TIMEOUT = 300  # seconds from the workers' start to the backlog drained


async def send_backlog(url: str, namespace: str, queue: Queue, n: int) -> None:
    """Send ``n`` commands ``{"k": key, "n": i}`` over :data:`KEYS` keys to ``queue``, 5,000 a call."""
    async with Client(url, namespace=namespace) as client:
        for start in range(0, n, 5000):
            batch = [{"k": str(i % KEYS), "n": i} for i in range(start, min(start + 5000, n))]
            await client.send_many(queue, batch, key=lambda c: c["k"])


def partition_streams(namespace: str, queue: Queue) -> list[str]:
    """The Redis streams of ``queue``'s partitions."""
    return [f"{namespace}:{{{queue.name}:{p}}}" for p in range(queue.partitions)]


def worker_args(service: str, url: str, namespace: str) -> list[str]:
    """``python`` arguments of a worker running ``service`` (``module:name``); the caller adds ``--consumer``."""
    args = ["-m", "framework", "run", service, "--redis-url", url]
    return [*args, "--namespace", namespace, "--log-format", "json", *WORKER_OPTS]


def entries_left(client: redis.Redis, streams: Sequence[str]) -> int:
    """Entries still in ``streams`` (one pipelined XLEN each: the queue deletes what it acknowledges)."""
    pipe = client.pipeline(transaction=False)
    for s in streams:
        pipe.xlen(s)
    return sum(pipe.execute())


def lease_holders(client: redis.Redis, streams: Sequence[str], group: str) -> list[str]:
    """The consumers of ``group`` holding the partitions' leases (one name per owned partition)."""
    owners = [client.hget(f"{s}:g:{group}:lease", "owner") for s in streams]
    return [o.decode() for o in owners if o]


def wait_until(done: Callable[[], bool], procs: Sequence[Child], deadline: float, label: str, *, poll: float) -> None:
    """Ask ``done`` every ``poll`` seconds until it is true; raise if a worker exits or ``deadline`` passes."""
    while not done():
        for p in procs:
            p.check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{label} benchmark: the backlog was not drained within {DRAIN_TIMEOUT} s")
        time.sleep(poll)


def timed_drain(
    left: Callable[[], int], procs: Sequence[Child], deadline: float, label: str, *, poll: float = 0.005
) -> tuple[int, float]:
    """What is ``left`` now, and the seconds until nothing is (the rate is the one over the other)."""
    began, first_left = time.monotonic(), left()
    wait_until(lambda: left() == 0, procs, deadline, label, poll=poll)
    return first_left, time.monotonic() - began

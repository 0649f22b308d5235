"""Recovery after SIGKILL: how fast the entries a killed worker held are processed again.

    python -m benchmarks --only recovery

One trial, in a namespace of its own (deleted afterwards): a backlog of commands on one queue
partition (1,000 keys, an async handler that sleeps ``SLEEP`` seconds, like a small I/O call),
drained by ``python -m framework run`` workers (concurrency 64, prefetch 500, visibility timeout 2 s):

1. ``normal``: worker ``a`` drains; its rate is measured over a window of steady draining.
2. ``restart``: ``a`` is SIGKILLed while it holds hundreds of fetched, unacknowledged entries, and
   restarted under the same consumer name: it re-reads its own pending entries first.
3. ``claim``: ``a`` is SIGKILLed again mid-drain and a second worker ``b`` takes over: it claims
   ``a``'s entries once they have been idle past the visibility timeout, beside its own new reads.

A recovery rate is the number of entries the killed worker held divided by the time from the
first of them being acknowledged to the last (sampled every 10 ms with XPENDING), so process
start-up and the visibility timeout are left out: it is the speed of reprocessing itself, to be
compared with ``normal`` measured in the same trial (``ratio``).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import anyio
import redis

from benchmarks.procs import Child, child
from framework import Client, Queue, Service
from framework.testing import delete_namespace, unique_namespace

__all__ = ["RECOVERY", "recovery", "run_trial"]

RECOVERY = Queue("bench.recovery")
SLEEP = 0.005  # seconds per handler run: a small I/O call, so reprocessing speed depends on concurrency
KEYS = 1000
WORKER_OPTS = ("--concurrency", "64", "--prefetch", "500", "--visibility-timeout", "2")

recovery = Service("recovery")


@recovery.command(RECOVERY)
async def handle(cmd: dict[str, Any]) -> None:
    """Waits like a small I/O call; the benchmark watches the stream, not the handler."""
    await anyio.sleep(SLEEP)


Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


async def _send(url: str, namespace: str, n: int) -> None:
    async with Client(url, namespace=namespace) as client:
        for start in range(0, n, 5000):
            batch = [{"seq": i} for i in range(start, min(start + 5000, n))]
            await client.send_many(RECOVERY, batch, key=lambda c: str(c["seq"] % KEYS))


def _worker(url: str, namespace: str, consumer: str) -> Any:
    args = ["-m", "framework", "run", "benchmarks.recovery_bench:recovery", "--redis-url", url]
    args += ["--namespace", namespace, "--consumer", consumer, "--log-format", "json", *WORKER_OPTS]
    return child(f"recovery-{consumer}", args, grace=10.0)


def _pending_ids(client: redis.Redis, stream: str, group: str) -> set[bytes]:
    rows = client.xpending_range(stream, group, min="-", max="+", count=100_000)
    return {row["message_id"] for row in rows}


def _wait(predicate: Callable[[], bool], worker: Child, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        worker.check()
        time.sleep(0.01)
    raise RuntimeError(f"recovery benchmark: timed out after {timeout:.0f}s waiting for {what}:\n{worker.log_tail()}")


def _kill_holding(client: redis.Redis, stream: str, group: str, worker: Child, least: int) -> set[bytes]:
    """SIGKILL ``worker`` once it holds at least ``least`` entries; return the entries it held."""
    _wait(lambda: len(_pending_ids(client, stream, group)) >= least, worker, 60, f"{least} held entries")
    worker.proc.send_signal(signal.SIGKILL)
    worker.proc.wait()
    return _pending_ids(client, stream, group)


def _recovery_rate(client: redis.Redis, stream: str, group: str, held: set[bytes], worker: Child) -> dict[str, Any]:
    """Entries of ``held`` reprocessed per second, from the first acknowledged to the last."""
    first: tuple[float, int] | None = None
    deadline = time.monotonic() + 120
    while True:
        left = len(held & _pending_ids(client, stream, group))
        now = time.monotonic()
        if first is None and left < len(held):
            first = (now, left + 1)  # the entry just acknowledged counts in the measured stretch
        if left == 0:
            break
        if now > deadline:
            raise RuntimeError(f"recovery benchmark: {left} of {len(held)} held entries still pending after 120 s")
        worker.check()
        time.sleep(0.01)
    assert first is not None
    seconds = max(now - first[0], 0.01)
    return {"held": len(held), "seconds": seconds, "msgs_per_s": first[1] / seconds}


def run_trial(url: str, n: int = 30_000, *, progress: Progress = _quiet) -> dict[str, Any]:
    """One trial (see the module docstring): normal, restart and claim rates in msgs/s."""
    namespace = unique_namespace("bench-recovery")
    stream = f"{namespace}:{{{RECOVERY.name}:0}}"
    group = "recovery"
    client = redis.Redis.from_url(url)
    try:
        anyio.run(_send, url, namespace, n)
        progress(f"recovery: sent {n:,} commands; draining with worker a")
        with _worker(url, namespace, "a") as a:
            _wait(lambda: client.xlen(stream) <= n - 2000, a, 60, "worker a to warm up")
            t1, left1 = time.monotonic(), client.xlen(stream)
            time.sleep(2.0)
            t2, left2 = time.monotonic(), client.xlen(stream)
            normal = (left1 - left2) / (t2 - t1)
            held = _kill_holding(client, stream, group, a, 300)
        progress(f"recovery: normal {normal:,.0f} msg/s; killed a holding {len(held)}; restarting a")
        with _worker(url, namespace, "a") as a:
            restart = _recovery_rate(client, stream, group, held, a)
            progress(f"recovery: restart re-read {len(held)} at {restart['msgs_per_s']:,.0f} msg/s")
            time.sleep(0.5)
            held = _kill_holding(client, stream, group, a, 300)
        with _worker(url, namespace, "b") as b:
            claim = _recovery_rate(client, stream, group, held, b)
            progress(f"recovery: b claimed {len(held)} at {claim['msgs_per_s']:,.0f} msg/s")
        return {
            "n": n,
            "normal_msgs_per_s": normal,
            "restart_msgs_per_s": restart["msgs_per_s"],
            "claim_msgs_per_s": claim["msgs_per_s"],
            "restart_ratio": restart["msgs_per_s"] / normal,
            "claim_ratio": claim["msgs_per_s"] / normal,
            "restart": restart,
            "claim": claim,
        }
    finally:
        client.close()
        delete_namespace(url, namespace)

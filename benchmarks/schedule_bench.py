"""Scheduled messages (#13): delivery lateness and the mover's throughput, one worker process.

    python -m benchmarks --only schedule          (100,000 messages; --quick: 10,000)
    python -m benchmarks.schedule_bench URL [N]   (a quick look without the runner)

A worker (``python -m framework run``, an idle service: its runtime's mover moves every scheduled
message of the namespace) runs while the benchmark schedules N messages to a 4-partition topic
nobody consumes, due evenly over 10 seconds starting after the scheduling is done. Lateness is the
stream entry's id time (server ms of the XADD that delivered it) minus the message's due time,
from every delivered entry: p50, p99 and max. Then N more messages, all due at one instant, measure
the mover's throughput on a backlog: messages moved per second from the due instant until the
last one is in its stream. The producer's scheduling rate (messages stored per second, batches of
5,000 in one pipeline) is reported too.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import time
from typing import Any

import anyio
import orjson
import redis

from benchmarks.procs import child
from broker import now_ms
from broker.headers import DELIVER_AT
from framework import Client, Queue, Service, Topic
from framework.testing import delete_namespace, unique_namespace

__all__ = ["SCHEDULED", "run", "trial"]

SCHEDULED = Topic("bench.scheduled", partitions=4)
SPREAD_S = 10.0
_BATCH = 5000

idle = Service("idle")


@idle.command(Queue("bench.idle"))
async def nothing(cmd: dict[str, Any]) -> None:
    """Never called: the worker is there for its mover."""


async def _schedule(url: str, namespace: str, dues: list[int]) -> float:
    """Schedule one message per due time (batches in one pipeline each); return messages stored per second."""
    started = time.perf_counter()
    async with Client(url, namespace=namespace) as client:
        for start in range(0, len(dues), _BATCH):
            async with client.batch() as batch:
                for i in range(start, min(start + _BATCH, len(dues))):
                    batch.publish(SCHEDULED, {"n": i}, key=str(i), headers={DELIVER_AT: str(dues[i])})
    return len(dues) / (time.perf_counter() - started)


def _delivered(r: redis.Redis, namespace: str) -> int:
    pipe = r.pipeline(transaction=False)
    for p in range(SCHEDULED.partitions):
        pipe.xlen(f"{namespace}:{{{SCHEDULED.name}:{p}}}")
    return sum(pipe.execute())


def _lateness(r: redis.Redis, namespace: str) -> list[int]:
    """Entry time minus due time (ms) of every delivered entry."""
    out = []
    for p in range(SCHEDULED.partitions):
        stream = f"{namespace}:{{{SCHEDULED.name}:{p}}}"
        cursor = "-"
        while True:
            entries = r.xrange(stream, cursor, "+", count=10_000)
            for entry_id, fields in entries:
                due = int(orjson.loads(fields[b"headers"])[DELIVER_AT])
                out.append(int(entry_id.split(b"-")[0]) - due)
            if len(entries) < 10_000:
                break
            cursor = "(" + entries[-1][0].decode()
    return out


def _wait(r: redis.Redis, namespace: str, n: int, worker: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _delivered(r, namespace) < n:
        worker.check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"schedule benchmark: {_delivered(r, namespace)} of {n} delivered after {timeout:.0f} s")
        time.sleep(0.02)


def trial(url: str, n: int) -> dict[str, Any]:
    """One worker; ``n`` messages due over 10 s, then ``n`` due at one instant."""
    namespace = unique_namespace("bench-sched")
    r = redis.Redis.from_url(url)
    args = ["-m", "framework", "run", "benchmarks.schedule_bench:idle", "--redis-url", url]
    args += ["--namespace", namespace, "--log-format", "json", "--consumer", "mover"]
    try:
        with child("schedule-mover", args, {}) as worker:
            deadline = time.monotonic() + 60
            while b"runtime started" not in worker.log_path.read_bytes():
                worker.check()
                if time.monotonic() > deadline:
                    raise RuntimeError("schedule benchmark: the worker did not start within 60 s")
                time.sleep(0.05)
            # Spread: due evenly over SPREAD_S, from after the scheduling (estimated at 5k/s, at least 2 s).
            base = now_ms() + int(max(2.0, n / 5_000) * 1000)
            dues = [base + int(i * SPREAD_S * 1000 / n) for i in range(n)]
            rate = anyio.run(functools.partial(_schedule, url, namespace, dues))
            late_start = max(0, now_ms() - base)  # the scheduling ran past the window's start (then p99 shows it)
            _wait(r, namespace, n, worker, SPREAD_S + 120)
            lateness = sorted(_lateness(r, namespace))
            # Backlog: n more due at one instant; moved per second from that instant to the last XADD.
            for p in range(SCHEDULED.partitions):
                r.delete(f"{namespace}:{{{SCHEDULED.name}:{p}}}")
            instant = now_ms() + int(max(2.0, n / 5_000) * 1000)
            anyio.run(functools.partial(_schedule, url, namespace, [instant] * n))
            if now_ms() > instant:
                raise RuntimeError("schedule benchmark: scheduling the backlog took longer than planned")
            _wait(r, namespace, n, worker, 120)
            last = max(ms + instant for ms in _lateness(r, namespace))
            moved_per_s = n / max((last - instant) / 1000, 0.001)
        return {
            "n": n,
            "schedule_per_s": rate,
            "lateness_ms": {
                "p50": lateness[len(lateness) // 2],
                "p99": lateness[int(len(lateness) * 0.99)],
                "max": lateness[-1],
                "min": lateness[0],
            },
            "window_started_late_ms": late_start,
            "mover_per_s": moved_per_s,
        }
    finally:
        r.close()
        delete_namespace(url, namespace)


def run(url: str, *, messages: int = 100_000, repeats: int = 1) -> dict[str, Any]:
    """``repeats`` trials; medians of lateness p50/p99 and of the mover's backlog throughput."""
    trials = [trial(url, messages) for _ in range(repeats)]
    return {
        "messages": messages,
        "spread_s": SPREAD_S,
        "cores": os.cpu_count(),
        "trials": trials,
        "p50_ms": statistics.median(t["lateness_ms"]["p50"] for t in trials),
        "p99_ms": statistics.median(t["lateness_ms"]["p99"] for t in trials),
        "mover_per_s": statistics.median(t["mover_per_s"] for t in trials),
        "schedule_per_s": statistics.median(t["schedule_per_s"] for t in trials),
    }


if __name__ == "__main__":  # a quick look without the benchmark runner
    import sys

    with contextlib.suppress(KeyboardInterrupt):
        print(orjson.dumps(run(sys.argv[1], messages=int(sys.argv[2]) if len(sys.argv) > 2 else 20_000)).decode())

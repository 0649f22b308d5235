"""Where a SQL-effects worker's CPU goes: the benchmark's handler in parts, one worker process each.

    python -m benchmarks sql-breakdown [--messages 6000] [--rounds 2] [--workers 1] [--work-ms 2]

Not part of the default run. Each variant of :mod:`benchmarks.sql_services` (``BENCH_VARIANT``)
drains the same backlog: ``sleep`` (the 2 ms of work without a SQL block: the runtime, Redis inbox
and acks), ``block`` (the work inside ``ctx.sql_transaction`` without a statement: the group
commit), ``driver`` (plus the row through the psycopg connection) and ``full`` (plus the row
through SQLAlchemy: the benchmark's handler). After a warm-up (:data:`benchmarks.sql_bench.WARMUP`
messages, not measured), a drain ends when the stream is empty and nothing
is pending; client CPU is the workers' ``utime + stime`` over it, per message. The differences
between rows are what each layer costs at that rate (a slower layer also means fewer messages
per fetch and per ack, which costs the runtime more per message: compare at similar rates).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import anyio
import redis

from benchmarks import sql_bench
from benchmarks.machine import process_cpu_s
from benchmarks.sql_services import GROUP, stream_key
from framework.testing import delete_namespace, unique_namespace

__all__ = ["VARIANTS", "main", "variant_trial"]

VARIANTS = ("sleep", "block", "driver", "full")


def _drained(client: redis.Redis, stream: str) -> bool:
    if client.xlen(stream):
        return False
    return all(g["pending"] == 0 for g in client.xinfo_groups(stream))


def variant_trial(url: str, db_url: str, variant: str, workers: int, n: int, work_ms: float = 2.0) -> dict[str, Any]:
    """Drain ``n`` messages with ``workers`` processes running handler ``variant``; rate and CPU per message."""
    namespace = unique_namespace("bench-sqlparts")
    stream = stream_key(namespace)
    sql_bench.truncate(db_url)
    client = redis.Redis.from_url(url, protocol=2)
    os.environ["BENCH_VARIANT"] = variant  # the workers inherit it
    try:
        with sql_bench.start_workers("framework", workers, url, db_url, namespace, work_ms=work_ms) as procs:
            sql_bench.wait_ready(client, stream, GROUP, {f"w{i}" for i in range(workers)}, procs, timeout=60)
            time.sleep(1.0)
            sql_bench.warm_up(url, namespace, lambda: _drained(client, stream), procs, variant)
            cpu0 = sum(process_cpu_s(w.pid) for w in procs)
            began = time.perf_counter()
            anyio.run(sql_bench.fill, url, namespace, n, sql_bench.WARMUP)
            deadline = time.monotonic() + max(120.0, n / 20)
            while not _drained(client, stream):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{variant}: not drained in time:\n{procs[0].log_tail()}")
                for w in procs:
                    w.check()
                time.sleep(0.02)
            seconds = time.perf_counter() - began
            cpu1 = sum(process_cpu_s(w.pid) for w in procs)
        return {"variant": variant, "msgs_per_s": n / seconds, "cpu_ms_per_msg": (cpu1 - cpu0) * 1000 / n}
    finally:
        os.environ.pop("BENCH_VARIANT", None)
        client.close()
        delete_namespace(url, namespace)


def main(url: str, argv: Sequence[str]) -> int:
    """Run every variant ``--rounds`` times (alternating) and print the medians."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks sql-breakdown", description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=6000, help="backlog per drain (default 6000)")
    parser.add_argument("--rounds", type=int, default=2, help="drains per variant (default 2)")
    parser.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--work-ms", type=float, default=2.0, help="work per message, ms (default 2; 0: none)")
    args = parser.parse_args(argv)
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    with sql_bench.database() as db_url:
        for _ in range(args.rounds):
            for variant in VARIANTS:
                r = variant_trial(url, db_url, variant, args.workers, args.messages, args.work_ms)
                results[variant].append(r)
                rate, cpu = r["msgs_per_s"], r["cpu_ms_per_msg"]
                print(f"  {variant:<7} {rate:>8,.0f} msg/s  {cpu:.3f} ms CPU/msg", flush=True)
    print(
        f"\nmedians, {args.workers} worker(s), {args.work_ms:g} ms work, {args.messages:,} messages, "
        f"{args.rounds} round(s):"
    )
    print("variant     msg/s   CPU ms/msg   + over the previous row")
    previous = None
    for variant in VARIANTS:
        rate = statistics.median(r["msgs_per_s"] for r in results[variant])
        cpu = statistics.median(r["cpu_ms_per_msg"] for r in results[variant])
        delta = "" if previous is None else f"{cpu - previous:+.3f}"
        print(f"{variant:<8} {rate:>8,.0f}   {cpu:>9.3f}   {delta}")
        previous = cpu
    return 0

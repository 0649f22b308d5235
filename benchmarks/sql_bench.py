"""SQL effects (issue #15): the framework's ``ctx.sql_transaction`` path next to a plain consumer.

    python -m benchmarks --only sql [--quick]

One trial (:func:`drain_trial`) runs one kind of consumer with 1 or 3 worker processes, in a
namespace of its own (deleted afterwards) and on a scratch PostgreSQL database (the tables are
emptied before each trial):

* ``framework``: ``python -m framework run benchmarks.sql_services:service`` workers (default
  settings: concurrency 64, prefetch 500, Redis inbox on) whose handler does 2 ms of work (``work_ms``:
  the same for both kinds; at 0 the framework's own cost alone) and inserts
  one row inside ``ctx.sql_transaction(engine)`` (its SQL inbox row with it; the runtime's group commit);
  more framework kinds by name in :data:`FRAMEWORK_MODES` (``inbox="sql"``, one transaction per message);
* ``plain``: :mod:`benchmarks.plain_sql_consumer` processes (redis-py + psycopg 3, one transaction
  per ``XREADGROUP`` batch of 100 with the same inbox row, work and row per message, ack after commit).

Both read entries written by :class:`framework.Client` (``send_many``, 1,000 keys). A trial:

1. starts the workers on an empty queue and waits until each one is a consumer of its group, then
   drains :data:`WARMUP` messages (not measured: connections opened, statements prepared and
   compiled, as in a service that has been running), waits half a second, and takes their CPU
   time (``utime + stime`` of ``/proc/PID/stat``);
2. **drain**: fills the queue with N messages (5,000 per ``send_many``; the workers start on them
   at once, so the fill overlaps the first fraction of a second) and polls the effects table every
   50 ms until it holds N rows: ``msgs_per_s = N / (last row seen - fill start)``;
   ``cpu_ms_per_msg`` = the workers' CPU time over the drain / N (client CPU only: not
   PostgreSQL's, not the broker's);
3. **latency** (optional): sends messages one by one at a fixed rate (scheduled on a monotonic
   clock) for some seconds, each stamped with ``time.time_ns()`` when handed to the client; the
   consumer pushes ``commit time - publish time`` right after its commit. p50/p90/p99/max in ms;
   they include the 2 ms of work (a batch consumer's later messages also wait for earlier ones' work);
4. checks the table holds every message exactly once and the queue is empty (all acknowledged).

The database is ``$DATABASE_URL``'s server if set (a scratch database is created there and
dropped), else an embedded PostgreSQL started for the run (:func:`database`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import psycopg
import redis

from benchmarks.machine import process_cpu_s
from benchmarks.procs import Child, child
from benchmarks.sql_services import (
    EFFECTS_TABLE,
    GROUP,
    PLAIN_INBOX_TABLE,
    SQL_QUEUE,
    SqlMessage,
    ddl,
    latency_key,
    stream_key,
)
from benchmarks.streams import percentile
from framework import Client
from framework.testing import delete_namespace, unique_namespace

__all__ = [
    "KINDS",
    "Progress",
    "count_rows",
    "database",
    "db_tools",
    "drain_trial",
    "fill",
    "start_workers",
    "truncate",
    "wait_ready",
]

KINDS = ("framework", "plain")
FRAMEWORK_MODES = {  # more framework kinds, run by name: (extra `run` options, inbox, service in sql_services)
    "framework-sqlinbox": ((), "sql", "service"),  # Service(inbox="sql"): no Redis inbox, the SQL inbox alone
    "framework-n1": (("--group-commit-size", "1"), "redis", "service"),  # one transaction per message
    "framework-batch": ((), "redis", "batch_service"),  # the batch handler: a transaction per batch
    "framework-batch-sqlinbox": ((), "sql", "batch_service"),  # the same with the SQL inbox alone
}
KEYS = 1000
FILL_BATCH = 5000
Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


# -- database -----------------------------------------------------------------------------------------------


def db_tools() -> tuple[Callable[[], Any], Callable[..., Any]]:
    """``(embedded_postgres, temporary_database)``: from ``framework.testing`` if there, else ``framework.sql``."""
    try:
        from framework.testing import embedded_postgres, temporary_database  # type: ignore[attr-defined]
    except ImportError:
        from framework.sql import embedded_postgres, temporary_database
    return embedded_postgres, temporary_database


async def _framework_tables(url: str) -> None:
    from framework import outbox

    engine = outbox.create_engine(url)
    try:
        await outbox.create_tables(engine)  # framework_inbox among them
    finally:
        await engine.dispose()


@contextlib.contextmanager
def database(database_url: str | None = None, prefix: str = "sql_bench") -> Iterator[str]:
    """A scratch database with the framework's tables and the benchmark's; yields its URL, drops it after.

    On ``database_url``'s server (``$DATABASE_URL`` if None and set), else on an embedded PostgreSQL.
    """
    embedded_postgres, temporary_database = db_tools()
    server_url = database_url or os.environ.get("DATABASE_URL") or None
    with contextlib.ExitStack() as stack:
        server = server_url or stack.enter_context(embedded_postgres())
        scratch: str = stack.enter_context(temporary_database(server, prefix=prefix))
        anyio.run(_framework_tables, scratch)
        with psycopg.connect(scratch, autocommit=True) as conn:
            for statement in ddl():
                conn.execute(statement)
        yield scratch


def truncate(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {EFFECTS_TABLE}, {PLAIN_INBOX_TABLE}, framework_inbox")


def count_rows(conn: psycopg.Connection[Any]) -> int:
    """Rows in the effects table (``conn`` in autocommit)."""
    row = conn.execute(f"SELECT count(*) FROM {EFFECTS_TABLE}").fetchone()
    return int(row[0]) if row else 0


# -- processes ----------------------------------------------------------------------------------------------


def worker_args(
    kind: str, url: str, db_url: str, namespace: str, consumer: str, work_ms: float = 2.0
) -> tuple[list[str], dict[str, str]]:
    """The command line (after ``python``) and environment of one worker of ``kind`` (``work_ms`` per message)."""
    env = {"BENCH_DATABASE_URL": db_url, "BENCH_NAMESPACE": namespace, "BENCH_WORK_MS": f"{work_ms:g}"}
    if kind == "framework" or kind in FRAMEWORK_MODES:
        extra, inbox, target = FRAMEWORK_MODES.get(kind, ((), "redis", "service"))
        args = ["-m", "framework", "run", f"benchmarks.sql_services:{target}", "--redis-url", url]
        args += ["--namespace", namespace, "--consumer", consumer, "--log-format", "json", "--log-level", "warning"]
        args += list(extra)
        env["BENCH_INBOX"] = inbox
    elif kind == "plain":
        args = ["-m", "benchmarks.plain_sql_consumer", "--redis-url", url, "--database-url", db_url]
        args += ["--namespace", namespace, "--consumer", consumer]
    else:
        raise ValueError(f"unknown consumer kind {kind!r}: one of {KINDS + tuple(FRAMEWORK_MODES)}")
    return args, env


@contextlib.contextmanager
def start_workers(
    kind: str, count: int, url: str, db_url: str, namespace: str, prefix: str = "w", work_ms: float = 2.0
) -> Iterator[list[Child]]:
    """Run ``count`` worker processes of ``kind`` (consumers ``<prefix>0``...) for the block; stop them after."""
    with contextlib.ExitStack() as stack:
        workers = []
        for i in range(count):
            args, env = worker_args(kind, url, db_url, namespace, f"{prefix}{i}", work_ms)
            workers.append(stack.enter_context(child(f"sql-{kind}-{prefix}{i}", args, env, grace=15.0)))
        yield workers


def group_name(kind: str) -> str:
    """The consumer group a kind of consumer reads with."""
    from benchmarks.plain_sql_consumer import PLAIN_GROUP

    return PLAIN_GROUP if kind == "plain" else GROUP


def wait_ready(
    client: redis.Redis, stream: str, group: str, names: set[str], workers: list[Child], timeout: float
) -> None:
    """Block until every consumer in ``names`` has read from ``group`` (it is then past its start-up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            rows = client.xinfo_consumers(stream, group)
            seen = {(r["name"].decode() if isinstance(r["name"], bytes) else r["name"]) for r in rows}
            if names <= seen:
                return
        except redis.ResponseError:
            pass  # no stream or group yet
        for w in workers:
            w.check()
        time.sleep(0.05)
    raise RuntimeError(f"consumers {sorted(names)} not ready after {timeout:.0f}s:\n{workers[0].log_tail()}")


# -- publishing ---------------------------------------------------------------------------------------------


async def fill(url: str, namespace: str, n: int, start: int = 0) -> float:
    """Send messages ``start .. start+n-1`` with ``Client.send_many``; return the fill rate (msg/s)."""
    async with Client(url, namespace=namespace) as client:
        began = time.perf_counter()
        for first in range(start, start + n, FILL_BATCH):
            batch = [SqlMessage(i, time.time_ns()) for i in range(first, min(first + FILL_BATCH, start + n))]
            await client.send_many(SQL_QUEUE, batch, key=lambda m: str(m.seq % KEYS))
        return n / (time.perf_counter() - began)


async def _paced(url: str, namespace: str, rate: float, count: int, start: int) -> float:
    """Send ``count`` recorded messages one by one at ``rate``/s on a monotonic schedule; return the achieved rate."""
    async with Client(url, namespace=namespace) as client:
        await client.send_many(SQL_QUEUE, [])  # connect and declare before the clock starts
        began = time.monotonic()
        for i in range(count):
            due = began + i / rate
            if (wait := due - time.monotonic()) > 0:
                await anyio.sleep(wait)
            seq = start + i
            await client.send(SQL_QUEUE, SqlMessage(seq, time.time_ns(), record=True), key=str(seq % KEYS))
        return count / (time.monotonic() - began)


def _wait_rows(
    conn: psycopg.Connection[Any], target: int, workers: list[Child], timeout: float, label: str, progress: Progress
) -> float:
    """Poll the effects table every 50 ms until it holds ``target`` rows; return when it was seen (perf_counter)."""
    deadline = time.monotonic() + timeout
    last_report = time.monotonic()
    while True:
        rows = count_rows(conn)
        if rows >= target:
            return time.perf_counter()
        now = time.monotonic()
        if now > deadline:
            raise RuntimeError(f"{label}: {rows:,} of {target:,} rows after {timeout:.0f}s:\n{workers[0].log_tail()}")
        if now - last_report >= 10:
            last_report = now
            progress(f"{label}: {rows:,}/{target:,} rows")
        for w in workers:
            w.check()
        time.sleep(0.05)


WARMUP = 1_000
"""Messages drained before a trial's measurement starts (the same for both consumers)."""


def warm_up(url: str, namespace: str, done: Callable[[], bool], workers: list[Child], label: str) -> None:
    """Send :data:`WARMUP` messages (seq ``0 .. WARMUP-1``) and wait until ``done()``, then half a second."""
    anyio.run(fill, url, namespace, WARMUP)
    deadline = time.monotonic() + 120
    while not done():
        if time.monotonic() > deadline:
            tail = workers[0].log_tail()
            raise RuntimeError(f"{label}: the {WARMUP:,} warm-up messages not processed in 120 s:\n{tail}")
        for w in workers:
            w.check()
        time.sleep(0.05)
    time.sleep(0.5)


def drain_trial(
    url: str,
    db_url: str,
    kind: str,
    workers: int,
    n: int,
    *,
    latency_rate: float | None = None,
    latency_seconds: float = 10.0,
    work_ms: float = 2.0,
    progress: Progress = _quiet,
) -> dict[str, Any]:
    """One trial (see the module docstring): drain rate, client CPU per message, optional latency.

    ``work_ms``: the work per message of both kinds of consumer (``BENCH_WORK_MS``; 0: none).
    """
    namespace = unique_namespace("bench-sql")
    stream = stream_key(namespace)
    label = f"sql {kind} x{workers} {work_ms:g} ms"
    truncate(db_url)
    client = redis.Redis.from_url(url, protocol=2)
    try:
        with (
            psycopg.connect(db_url, autocommit=True) as db,
            start_workers(kind, workers, url, db_url, namespace, work_ms=work_ms) as procs_,
        ):
            names = {f"w{i}" for i in range(workers)}
            wait_ready(client, stream, group_name(kind), names, procs_, timeout=60)
            time.sleep(1.0)
            warm_up(url, namespace, lambda: count_rows(db) >= WARMUP, procs_, label)
            cpu0 = sum(process_cpu_s(w.pid) for w in procs_)
            began = time.perf_counter()
            fill_rate = anyio.run(fill, url, namespace, n, WARMUP)
            ended = _wait_rows(db, WARMUP + n, procs_, max(120.0, n / 20), label, progress)
            cpu1 = sum(process_cpu_s(w.pid) for w in procs_)
            seconds = ended - began
            result: dict[str, Any] = {
                "kind": kind,
                "workers": workers,
                "work_ms": work_ms,
                "n": n,
                "seconds": seconds,
                "msgs_per_s": n / seconds,
                "fill_msgs_per_s": fill_rate,
                "cpu_ms_per_msg": (cpu1 - cpu0) * 1000 / n,
            }
            progress(
                f"{label}: drained {n:,} at {result['msgs_per_s']:,.0f} msg/s, "
                f"{result['cpu_ms_per_msg']:.2f} ms CPU/msg"
            )
            total = WARMUP + n
            if latency_rate:
                m = max(1, int(latency_rate * latency_seconds))
                achieved = anyio.run(_paced, url, namespace, latency_rate, m, total)
                _wait_rows(db, total + m, procs_, 120.0, label, progress)
                deadline = time.monotonic() + 30
                while client.llen(latency_key(namespace)) < m and time.monotonic() < deadline:
                    time.sleep(0.05)
                samples = sorted(int(v.split(b":")[1]) / 1e6 for v in client.lrange(latency_key(namespace), 0, -1))
                if len(samples) < m:
                    raise RuntimeError(f"{label}: {len(samples)} latency samples of {m}")
                result.update(
                    {
                        "latency_n": m,
                        "achieved_rate": achieved,
                        "p50_ms": percentile(samples, 50),
                        "p90_ms": percentile(samples, 90),
                        "p99_ms": percentile(samples, 99),
                        "max_ms": samples[-1],
                    }
                )
                progress(
                    f"{label}: latency @ {latency_rate:g}/s p50 {result['p50_ms']:.1f} p99 {result['p99_ms']:.1f} ms"
                )
                total += m
            deadline = time.monotonic() + 30
            while client.xlen(stream) and time.monotonic() < deadline:
                time.sleep(0.05)
            left = client.xlen(stream)
            row = db.execute(f"SELECT count(*), count(DISTINCT seq) FROM {EFFECTS_TABLE}").fetchone()
            assert row is not None
            if row[0] != total or row[1] != total or left:
                raise RuntimeError(
                    f"{label}: {row[0]} rows, {row[1]} distinct, {left} entries unacknowledged; expected {total} once"
                )
        return result
    finally:
        client.close()
        delete_namespace(url, namespace)

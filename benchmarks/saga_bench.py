"""Sagas (#13): saga steps per second against plain handlers with the inbox on, one worker, same run.

    python -m benchmarks --only saga              (20,000 messages per kind; --quick: 5,000)
    python -m benchmarks.saga_bench URL [N] [--sql]  (a quick look without the runner)

Each kind drains a backlog of N messages (preloaded while no worker runs, then one
``python -m framework run`` worker with default settings) from 4-partition destinations:

* ``plain``: a command handler that does nothing (the inbox on: the issue's yardstick);
* ``plain_tx``: a command handler that keeps a counter per key with ``ctx.redis_transaction()``
  (exactly-once state without a saga: what a saga step does by hand, minus the load and the guard);
* ``saga_step``: messages sent straight to the saga's queue (key = correlation id, 1,000 saga
  instances): one step each = load the state, run, save it with the version guard in the commit;
* ``saga_new``: like ``saga_step``, but every message starts an instance of its own (N
  instances): no step finds its state kept by the worker, so each one's state is read (ahead,
  with its fetched batch) and written new; the path of sagas whose instances see few messages;
* ``saga_event``: events on a topic the saga subscribes to, so each is forwarded to the saga
  queue first (two handler runs per event: the routing hop, then the step);
* ``sql_tx`` (with a database): a command handler that keeps the counter per key in PostgreSQL
  inside ``ctx.sql_transaction`` (one upsert): exactly-once SQL state without a saga;
* ``saga_sql`` (with a database): the saga's steps with ``sql=``: its state in PostgreSQL (read
  ``FOR UPDATE``, saved with the version guard, in the step's ``ctx.sql_transaction``).

The SQL kinds run when :func:`run` is given a database (the runner: ``$DATABASE_URL``'s server,
else an embedded PostgreSQL); their yardstick is ``sql_tx`` (``saga_sql / sql_tx``).

Rate = N / (time from the worker's "runtime started" line to the last message settled). Kinds are interleaved per
round so background load hits them alike; the ratios are plain's rate over each kind's
(``saga_step / plain`` = how many plain handler runs one saga step costs; target < 2).
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

from benchmarks.procs import child
from framework import Client, Context, Queue, Service, Topic
from framework.saga import SAGA_INPUT, SagaContext
from framework.testing import delete_namespace, unique_namespace

__all__ = ["KINDS", "run", "trial"]

KINDS = ("plain", "plain_tx", "saga_step", "saga_new", "saga_event")
SQL_KINDS = ("sql_tx", "saga_sql")
SAGAS = 1000  # saga instances (correlation ids) the messages spread over
_BATCH = 5000

PLAIN = Queue("bench.plain", partitions=4)
PLAIN_TX = Queue("bench.plain_tx", partitions=4)
EVENTS = Topic("bench.saga.events", partitions=4)

plain = Service("bplain")


@plain.command(PLAIN)
async def nothing(cmd: dict[str, Any], ctx: Context) -> None:
    """The yardstick: a handler with the inbox on and no effects."""


plain_tx = Service("bplaintx")


@plain_tx.command(PLAIN_TX)
async def count(cmd: dict[str, Any], ctx: Context) -> None:
    """A counter per key, exactly once with the inbox mark (what a saga step does by hand)."""
    ctx.redis_transaction().hincrby(f"{ctx.hash_tag}:bench:counts", cmd["k"], 1)


sagas = Service("bsaga")
counter = sagas.saga("counter", state=dict)


@counter.event(EVENTS, correlate=lambda e: e["k"])
async def step(event: dict[str, Any], ctx: SagaContext[dict[str, Any]]) -> None:
    """Count the instance's messages (the state is loaded, changed and saved each step)."""
    ctx.state["n"] = ctx.state.get("n", 0) + 1


SQL_TX = Queue("bench.sql_tx", partitions=4)
_UPSERT = (
    "INSERT INTO bench_saga_counts (k, n) VALUES (:k, 1) ON CONFLICT (k) DO UPDATE SET n = bench_saga_counts.n + 1"
)


def _engine() -> Any:
    from framework import outbox

    return outbox.create_engine(os.environ["BENCH_DATABASE_URL"])


sql_tx = Service("bsqltx")
_sql_engine: Any = None


@sql_tx.command(SQL_TX)
async def count_sql(cmd: dict[str, Any], ctx: Context) -> None:
    """A counter per key in PostgreSQL, exactly once with the SQL inbox row (the SQL yardstick)."""
    global _sql_engine
    if _sql_engine is None:
        _sql_engine = _engine()
    from sqlalchemy import text

    async with ctx.sql_transaction(_sql_engine) as conn:
        await conn.execute(text(_UPSERT), {"k": cmd["k"]})


sql_sagas = Service("bsagasql")
sql_counter = sql_sagas.saga("counter", state=dict, sql=_engine)


@sql_counter.command(Queue("bench.saga.sql.inputs"), correlate=lambda c: c["k"])
async def sql_step(cmd: dict[str, Any], ctx: SagaContext[dict[str, Any]]) -> None:
    """Count the instance's messages, the state in PostgreSQL."""
    ctx.state["n"] = ctx.state.get("n", 0) + 1


_TARGETS = {
    "plain": "benchmarks.saga_bench:plain",
    "plain_tx": "benchmarks.saga_bench:plain_tx",
    "saga_step": "benchmarks.saga_bench:sagas",
    "saga_new": "benchmarks.saga_bench:sagas",
    "saga_event": "benchmarks.saga_bench:sagas",
    "sql_tx": "benchmarks.saga_bench:sql_tx",
    "saga_sql": "benchmarks.saga_bench:sql_sagas",
}


async def _preload(url: str, namespace: str, kind: str, n: int) -> None:
    async with Client(url, namespace=namespace) as client:
        for start in range(0, n, _BATCH):
            async with client.batch() as batch:
                for i in range(start, min(start + _BATCH, n)):
                    k = f"s{i % SAGAS}"
                    if kind == "plain":
                        batch.send(PLAIN, {"k": k}, key=k)
                    elif kind == "plain_tx":
                        batch.send(PLAIN_TX, {"k": k}, key=k)
                    elif kind == "saga_step":
                        batch.send(counter.queue, {"k": k}, key=k, headers={SAGA_INPUT: EVENTS.name})
                    elif kind == "saga_new":
                        batch.send(counter.queue, {"k": f"n{i}"}, key=f"n{i}", headers={SAGA_INPUT: EVENTS.name})
                    elif kind == "sql_tx":
                        batch.send(SQL_TX, {"k": k}, key=k)
                    elif kind == "saga_sql":
                        batch.send(sql_counter.queue, {"k": k}, key=k, headers={SAGA_INPUT: "bench.saga.sql.inputs"})
                    else:
                        batch.publish(EVENTS, {"k": k}, key=k)


def _remaining(r: redis.Redis, namespace: str, kind: str, n: int) -> int:
    """Messages not yet settled (queues delete acked entries; the topic counts its group's lag)."""
    pipe = r.pipeline(transaction=False)
    queue = {"plain": PLAIN, "plain_tx": PLAIN_TX, "sql_tx": SQL_TX, "saga_sql": sql_counter.queue}.get(
        kind, counter.queue
    )
    for p in range(queue.partitions):
        pipe.xlen(f"{namespace}:{{{queue.name}:{p}}}")
    left = sum(pipe.execute())
    if kind == "saga_event":
        for p in range(EVENTS.partitions):
            groups = []
            with contextlib.suppress(redis.ResponseError):
                groups = r.xinfo_groups(f"{namespace}:{{{EVENTS.name}:{p}}}")
            if not groups:
                return left + n  # the worker has not subscribed yet
            for g in groups:
                left += int(g.get("lag") or 0) + int(g.get("pending") or 0)
    return left


def _drain(url: str, kind: str, n: int, db_url: str | None = None) -> float:
    """Preload ``n`` messages of ``kind``, start a worker, return messages settled per second."""
    namespace = unique_namespace(f"bench-saga-{kind.replace('_', '')}")
    r = redis.Redis.from_url(url)
    args = ["-m", "framework", "run", _TARGETS[kind], "--redis-url", url]
    args += ["--namespace", namespace, "--log-format", "json", "--consumer", "w"]
    try:
        anyio.run(functools.partial(_preload, url, namespace, kind, n))
        env = {"BENCH_DATABASE_URL": db_url} if db_url else {}
        with child(f"saga-{kind}", args, env) as worker:
            deadline = time.monotonic() + 60
            while b"runtime started" not in worker.log_path.read_bytes():
                worker.check()
                if time.monotonic() > deadline:
                    raise RuntimeError("saga benchmark: the worker did not start within 60 s")
                time.sleep(0.002)
            started = time.perf_counter()
            deadline = time.monotonic() + 300
            while (left := _remaining(r, namespace, kind, n)) > 0:
                worker.check()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"saga benchmark: {left} of {n} {kind} messages left after 300 s")
                time.sleep(0.005)
            return n / (time.perf_counter() - started)
    finally:
        r.close()
        delete_namespace(url, namespace)


def trial(url: str, n: int, db_url: str | None = None) -> dict[str, float]:
    """One round: every kind once, interleaved; messages per second of each."""
    out = {kind: _drain(url, kind, n) for kind in KINDS}
    if db_url is not None:
        for kind in SQL_KINDS:
            _truncate(db_url)
            out[kind] = _drain(url, kind, n, db_url)
    return out


def _truncate(db_url: str) -> None:
    import psycopg

    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS bench_saga_counts (k text PRIMARY KEY, n bigint NOT NULL)")
        conn.execute("TRUNCATE bench_saga_counts, framework_saga_state, framework_inbox")


def run(url: str, *, messages: int = 20_000, repeats: int = 1, sql: bool = False) -> dict[str, Any]:
    """``repeats`` rounds; medians per kind and the cost of each kind in plain handler runs.

    ``sql``: also the SQL kinds, on a scratch database (``$DATABASE_URL``'s server, else embedded)."""
    with contextlib.ExitStack() as stack:
        db_url = None
        if sql:
            from benchmarks import sql_bench

            db_url = stack.enter_context(sql_bench.database(prefix="saga_bench"))
        trials = [trial(url, messages, db_url) for _ in range(repeats)]
    kinds = [*KINDS, *(SQL_KINDS if sql else ())]
    medians = {k: statistics.median(t[k] for t in trials) for k in kinds}
    cost = {k: medians["plain"] / medians[k] for k in KINDS if k != "plain"}
    if sql:
        cost["saga_sql"] = medians["sql_tx"] / medians["saga_sql"]  # (its yardstick: the SQL handler)
    return {
        "messages": messages,
        "sagas": SAGAS,
        "cores": os.cpu_count(),
        "trials": trials,
        "medians": medians,
        # cost of one message of each kind, in plain handler runs (plain rate over its rate)
        "cost": cost,
    }


if __name__ == "__main__":  # a quick look without the benchmark runner
    import sys

    import orjson

    n = int(sys.argv[2]) if len(sys.argv) > 2 else 10_000
    with contextlib.suppress(KeyboardInterrupt):
        print(orjson.dumps(run(sys.argv[1], messages=n, sql="--sql" in sys.argv)).decode())

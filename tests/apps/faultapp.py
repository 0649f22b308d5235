"""Services run as real worker processes by the fault tests.

Each handler records what it did in Redis under the test's namespace, so the test can count
lost and duplicated messages after killing workers.
"""

from __future__ import annotations

import os
import time

import redis

from framework import Context, Queue, RetryPolicy, Service, Topic

NS = os.environ.get("FRAMEWORK_NAMESPACE", "fw")
_redis = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
SLEEP = float(os.environ.get("JOB_SLEEP", "0.001"))

worker = Service("worker", retry=RetryPolicy(max_attempts=3, immediate=0, backoff=0.05))


@worker.command(Queue("jobs", partitions=2))
def job(cmd: dict, ctx: Context) -> None:
    """Records each processing of a job; a job named 'crash' kills its process every time."""
    if cmd["n"] == "crash":
        _redis.hincrby(f"{NS}:test:crashes", "crash", 1)
        os._exit(17)
    time.sleep(SLEEP)
    _redis.hincrby(f"{NS}:test:done", cmd["n"], 1)


auditor = Service("auditor")


@auditor.event(Topic("ledger", partitions=2))
def audit(event: dict, ctx: Context) -> None:
    """Records each event per key, in the order it ran."""
    time.sleep(SLEEP)
    _redis.rpush(f"{NS}:test:order:{ctx.key}", event["seq"])


poison = Service("poison", retry=RetryPolicy(max_attempts=5, fatal=(ValueError,)))


@poison.command("poison.jobs")
def reject(cmd: dict) -> None:
    """Every message is rejected with a fatal error: each goes straight to the DLQ."""
    time.sleep(SLEEP)
    raise ValueError(f"rejected {cmd['n']}")


wallet = Service("wallet")


@wallet.command(Queue("wallet.credit", partitions=2))
async def credit(cmd: dict, ctx: Context) -> None:
    """Credits an account exactly once: the write commits with the inbox mark and the ack."""
    if SLEEP:
        import anyio

        await anyio.sleep(SLEEP)
    tx = ctx.redis_transaction()
    tx.hincrby(f"{NS}:test:balance", cmd["account"], cmd["amount"])
    tx.hincrby(f"{NS}:test:applied", cmd["n"], 1)


counter = Service("counter")
_engine = None


def _db():  # type: ignore[no-untyped-def]
    global _engine
    if _engine is None:
        from framework.sql import create_engine

        _engine = create_engine(os.environ["DATABASE_URL"], pool_size=16)
    return _engine


@counter.command(Queue("counter.increment", partitions=2))
async def increment(cmd: dict, ctx: Context) -> None:
    """Adds one to a PostgreSQL counter, exactly once per command, however often it is delivered."""
    import anyio
    from sqlalchemy import text

    async with ctx.sql_transaction(_db()) as conn:
        await conn.execute(text("INSERT INTO applied (n) VALUES (:n)"), {"n": cmd["n"]})
        if SLEEP:
            await anyio.sleep(SLEEP)  # a window for kills to land inside the transaction
        ctx.publish("counter.incremented", {"n": cmd["n"]})  # goes to the outbox table, same transaction
        # last: the one hot row stays locked only briefly
        await conn.execute(text("UPDATE counters SET value = value + 1 WHERE name = 'total'"))

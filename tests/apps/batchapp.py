"""A batch handler run as real worker processes by the batch fault test (tests/test_batch_sql.py).

Each batch adds its postings to PostgreSQL in one ``ctx.sql_transaction``: a row per posting, the
counter, an outgoing event per posting (to the outbox table) and every posting's inbox row.
"""

from __future__ import annotations

import os
from typing import Any

from framework import BatchContext, BatchPolicy, Queue, RetryPolicy, Service

SLEEP = float(os.environ.get("BATCH_SLEEP", "0"))

ledger = Service("ledger", inbox="sql")
_engine: Any = None


def _db() -> Any:
    global _engine
    if _engine is None:
        from framework.sql import create_engine

        _engine = create_engine(os.environ["DATABASE_URL"])
    return _engine


@ledger.command(Queue("ledger.post", partitions=2), batch=BatchPolicy(max_size=50, max_wait=0.01))
async def post(items: list[dict], ctx: BatchContext) -> None:
    """Applies a batch of postings exactly once, however often its messages are delivered."""
    import anyio
    from sqlalchemy import text

    async with ctx.sql_transaction(_db()) as conn:
        await conn.execute(text("INSERT INTO applied (n) VALUES (:n)"), [{"n": item["n"]} for item in items])
        for i, item in enumerate(items):
            ctx[i].publish("ledger.posted", {"n": item["n"]})
        if SLEEP:
            await anyio.sleep(SLEEP)  # a window for kills to land inside the transaction
        await conn.execute(text("UPDATE counters SET value = value + :k WHERE name = 'total'"), {"k": len(items)})


crashy = Service("crashy", retry=RetryPolicy(max_attempts=3, immediate=0, backoff=0.05))


@crashy.command(Queue("crashy.jobs"), batch=BatchPolicy(max_size=50, max_wait=0.05))
def jobs(items: list[dict]) -> None:
    """Records each job of the batch; a batch holding the job named 'crash' kills its process first."""
    import redis

    r = redis.Redis.from_url(os.environ["REDIS_URL"])
    ns = os.environ["FRAMEWORK_NAMESPACE"]
    if any(item["n"] == "crash" for item in items):
        r.hincrby(f"{ns}:test:crashes", "crash", 1)
        os._exit(17)
    for item in items:
        r.hincrby(f"{ns}:test:done", item["n"], 1)
    r.close()

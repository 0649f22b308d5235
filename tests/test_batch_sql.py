"""A batch handler's SQL effects commit in one transaction with the inbox rows of every message of the batch.

PostgreSQL (embedded, or ``$DATABASE_URL``'s server) and the embedded Valkey; the SIGKILL test
runs real worker processes (tests/apps/batchapp.py).
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Set
from pathlib import Path

import anyio
import pytest
import redis
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from framework import BatchContext, BatchFailed, BatchPolicy, Queue, RetryPolicy, Service, SyncClient, outbox
from framework.testing import ServiceHarness
from tests.workers import Workers, wait_for

pytestmark = pytest.mark.postgres

SCHEMA = [
    "CREATE TABLE counters (name text PRIMARY KEY, value bigint NOT NULL)",
    "INSERT INTO counters VALUES ('total', 0)",
    "CREATE TABLE applied (n text NOT NULL)",
]
QUICK = RetryPolicy(max_attempts=2, immediate=1, backoff=0.01, jitter=False)


async def _prepare(url: str) -> None:
    engine = outbox.create_engine(url)
    await outbox.create_tables(engine)
    async with engine.begin() as conn:
        for statement in SCHEMA:
            await conn.execute(text(statement))
    await engine.dispose()


async def _counts(url: str, group: str = "ledger") -> tuple[int, int, int, int, int]:
    """(counter, applied rows, distinct applied rows, outbox rows, inbox rows of ``group``)."""
    engine = outbox.create_engine(url)
    async with engine.connect() as conn:
        total = (await conn.execute(text("SELECT value FROM counters WHERE name = 'total'"))).scalar_one()
        rows = (await conn.execute(text("SELECT count(*), count(DISTINCT n) FROM applied"))).one()
        staged = (
            await conn.execute(
                text("SELECT (SELECT count(*) FROM framework_outbox) + (SELECT count(*) FROM framework_outbox_sent)")
            )
        ).scalar_one()
        inbox = (
            await conn.execute(text("SELECT count(*) FROM framework_inbox WHERE group_name = :g"), {"g": group})
        ).scalar_one()
    await engine.dispose()
    return int(total), int(rows[0]), int(rows[1]), int(staged), int(inbox)


async def _apply(conn: AsyncConnection, ctx: BatchContext, items: list[dict], skip: Set[int] = frozenset()) -> None:
    """Each item's row and outgoing event (unless skipped), and the counter, in the batch's transaction."""
    applied = [(i, item) for i, item in enumerate(items) if i not in skip]
    for i, item in applied:
        await conn.execute(text("INSERT INTO applied (n) VALUES (:n)"), {"n": item["n"]})
        ctx[i].publish("ledger.posted", {"n": item["n"]})
    await conn.execute(text("UPDATE counters SET value = value + :k WHERE name = 'total'"), {"k": len(applied)})


@pytest.mark.anyio
async def test_a_batch_commits_its_effects_with_every_inbox_row_and_a_redelivered_batch_applies_nothing_twice(
    pg_url: str, redis_url: str, namespace: str
) -> None:
    await _prepare(pg_url)
    engine = outbox.create_engine(pg_url)
    runs: list[int] = []
    svc = Service("ledger", retry=RetryPolicy(max_attempts=3, immediate=2), inbox="sql")

    @svc.command("ledger.post", batch=BatchPolicy(max_size=10, max_wait=0.2))
    async def post(items: list[dict], ctx: BatchContext) -> None:
        runs.append(len(items))
        async with ctx.sql_transaction(engine) as conn:
            await _apply(conn, ctx, items)
            if len(runs) == 1:
                raise RuntimeError("rolled back: every row, every inbox row, every outbox row")
        if len(runs) == 2:
            raise RuntimeError("after the commit: the batch is retried and must find every message processed")

    try:
        async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
            for n in range(10):
                await h.client.send("ledger.post", {"n": str(n)}, message_id=f"m-{n}")
            await h.run_until_idle()
            for n in (3, 7):  # re-published copies, later: a batch of their own
                await h.client.send("ledger.post", {"n": str(n)}, message_id=f"m-{n}")
            await h.run_until_idle()
            stats = h.stats()["ledger.post"]
    finally:
        await engine.dispose()
    assert await _counts(pg_url) == (10, 10, 10, 10, 10)
    assert runs == [10, 10, 10, 2]  # rolled back; committed, then failed; found processed; the copies
    assert stats["duplicates"] == 12 and stats["processed"] == 0 and stats["failed"] == 20


@pytest.mark.anyio
async def test_batch_failed_inside_the_block_commits_the_others_and_dead_letters_the_poison_message(
    pg_url: str, redis_url: str, namespace: str
) -> None:
    await _prepare(pg_url)
    engine = outbox.create_engine(pg_url)
    svc = Service("ledger", retry=QUICK, inbox="sql")

    @svc.command("ledger.post", batch=BatchPolicy(max_size=5, max_wait=0.2))
    async def post(items: list[dict], ctx: BatchContext) -> None:
        poison = {i for i, item in enumerate(items) if item["n"] == "2"}
        async with ctx.sql_transaction(engine) as conn:
            await _apply(conn, ctx, items, skip=poison)
            if poison:
                raise BatchFailed({i: ValueError(f"posting {items[i]['n']} is poison") for i in poison})

    try:
        async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
            await h.client.send_many("ledger.post", [{"n": str(n)} for n in range(5)])
            await h.run_until_idle()
            [dead] = await h.dead_letters()
    finally:
        await engine.dispose()
    assert await _counts(pg_url) == (4, 4, 4, 4, 4)  # the poison message's inbox row and outbox row are not kept
    assert json.loads(dead.body) == {"n": "2"} and dead.error_message == "posting 2 is poison"


@pytest.mark.fault
@pytest.mark.slow
def test_workers_killed_mid_batch_lose_nothing_and_apply_nothing_twice(
    worker_env: dict[str, str], tmp_path: Path, pg_url: str, redis_url: str, namespace: str
) -> None:
    """Batch workers SIGKILLed (often inside their batch's SQL transaction) three times over; a last
    worker drains. Every posting lands exactly once: its row, the counter, its outbox row."""
    total = 3000
    anyio.run(_prepare, pg_url)
    queue = Queue("ledger.post", partitions=2)
    with SyncClient(redis_url, namespace=namespace) as client:
        for i in range(0, total, 1000):
            client.send_many(queue, [{"n": str(n)} for n in range(i, i + 1000)])
    r = redis.Redis.from_url(redis_url)
    streams = [f"{namespace}:{{ledger.post:{p}}}" for p in (0, 1)]
    workers = Workers({**worker_env, "DATABASE_URL": pg_url}, tmp_path)
    opts = ("--visibility-timeout", "1", "--concurrency", "8")
    try:
        for round_ in range(3):
            before = sum(r.xlen(s) for s in streams)
            procs = [workers.start("batchapp:ledger", f"w{round_}{x}", *opts, BATCH_SLEEP="0.02") for x in "ab"]
            wait_for(
                lambda before=before: sum(r.xlen(s) for s in streams) < before - 400,
                120,
                "progress",
            )
            time.sleep(0.1)
            for p in procs:
                p.send_signal(signal.SIGKILL)
                p.wait()
        last = workers.start("batchapp:ledger", "last", *opts, BATCH_SLEEP="0")
        wait_for(lambda: sum(r.xlen(s) for s in streams) == 0, 300, "every posting")
        last.send_signal(signal.SIGTERM)
        assert last.wait(timeout=60) == 0
    finally:
        workers.stop_all()
        r.close()
    assert anyio.run(_counts, pg_url) == (total, total, total, total, total)


@pytest.mark.anyio
async def test_the_batch_claim_records_new_ids_and_reports_the_ones_recorded_before(pg_url: str) -> None:
    """One statement for any batch size: ids of any text (quotes, commas, braces) are recorded once,
    and a later claim returns only the ids it recorded now (the others are the batch's duplicates)."""
    from framework.batch_context import _claim

    await _prepare(pg_url)
    first = ["m-1", "it's", 'a,b "c" {d}', "m-1"]
    later = ["m-2", "it's", *[f"bulk-{i}" for i in range(300)]]
    engine = outbox.create_engine(pg_url)
    try:
        async with engine.begin() as conn:
            assert await _claim(conn, "ledger", first) == set(first)
        async with engine.begin() as conn:
            assert await _claim(conn, "ledger", later) == set(later) - {"it's"}
    finally:
        await engine.dispose()
    assert (await _counts(pg_url))[4] == 3 + 301

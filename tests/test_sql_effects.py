"""Exactly-once SQL effects: the inbox row, the business rows and the outbox rows commit together."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import anyio
import pytest
import redis
from sqlalchemy import text

from framework import Context, Queue, RetryPolicy, Service, SyncClient, outbox
from framework.testing import ServiceHarness
from tests.workers import Workers, wait_for

pytestmark = pytest.mark.postgres

SCHEMA = [
    "CREATE TABLE counters (name text PRIMARY KEY, value bigint NOT NULL)",
    "INSERT INTO counters VALUES ('total', 0)",
    "CREATE TABLE applied (n text NOT NULL)",
]


async def _prepare(url: str) -> None:
    engine = outbox.create_engine(url)
    async with engine.connect() as conn:  # the kills hit workers, never PostgreSQL: skip the fsync per commit
        db = (await conn.execute(text("SELECT current_database()"))).scalar_one()
        await conn.execute(text(f'ALTER DATABASE "{db}" SET synchronous_commit = off'))
        await conn.commit()
    await engine.dispose()
    engine = outbox.create_engine(url)
    await outbox.create_tables(engine)
    async with engine.begin() as conn:
        for statement in SCHEMA:
            await conn.execute(text(statement))
    await engine.dispose()


async def _counts(url: str) -> tuple[int, int, int, int]:
    engine = outbox.create_engine(url)
    async with engine.connect() as conn:
        total = (await conn.execute(text("SELECT value FROM counters WHERE name = 'total'"))).scalar_one()
        rows = (await conn.execute(text("SELECT count(*), count(DISTINCT n) FROM applied"))).one()
        staged = (
            await conn.execute(
                text(  # waiting rows, and those a relay already moved to the sent table
                    "SELECT (SELECT count(*) FROM framework_outbox) + (SELECT count(*) FROM framework_outbox_sent)"
                )
            )
        ).scalar_one()
    await engine.dispose()
    return int(total), int(rows[0]), int(rows[1]), int(staged)


def _load_increments(pg_url: str, redis_url: str, namespace: str, total: int) -> tuple[redis.Redis, list[str]]:
    """Fresh tables, ``total`` increment commands queued; a client and the queue's partition streams."""
    anyio.run(_prepare, pg_url)
    queue = Queue("counter.increment", partitions=2)
    with SyncClient(redis_url, namespace=namespace) as client:
        for i in range(0, total, 1000):
            client.send_many(queue, [{"n": str(n)} for n in range(i, i + 1000)])
    return redis.Redis.from_url(redis_url), [f"{namespace}:{{counter.increment:{p}}}" for p in (0, 1)]


def _assert_each_once(pg_url: str, total: int) -> None:
    """Every command's effects exactly once: the counter, its rows, its outgoing message in the outbox table."""
    value, rows, distinct, staged = anyio.run(_counts, pg_url)
    assert value == total, f"counter is {value}, expected {total}"
    assert rows == distinct == total
    assert staged == total


@pytest.mark.anyio
async def test_duplicates_and_failures_leave_sql_effects_applied_once(
    pg_url: str, redis_url: str, namespace: str
) -> None:
    await _prepare(pg_url)
    engine = outbox.create_engine(pg_url)
    failures = 0
    svc = Service("counter", retry=RetryPolicy(max_attempts=3, immediate=1), inbox=False)  # SQL inbox only

    @svc.command("counter.increment")
    async def increment(cmd: dict, ctx: Context) -> None:
        nonlocal failures
        async with ctx.sql_transaction(engine) as conn:
            await conn.execute(text("UPDATE counters SET value = value + 1 WHERE name = 'total'"))
            await conn.execute(text("INSERT INTO applied (n) VALUES (:n)"), {"n": cmd["n"]})
            ctx.publish("counter.incremented", {"n": cmd["n"]})
            if cmd["n"] == "3" and failures == 0:
                failures += 1
                raise RuntimeError("rolled back: the update, the inbox row and the outbox row")

    try:
        async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
            for n in range(5):
                await h.client.send("counter.increment", {"n": str(n)}, message_id=f"m-{n}")
            await h.client.send("counter.increment", {"n": "1"}, message_id="m-1")  # a re-published copy
            await h.run_until_idle()
            stats = h.stats()["counter.increment"]
    finally:
        await engine.dispose()
    assert await _counts(pg_url) == (5, 5, 5, 5)
    assert stats["duplicates"] == 1 and stats["failed"] == 1


@pytest.mark.fault
@pytest.mark.slow
def test_ten_thousand_increments_under_repeated_worker_kills_count_exactly_ten_thousand(
    worker_env: dict[str, str], tmp_path: Path, pg_url: str, redis_url: str, namespace: str
) -> None:
    kills = run_counter_under_kills(
        {**worker_env, "DATABASE_URL": pg_url},
        tmp_path,
        pg_url,
        redis_url,
        namespace,
        total=10_000,
        rounds=5,
        step=1200,
    )
    assert kills == 10


@pytest.mark.fault
@pytest.mark.slow
def test_a_worker_paused_past_its_lease_inside_its_transactions_applies_nothing_twice(
    worker_env: dict[str, str], tmp_path: Path, pg_url: str, redis_url: str, namespace: str
) -> None:
    """A worker SIGSTOPped with SQL transactions open (rows written, often the hot row locked) stays
    stopped past its lease: the other worker takes its partition and runs its messages again (those
    runs wait on the locks the stopped one holds). Resumed, the stopped worker finds its lease gone
    (run out on its own clock, or taken over) and drops its in-flight work: its open transactions roll back and free
    the locks (had one committed first, the other run's commit would find the message's inbox row
    and roll back; its acks are refused by the fencing check). Nothing waits for ever, every
    increment lands exactly once and its outgoing message is staged once."""
    total = 3000
    r, streams = _load_increments(pg_url, redis_url, namespace, total)
    env = {**worker_env, "DATABASE_URL": pg_url}
    workers = Workers(env, tmp_path)
    opts = ("--lease-ttl", "2", "--prefetch", "100", "--concurrency", "16")
    try:
        a = workers.start("faultapp:counter", "a", *opts, JOB_SLEEP="0.01")
        wait_for(lambda: "acquired partitions" in workers.log("a"), 60, "worker a owning the partitions")
        b = workers.start("faultapp:counter", "b", *opts, JOB_SLEEP="0.01")
        wait_for(lambda: "acquired partitions" in workers.log("b"), 60, "worker b owning a partition")
        wait_for(lambda: sum(r.xlen(s) for s in streams) < total - 300, 60, "progress")
        a.send_signal(signal.SIGSTOP)  # 16 lanes, 10 ms inside each transaction: some are open now
        time.sleep(6)  # three lease lengths: b owns both partitions and has claimed a's messages
        a.send_signal(signal.SIGCONT)
        wait_for(lambda: sum(r.xlen(s) for s in streams) == 0, 300, "every command")
        wait_for(lambda: "lost ownership of a partition" in workers.log("a"), 30, "a told it lost its partition")
        for p in (a, b):
            p.send_signal(signal.SIGTERM)
            assert p.wait(timeout=60) == 0
    finally:
        workers.stop_all()
        r.close()
    _assert_each_once(pg_url, total)


def run_counter_under_kills(
    env: dict[str, str],
    tmp_path: Path,
    pg_url: str,
    redis_url: str,
    namespace: str,
    *,
    total: int,
    rounds: int,
    step: int,
    pause: float = 0.2,
    extra: tuple[str, ...] = (),
) -> int:
    """Send ``total`` increments; ``rounds`` times start two counter workers and SIGKILL both once
    they made ``step`` progress; a last worker drains. Asserts every effect landed exactly once
    (counter, rows, outbox rows) and returns how many workers were killed."""
    r, streams = _load_increments(pg_url, redis_url, namespace, total)
    workers = Workers(env, tmp_path)
    opts = ("--visibility-timeout", "1", "--prefetch", "100", "--concurrency", "16", *extra)
    kills = 0
    try:
        for round_ in range(rounds):
            before = sum(r.xlen(s) for s in streams)
            procs = [workers.start("faultapp:counter", f"w{round_}{x}", *opts, JOB_SLEEP="0.002") for x in "ab"]
            wait_for(
                lambda before=before: (
                    sum(r.xlen(s) for s in streams) < before - step or sum(r.xlen(s) for s in streams) == 0
                ),
                120,
                "progress",
            )
            time.sleep(pause)
            for p in procs:
                p.send_signal(signal.SIGKILL)
                p.wait()
                kills += 1
        last = workers.start("faultapp:counter", "last", *opts, JOB_SLEEP="0")
        wait_for(lambda: sum(r.xlen(s) for s in streams) == 0, 300, "every command")
        last.send_signal(signal.SIGTERM)
        assert last.wait(timeout=60) == 0
    finally:
        workers.stop_all()
    _assert_each_once(pg_url, total)
    return kills


@pytest.mark.anyio
async def test_the_in_process_relay_publishes_what_handlers_staged_in_sql(
    pg_url: str, redis_url: str, namespace: str
) -> None:
    await _prepare(pg_url)
    engine = outbox.create_engine(pg_url)
    got: list[str] = []
    counter = Service("counter")
    audit = Service("audit")

    @counter.command("counter.increment")
    async def increment(cmd: dict, ctx: Context) -> None:
        async with ctx.sql_transaction(engine) as conn:
            await conn.execute(text("UPDATE counters SET value = value + 1 WHERE name = 'total'"))
            ctx.publish("counter.incremented", {"n": cmd["n"]})

    @audit.event("counter.incremented")
    async def record(event: dict) -> None:
        got.append(event["n"])

    try:
        async with ServiceHarness([], url=redis_url, namespace=namespace) as h:
            from framework import Runtime
            from framework.testing import TEST_SETTINGS

            runtime = Runtime([counter, audit], broker=h.broker, settings=TEST_SETTINGS, outbox_database_url=pg_url)
            async with anyio.create_task_group() as tg:
                await tg.start(runtime.run)
                await h.client.send_many("counter.increment", [{"n": str(n)} for n in range(20)])
                with anyio.fail_after(30):
                    while len(got) < 20:
                        await anyio.sleep(0.05)
                runtime.stop()
    finally:
        await engine.dispose()
    assert sorted(got, key=int) == [str(n) for n in range(20)]
    assert (await _counts(pg_url))[0] == 20


@pytest.mark.anyio
async def test_messages_staged_inside_and_after_a_sql_block_get_different_ids(
    pg_url: str, redis_url: str, namespace: str
) -> None:
    await _prepare(pg_url)
    engine = outbox.create_engine(pg_url)
    svc = Service("counter")

    @svc.command("counter.increment")
    async def increment(cmd: dict, ctx: Context) -> None:
        async with ctx.sql_transaction(engine) as conn:
            await conn.execute(text("INSERT INTO applied (n) VALUES (:n)"), {"n": cmd["n"]})
            ctx.publish("counter.incremented", {"where": "outbox"})
        ctx.publish("counter.incremented", {"where": "direct"})  # allowed, though not exactly-once (warned)

    try:
        async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
            await h.client.send("counter.increment", {"n": "1"})
            await h.run_until_idle()
            [direct] = await h.messages("counter.incremented")
            async with engine.connect() as conn:
                [in_outbox] = (await conn.execute(text("SELECT message_id FROM framework_outbox"))).scalars().all()
    finally:
        await engine.dispose()
    assert direct.body == b'{"where":"direct"}'
    assert in_outbox != direct.id  # one id each: the outbox copy is not dropped downstream as a duplicate

"""Sagas whose state lives in SQL (``Service.saga(..., sql=engine)``), on real PostgreSQL and Valkey.

The step runs inside ``ctx.sql_transaction``: the state row, the rows the step writes with
``ctx.sql``, its outgoing messages and timeouts (outbox rows) and the inbox row commit together or
not at all. The example of docs/sagas.md with its state in PostgreSQL must behave exactly as with
its state in Redis (the process-level fault test is in tests/test_sagas.py, parametrized).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
import redis
from sqlalchemy import text

from framework import RetryPolicy, Service, outbox
from framework.dead_letters import DeadLetters
from framework.saga import SagaContext
from framework.testing import ServiceHarness
from tests.apps import sagaapp
from tests.test_sagas import Orders, _check_once, _outcomes, trickle_to_two_runtimes

pytestmark = pytest.mark.postgres


async def _prepare(url: str, *schema: str) -> Any:
    engine = outbox.create_engine(url)
    await outbox.create_tables(engine)
    async with engine.begin() as conn:
        for statement in schema:
            await conn.execute(text(statement))
    return engine


async def _rows(engine: Any, query: str) -> list[tuple[Any, ...]]:
    async with engine.connect() as conn:
        return [tuple(r) for r in (await conn.execute(text(query))).all()]


@pytest.mark.anyio
async def test_the_example_ships_once_and_cancels_on_timeout_with_its_state_in_postgresql(
    pg_url: str, redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sagaapp, "TIMEOUT", 2.0)
    engine = await _prepare(pg_url)
    shipping, fulfilment = sagaapp.declare(sql=engine)
    r = redis.Redis.from_url(redis_url)
    try:
        async with ServiceHarness(
            [shipping, sagaapp.recorder], url=redis_url, namespace=namespace, outbox_database_url=pg_url
        ) as h:
            orders = Orders(h.client)
            payment, reserve = orders.payment, orders.reserve

            for order in ("pay-first", "dup", "only-pay", "late"):
                await payment(order)
            for order in ("stock-first", "only-stock"):
                await reserve(order)
            await h.run_until_idle()
            await payment("dup")  # the same message again
            await reserve("pay-first")
            await payment("stock-first")
            await reserve("dup")
            with anyio.fail_after(15):  # through the outbox relay to the recorder: poll for the outcome
                while len(_outcomes(r, namespace)["shipped"]) < 3:
                    await anyio.sleep(0.05)
            with anyio.fail_after(20):
                while len(_outcomes(r, namespace)["cancelled"]) < 3:
                    await anyio.sleep(0.1)
            await reserve("late")  # after its timeout cancelled it: ignored, starts nothing
            await payment("dup")
            await h.run_until_idle()
            await anyio.sleep(2.5)  # a timeout the late message would have requested would have fired
            await h.run_until_idle()
            out = _outcomes(r, namespace)
            _check_once(out, ["pay-first", "stock-first", "dup", "only-pay", "only-stock", "late"])
            assert set(out["shipped"]) == {"pay-first", "stock-first", "dup"}
            assert out["cancel_detail"] == {
                "only-pay": "refund=1000 release=None",
                "only-stock": "refund=0 release=sku-only-stock",
                "late": "refund=1000 release=None",
            }
        rows = await _rows(engine, "SELECT correlation, state, timeouts, completed_at FROM framework_saga_state")
        assert {row[0] for row in rows} == {"pay-first", "stock-first", "dup", "only-pay", "only-stock", "late"}
        assert all(row[1] is None and row[2] is None and row[3] is not None for row in rows)  # tombstones only
        # nothing of the state is in Redis: no saga hash under the saga queue's partitions
        for p in range(fulfilment.queue.partitions):
            stream = h.broker.keyspace.partition(fulfilment.queue.name, p).stream
            assert not list(r.scan_iter(f"{stream}:saga:*"))
        # every outgoing message and timeout went through the outbox table, once
        sent = await _rows(engine, "SELECT destination, count(*) FROM framework_outbox_sent GROUP BY destination")
        assert dict(sent) == {"warehouse.ship": 3, "orders.cancel": 3, fulfilment.queue.name: 6}
    finally:
        await engine.dispose()


FAILS: dict[str, int] = {}  # correlation id -> attempts left that raise after writing


@attrs.define
class Account:
    balance: int = 0


def _ledger_saga(engine: Any) -> Any:
    svc = Service("ledgers")
    saga = svc.saga("account", state=Account, sql=engine, partitions=1)

    @saga.command("ledger.post", correlate=lambda c: c["account"])
    async def post(cmd: dict[str, Any], ctx: SagaContext[Account]) -> None:
        assert ctx.sql is not None
        await ctx.sql.execute(
            text("INSERT INTO postings (account, amount, message_id) VALUES (:a, :n, :m)"),
            {"a": ctx.correlation, "n": cmd["amount"], "m": ctx.message_id},
        )
        ctx.state.balance += cmd["amount"]
        ctx.send("ledger.posted", {"account": ctx.correlation, "balance": ctx.state.balance}, delay=0.2)
        if FAILS.get(cmd["id"], 0) > 0:
            FAILS[cmd["id"]] -= 1
            raise RuntimeError("fails after writing: nothing of this attempt may stay")

    return svc, saga


@pytest.mark.anyio
async def test_a_step_s_rows_state_and_messages_commit_together_or_not_at_all(
    pg_url: str, redis_url: str, namespace: str
) -> None:
    engine = await _prepare(pg_url, "CREATE TABLE postings (account text, amount int, message_id text)")
    svc, _ = _ledger_saga(engine)
    FAILS.clear()
    FAILS.update({"twice": 2, "always": 99})
    try:
        async with ServiceHarness([svc], url=redis_url, namespace=namespace, outbox_database_url=pg_url) as h:
            await h.client.send("ledger.post", {"account": "a", "amount": 5, "id": "ok"})
            await h.client.send("ledger.post", {"account": "a", "amount": 7, "id": "twice"})  # fails twice, then ok
            await h.client.send("ledger.post", {"account": "b", "amount": 100, "id": "always"})  # dead-lettered
            await h.run_until_idle()
            stats = h.stats()["ledgers.saga_account"]
            assert stats["dead_lettered"] == 1
            with anyio.fail_after(15):  # the delayed sends: through the outbox, scheduled, then stored
                while len(await h.messages("ledger.posted")) < 2:
                    await anyio.sleep(0.1)
            posted = [m.body for m in await h.messages("ledger.posted")]
        assert await _rows(engine, "SELECT account, amount FROM postings ORDER BY amount") == [("a", 5), ("a", 7)]
        state = await _rows(engine, "SELECT correlation, version, state FROM framework_saga_state")
        assert state == [("a", 2, '{"balance":12}')]  # b: never saved (its step always failed)
        assert sorted(posted) == [b'{"account":"a","balance":12}', b'{"account":"a","balance":5}']
    finally:
        await engine.dispose()


@pytest.mark.anyio
async def test_two_runtimes_on_one_shared_partition_lose_no_update(pg_url: str, redis_url: str, namespace: str) -> None:
    """Ownership off: both runtimes read the saga queue's one partition, so steps of one instance
    run at once in two processes' worth of runtimes; the row lock and the version check keep every
    increment."""
    engine = await _prepare(pg_url)
    svc = Service("sqlcounting")
    counter = svc.saga("counter", state=dict, sql=engine, partitions=1)

    @counter.event("sqlcount.ticks", correlate=lambda e: e["k"])
    async def tick(event: dict[str, Any], ctx: SagaContext[dict[str, Any]]) -> None:
        n = ctx.state.get("n", 0)
        await anyio.sleep(0.02)  # widen the window between the load and the save
        ctx.state["n"] = n + 1

    try:
        stats = await trickle_to_two_runtimes(svc, redis_url, namespace, "sqlcount.ticks", 120, 60)
        rows = await _rows(engine, "SELECT correlation, state, version FROM framework_saga_state ORDER BY 1")
        assert rows == [("k0", '{"n":40}', 40), ("k1", '{"n":40}', 40), ("k2", '{"n":40}', 40)]
        assert all(s["processed"] > 0 for s in stats), stats  # both ran steps
        assert sum(s["dead_lettered"] for s in stats) == 0
    finally:
        await engine.dispose()


@pytest.mark.anyio
async def test_expired_tombstones_are_cleaned_and_a_missing_table_says_how_to_create_it(
    pg_url: str, redis_url: str, namespace: str
) -> None:
    engine = await _prepare(pg_url)
    svc = Service("sqlshort", retry=RetryPolicy(max_attempts=2, backoff=0.05, max_delay=0.1))
    short = svc.saga("short", state=dict, sql=engine, partitions=1, keep_completed=0.5)

    @short.command("short.once", correlate=lambda c: c["id"])
    async def once(cmd: dict[str, Any], ctx: SagaContext[dict[str, Any]]) -> None:
        ctx.state["runs"] = ctx.state.get("runs", 0) + 1
        ctx.complete()

    try:
        async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
            await h.client.send("short.once", {"id": "x"})
            await h.client.send("short.once", {"id": "y"})
            await h.run_until_idle()
            await h.client.send("short.once", {"id": "x"})  # another message, within keep_completed: ignored
            await h.run_until_idle()
            assert await _rows(engine, "SELECT correlation, version FROM framework_saga_state ORDER BY 1") == [
                ("x", 1),
                ("y", 1),
            ]
            await anyio.sleep(0.7)
            await h.client.send("short.once", {"id": "x"})  # after it: a new instance, completed again
            await h.run_until_idle()
            # x's new tombstone (version 2: it continues from the expired one); y's expired one deleted by it
            assert await _rows(engine, "SELECT correlation, version FROM framework_saga_state ORDER BY 1") == [("x", 2)]
            assert h.stats()["sqlshort.saga_short"]["processed"] == 4

        async with engine.begin() as conn:
            await conn.execute(text("DROP TABLE framework_saga_state"))
        async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
            await h.client.send("short.once", {"id": "z"})
            await h.run_until_idle()
            [dead] = await DeadLetters(h.broker).list()
        assert "table framework_saga_state is missing: run `framework outbox migrate" in dead.error_message
    finally:
        await engine.dispose()


@pytest.mark.anyio
async def test_state_in_sqlite_works_without_a_server(tmp_path: Path, redis_url: str, namespace: str) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'sagas.db'}"
    engine = await _prepare(url)
    svc = Service("sqlitecounting")
    counter = svc.saga("counter", state=dict, sql=lambda: engine, partitions=1)

    @counter.command("sqlite.ticks", correlate=lambda c: c["k"])
    async def tick(cmd: dict[str, Any], ctx: SagaContext[dict[str, Any]]) -> None:
        ctx.state["n"] = ctx.state.get("n", 0) + 1

    try:
        async with ServiceHarness([svc], url=redis_url, namespace=namespace) as h:
            await h.client.send_many("sqlite.ticks", [{"k": f"k{i % 2}"} for i in range(10)])
            await h.run_until_idle()
        rows = await _rows(engine, "SELECT correlation, state, version FROM framework_saga_state ORDER BY 1")
        assert rows == [("k0", '{"n":5}', 5), ("k1", '{"n":5}', 5)]
    finally:
        await engine.dispose()

"""Sagas on RabbitMQ: the example of docs/sagas.md with its state in SQL (``sql=engine``), the only way a
saga runs there (RabbitMQ has no state store: a saga keeping its state in the transport is refused at
start, naming the saga and the capability).

Its steps commit the state, the inbox row and the outgoing messages and timeouts (outbox rows) in one
SQL transaction; the outbox relay publishes them to RabbitMQ (timeouts through its delay chain).
Runs on the local RabbitMQ (skipped when unreachable, failed under CI) and a SQLite file.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import anyio
import pytest
from sqlalchemy import text

from framework import HandlerError, Service, outbox
from framework.runtime.requirements import check_requirements
from framework.testing import TEST_SETTINGS, ServiceHarness
from tests.apps import sagaapp
from tests.test_sagas import Orders

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


async def test_the_example_ships_once_and_cancels_on_timeout_with_its_state_in_sql(
    rabbitmq_url: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sagaapp, "TIMEOUT", 2.0)
    db = f"sqlite+aiosqlite:///{tmp_path / 'sagas.db'}"
    engine = outbox.create_engine(db)
    await outbox.create_tables(engine)
    shipping, _ = sagaapp.declare(sql=engine)
    ended: Counter[tuple[str, str]] = Counter()
    recorder = Service("rabbit-recorder")

    @recorder.command(sagaapp.SHIP)
    async def shipped(cmd: sagaapp.ShipOrder) -> None:
        ended["shipped", cmd.order_id] += 1

    @recorder.command(sagaapp.CANCEL)
    async def cancelled(cmd: sagaapp.CancelOrder) -> None:
        ended["cancelled", cmd.order_id] += 1

    url = f"{rabbitmq_url}?inbox={redis_url}"
    try:
        async with ServiceHarness([shipping, recorder], url=url, outbox_database_url=db) as h:
            orders = Orders(h.client)
            for order in ("pay-first", "dup", "only-pay"):
                await orders.payment(order)
            for order in ("stock-first", "only-stock"):
                await orders.reserve(order)
            await h.run_until_idle()
            await orders.payment("dup")  # the same message again: the inbox drops it
            await orders.reserve("pay-first")
            await orders.payment("stock-first")
            await orders.reserve("dup")
            with anyio.fail_after(30):  # through the outbox relay and, for timeouts, the delay chain
                while sum(n for (what, _), n in ended.items() if what == "cancelled") < 2 or len(ended) < 5:
                    await anyio.sleep(0.1)
            await orders.payment("dup")
            await anyio.sleep(2.5)  # a second timeout or shipment would arrive now
            await h.run_until_idle()
        assert dict(ended) == {
            ("shipped", "pay-first"): 1,
            ("shipped", "stock-first"): 1,
            ("shipped", "dup"): 1,
            ("cancelled", "only-pay"): 1,
            ("cancelled", "only-stock"): 1,
        }
        async with engine.connect() as conn:
            rows = (await conn.execute(text("SELECT correlation, state FROM framework_saga_state"))).all()
        assert {r[0] for r in rows} == {"pay-first", "stock-first", "dup", "only-pay", "only-stock"}
        assert all(r[1] is None for r in rows), rows  # completed: tombstones
    finally:
        await engine.dispose()


async def test_a_saga_keeping_its_state_in_rabbitmq_is_refused_at_start_naming_it(
    rabbitmq_url: str, redis_url: str
) -> None:
    from broker import connect

    shipping, _ = sagaapp.declare()
    broker = await connect(f"{rabbitmq_url}?inbox={redis_url}")
    try:
        with pytest.raises(HandlerError, match="fulfilment") as caught:
            check_requirements(broker, [shipping], TEST_SETTINGS)
        assert "'state'" in str(caught.value) and "sql=" in str(caught.value), caught.value
    finally:
        await broker.close()

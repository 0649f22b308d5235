"""inventory's tests: reservations per SKU in order, stock never negative, shortages published,
releases that put stock back or block a late reservation, exactly once under duplicates."""

from __future__ import annotations

import orjson
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from example_services.shop import db
from example_services.shop.inventory import inventory
from example_services.shop.messages import ORDERS_PLACED, RELEASE_STOCK, OrderPlaced, ReleaseStock
from framework.testing import ServiceHarness


def order(n: int, sku: str = "mug", qty: int = 2) -> OrderPlaced:
    return OrderPlaced(f"{sku}-{n}", "ada", sku, qty, 100 * qty, "4242-4242-4242-4242")


async def scalar(engine: AsyncEngine, sql: str) -> object:
    async with engine.connect() as conn:
        return (await conn.execute(text(sql))).scalar()


@pytest.mark.anyio
async def test_reserves_in_order_until_stock_runs_out_never_below_zero(
    framework_redis_url: str, framework_namespace: str, shop_db_url: str, shop_engine: AsyncEngine
) -> None:
    async with shop_engine.begin() as conn:
        await db.set_stock(conn, {"mug": 5, "tee": 100})
    async with ServiceHarness(
        [inventory], url=framework_redis_url, namespace=framework_namespace, outbox_database_url=shop_db_url
    ) as h:
        for n in range(4):  # 2 + 2 fit, then 1 is left: the third and fourth are short
            await h.client.publish(ORDERS_PLACED, order(n), key="mug", message_id=f"evt-{n}")
        await h.client.publish(ORDERS_PLACED, order(0), key="mug", message_id="evt-0")  # a duplicate delivery
        await h.run_until_idle()
        assert h.stats()["inventory.reserve"]["duplicates"] == 1
    assert await scalar(shop_engine, "SELECT available FROM inventory_stock WHERE sku = 'mug'") == 1
    async with shop_engine.connect() as conn:
        states = dict(list(await conn.execute(text("SELECT order_id, state FROM inventory_reservations"))))
        sent = list(await conn.execute(text("SELECT destination, body FROM framework_outbox_sent ORDER BY seq")))
    assert states == {"mug-0": "reserved", "mug-1": "reserved", "mug-2": "short", "mug-3": "short"}
    assert [(d, orjson.loads(b)["order_id"]) for d, b in sent] == [
        ("stock.reserved", "mug-0"),
        ("stock.reserved", "mug-1"),
        ("stock.short", "mug-2"),
        ("stock.short", "mug-3"),
    ]
    assert orjson.loads(sent[2][1])["available"] == 1


@pytest.mark.anyio
async def test_release_puts_stock_back_and_blocks_a_late_reservation(
    framework_redis_url: str, framework_namespace: str, shop_db_url: str, shop_engine: AsyncEngine
) -> None:
    async with shop_engine.begin() as conn:
        await db.set_stock(conn, {"cap": 10})
    async with ServiceHarness(
        [inventory], url=framework_redis_url, namespace=framework_namespace, outbox_database_url=shop_db_url
    ) as h:
        await h.client.publish(ORDERS_PLACED, order(1, "cap", 3), key="cap")
        await h.run_until_idle()
        assert await scalar(shop_engine, "SELECT available FROM inventory_stock") == 7
        await h.client.send(RELEASE_STOCK, ReleaseStock("cap-1", "cap"))
        await h.client.send(RELEASE_STOCK, ReleaseStock("cap-2", "cap"))  # overtakes its order's event
        await h.run_until_idle()
        await h.client.publish(ORDERS_PLACED, order(2, "cap", 4), key="cap")
        await h.run_until_idle()
    assert await scalar(shop_engine, "SELECT available FROM inventory_stock") == 10
    assert await scalar(shop_engine, "SELECT count(*) FROM inventory_reservations WHERE state = 'released'") == 2

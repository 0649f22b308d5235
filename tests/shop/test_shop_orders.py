"""orders' tests: the API writes the row and its event in one transaction (outbox), validates
bodies, shows the state; the service moves the row along as the outcome events arrive."""

from __future__ import annotations

import orjson
import pytest
from sqlalchemy import insert, text
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.testclient import TestClient

from example_services.shop import db
from example_services.shop.messages import (
    ORDERS_CANCELLED,
    ORDERS_SHIPPED,
    PAYMENTS_CAPTURED,
    OrderCancelled,
    OrderShipped,
    PaymentCaptured,
)
from example_services.shop.orders import create_app, orders
from framework.testing import ServiceHarness


def test_post_writes_the_order_and_its_event_together(shop_db_url: str) -> None:
    with TestClient(create_app(shop_db_url, create_tables=True)) as http:
        placed = http.post("/orders", json={"customer": "ada", "sku": "tee", "qty": 2, "card": "4242-4242-4242-4242"})
        assert placed.status_code == 201
        order_id = placed.json()["order_id"]
        assert placed.json()["amount_cents"] == 2 * db.CATALOGUE["tee"]
        shown = http.get(f"/orders/{order_id}").json()
        assert (shown["status"], shown["paid"], shown["reserved"]) == ("placed", False, False)
        assert (
            http.post(
                "/orders", json={"customer": "ada", "sku": "tee", "qty": 2, "card": "x", "order_id": order_id}
            ).status_code
            == 409
        )
        bad = http.post("/orders", json={"customer": "ada", "sku": "yacht", "qty": 1, "card": "4242"})
        assert bad.status_code == 422 and "unknown sku 'yacht'" in bad.json()["error"]
        assert http.post("/orders", json={"customer": "ada", "sku": "tee", "qty": 0, "card": "4242"}).status_code == 422
        assert http.get("/orders/nope").status_code == 404
        assert http.get("/orders").json() == {"placed": 1}
        import sqlite3

        path = shop_db_url.split("///", 1)[1]
        with sqlite3.connect(path) as conn:  # exactly one event waits in the outbox: the committed order's
            waiting = conn.execute("SELECT destination, key, body FROM framework_outbox").fetchall()
        assert [(d, k, orjson.loads(b)["order_id"]) for d, k, b in waiting] == [("orders.placed", "tee", order_id)]


@pytest.mark.anyio
async def test_the_service_moves_the_order_to_its_final_state(
    framework_redis_url: str, framework_namespace: str, shop_engine: AsyncEngine
) -> None:
    async with shop_engine.begin() as conn:
        for oid in ("o-1", "o-2"):
            await conn.execute(insert(db.orders).values(id=oid, customer="ada", sku="mug", qty=1, amount_cents=1250))
    async with ServiceHarness([orders], url=framework_redis_url, namespace=framework_namespace) as h:
        await h.client.publish(PAYMENTS_CAPTURED, PaymentCaptured("o-1", 1250, "mug"))
        await h.client.publish(ORDERS_SHIPPED, OrderShipped("o-1", "mug", 1))
        await h.client.publish(ORDERS_CANCELLED, OrderCancelled("o-2", "declined", "card declined: expired card"))
        await h.run_until_idle()
        await h.client.publish(ORDERS_SHIPPED, OrderShipped("o-2", "mug", 1))  # late and wrong: a final state stays
        await h.run_until_idle()
    async with shop_engine.connect() as conn:
        found = list(await conn.execute(text("SELECT id, status, reason, paid FROM shop_orders ORDER BY id")))
    # o-1's payment and shipment arrive on different topics, in either order: both are recorded
    assert found == [("o-1", "shipped", None, True), ("o-2", "declined", "card declined: expired card", False)]

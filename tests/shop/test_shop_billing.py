"""billing's tests: charged once whatever the deliveries, retried through a flaky gateway, declines
published, invalid cards dead-lettered with the reason, refunds and voids."""

from __future__ import annotations

import orjson
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from example_services.shop.billing import billing
from example_services.shop.messages import ORDERS_PLACED, REFUND_PAYMENT, OrderPlaced, RefundPayment
from framework.testing import ServiceHarness

GOOD = "4242-4242-4242-4242"


def order(n: int, card: str = GOOD, cents: int = 1_250) -> OrderPlaced:
    return OrderPlaced(f"mug-{n}", f"customer-{n}", "mug", 1, cents, card)


async def rows(engine: AsyncEngine, sql: str) -> list[tuple]:  # type: ignore[type-arg]
    async with engine.connect() as conn:
        return [tuple(r) for r in await conn.execute(text(sql))]


@pytest.mark.anyio
async def test_charges_each_order_once_even_when_delivered_twice(
    framework_redis_url: str, framework_namespace: str, shop_db_url: str, shop_engine: AsyncEngine
) -> None:
    async with ServiceHarness(
        [billing], url=framework_redis_url, namespace=framework_namespace, outbox_database_url=shop_db_url
    ) as h:
        for n in range(3):
            await h.client.publish(ORDERS_PLACED, order(n), message_id=f"evt-{n}")
        await h.client.publish(ORDERS_PLACED, order(1), message_id="evt-1")  # the same event, delivered again
        await h.run_until_idle()
        assert await rows(shop_engine, "SELECT order_id, count(*) FROM billing_charges GROUP BY order_id") == [
            ("mug-0", 1),
            ("mug-1", 1),
            ("mug-2", 1),
        ]
        assert h.stats()["billing.charge"]["duplicates"] == 1


@pytest.mark.anyio
async def test_a_flaky_gateway_is_retried_and_declines_are_published(
    framework_redis_url: str,
    framework_namespace: str,
    shop_db_url: str,
    shop_engine: AsyncEngine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SHOP_GATEWAY_FLAKINESS", "0.5")
    async with ServiceHarness(
        [billing], url=framework_redis_url, namespace=framework_namespace, outbox_database_url=shop_db_url
    ) as h:
        for n in range(20):
            await h.client.publish(ORDERS_PLACED, order(n, "4000-0000-0000-0002" if n == 7 else GOOD))
        await h.run_until_idle()
        stats = h.stats()["billing.charge"]
        assert stats["retried"] > 0 and stats["dead_lettered"] == 0  # every transient failure got through
        assert len(await rows(shop_engine, "SELECT * FROM billing_charges")) == 19
        assert await rows(
            shop_engine, "SELECT order_id, state, reason FROM billing_payments WHERE state != 'charged'"
        ) == [("mug-7", "declined", "insufficient funds")]
    # the events left through the outbox in the charge's transaction
    assert await rows(
        shop_engine, "SELECT destination, count(*) FROM framework_outbox_sent GROUP BY destination ORDER BY 1"
    ) == [("payments.captured", 19), ("payments.failed", 1)]


@pytest.mark.anyio
async def test_an_invalid_card_is_dead_lettered_at_once_with_the_reason(
    framework_redis_url: str, framework_namespace: str, shop_db_url: str, shop_engine: AsyncEngine
) -> None:
    async with ServiceHarness(
        [billing], url=framework_redis_url, namespace=framework_namespace, outbox_database_url=shop_db_url
    ) as h:
        await h.client.publish(ORDERS_PLACED, order(1, "4242-4242-4242-4241"))
        await h.run_until_idle()
        [dead] = await h.dead_letters()
        assert dead.attempts == 1  # fatal: not retried
        assert dead.error_type.endswith("InvalidCard") and "fails the Luhn check" in dead.error_message
        assert await rows(shop_engine, "SELECT * FROM billing_charges") == []


@pytest.mark.anyio
async def test_a_refund_gives_money_back_and_a_void_blocks_a_later_charge(
    framework_redis_url: str, framework_namespace: str, shop_db_url: str, shop_engine: AsyncEngine
) -> None:
    async with ServiceHarness(
        [billing], url=framework_redis_url, namespace=framework_namespace, outbox_database_url=shop_db_url
    ) as h:
        await h.client.publish(ORDERS_PLACED, order(1))
        await h.run_until_idle()
        await h.client.send(REFUND_PAYMENT, RefundPayment("mug-1", "out of stock"))
        await h.client.send(REFUND_PAYMENT, RefundPayment("mug-2", "timeout"))  # before its charge
        await h.run_until_idle()
        await h.client.publish(ORDERS_PLACED, order(2))
        await h.run_until_idle()
        assert await rows(shop_engine, "SELECT order_id, state FROM billing_payments ORDER BY 1") == [
            ("mug-1", "refunded"),
            ("mug-2", "voided"),
        ]
        assert await rows(shop_engine, "SELECT order_id, amount_cents FROM billing_refunds") == [("mug-1", 1_250)]
        assert await rows(shop_engine, "SELECT order_id FROM billing_charges") == [("mug-1",)]
    sent = await rows(
        shop_engine, "SELECT destination, body FROM framework_outbox_sent WHERE destination = 'payments.refunded'"
    )
    assert [orjson.loads(body) for _, body in sent] == [{"order_id": "mug-1", "amount_cents": 1_250}]

"""shipping's tests: the saga ships when payment and stock are both in (either order), and cancels
with compensating commands on a decline, a shortage or a timeout; on ``memory://``, no server."""

from __future__ import annotations

import anyio
import orjson
import pytest

from example_services.shop.messages import (
    PAYMENTS_CAPTURED,
    PAYMENTS_FAILED,
    STOCK_RESERVED,
    STOCK_SHORT,
    PaymentCaptured,
    PaymentFailed,
    StockReserved,
    StockShort,
)
from example_services.shop.shipping import shipping
from framework.testing import ServiceHarness


async def bodies(h: ServiceHarness, destination: str) -> list[dict]:  # type: ignore[type-arg]
    return [orjson.loads(m.body) for m in await h.messages(destination)]


@pytest.mark.anyio
async def test_ships_once_payment_and_stock_are_in_whichever_comes_first() -> None:
    async with ServiceHarness([shipping], url="memory://") as h:
        await h.client.publish(STOCK_RESERVED, StockReserved("o-1", "mug", 2))
        await h.client.publish(PAYMENTS_CAPTURED, PaymentCaptured("o-2", 900, "socks"))
        await h.run_until_idle()
        assert await h.messages("orders.shipped") == []
        await h.client.publish(PAYMENTS_CAPTURED, PaymentCaptured("o-1", 2_500, "mug"))
        await h.client.publish(STOCK_RESERVED, StockReserved("o-2", "socks", 1))
        await h.run_until_idle()
        shipped = await bodies(h, "orders.shipped")
        assert sorted(s["order_id"] for s in shipped) == ["o-1", "o-2"]
        assert len(await h.messages("notifications.email")) == 2
        assert await h.messages("orders.cancelled") == []


@pytest.mark.anyio
async def test_a_decline_releases_stock_and_a_shortage_refunds() -> None:
    async with ServiceHarness([shipping], url="memory://") as h:
        await h.client.publish(STOCK_RESERVED, StockReserved("o-1", "mug", 1))
        await h.client.publish(PAYMENTS_FAILED, PaymentFailed("o-1", "card declined: insufficient funds", "mug"))
        await h.client.publish(PAYMENTS_CAPTURED, PaymentCaptured("o-2", 300, "sticker"))
        await h.client.publish(STOCK_SHORT, StockShort("o-2", "sticker", 1, 0))
        await h.run_until_idle()
        cancelled = {c["order_id"]: c for c in await bodies(h, "orders.cancelled")}
        assert cancelled["o-1"]["kind"] == "declined" and cancelled["o-1"]["reason"].startswith("card declined")
        assert cancelled["o-2"] == {
            "order_id": "o-2",
            "kind": "out_of_stock",
            "reason": "only 0 sticker left, 1 ordered",
        }
        assert await bodies(h, "inventory.release") == [{"order_id": "o-1", "sku": "mug"}]
        assert await bodies(h, "billing.refund") == [{"order_id": "o-2", "reason": "only 0 sticker left, 1 ordered"}]
        assert await h.messages("orders.shipped") == []


@pytest.mark.anyio
async def test_times_out_and_undoes_both_when_payment_never_comes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOP_FULFILMENT_TIMEOUT", "0.3")
    async with ServiceHarness([shipping], url="memory://") as h:
        await h.client.publish(STOCK_RESERVED, StockReserved("o-1", "tee", 1))
        await h.run_until_idle()
        for _ in range(50):  # the harness does not wait for scheduled messages: poll for the timeout
            if await h.messages("orders.cancelled"):
                break
            await anyio.sleep(0.1)
        [cancelled] = await bodies(h, "orders.cancelled")
        assert cancelled["kind"] == "timeout" and cancelled["reason"] == "payment not confirmed within 0.3 s"
        assert await bodies(h, "billing.refund") == [{"order_id": "o-1", "reason": cancelled["reason"]}]
        assert await bodies(h, "inventory.release") == [{"order_id": "o-1", "sku": "tee"}]
        await h.client.publish(PAYMENTS_CAPTURED, PaymentCaptured("o-1", 2_400, "tee"))  # too late: ignored
        await h.run_until_idle()
        assert await h.messages("orders.shipped") == []

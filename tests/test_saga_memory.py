"""Sagas on the in-process transport (``memory://``): the example of docs/sagas.md end to end.

The saga keeps its state in the transport's state store (the ``state`` capability), which memory
offers: ``ServiceHarness(..., url="memory://...")`` runs the example's inputs in either order, a
duplicate input dropped, the timeout firing (and cancelling with its compensation), a completed
instance's tombstone ignoring late messages, with no Redis at all. The recorder here counts the
shipping and cancelling commands in this process (tests/apps/sagaapp.py's recorder writes Redis).
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator

import anyio
import pytest

from broker import new_id
from broker.capabilities import as_state
from broker.memory import reset
from framework import Context, Service
from framework.saga import SAGA_INPUT
from framework.testing import ServiceHarness
from tests.apps import sagaapp
from tests.apps.sagaapp import CANCEL, PAYMENTS, SHIP, STOCK, CancelOrder, PaymentCaptured, ShipOrder, StockReserved

pytestmark = pytest.mark.anyio


@pytest.fixture
def url() -> Iterator[str]:
    name = f"memory://sagas-{uuid.uuid4().hex}"
    yield name
    reset(name)


def recorder(outcomes: Counter[tuple[str, str]], details: dict[str, str]) -> Service:
    """Handles the saga's commands (inbox on: each message once) by counting them per order."""
    svc = Service("recorder")

    @svc.command(SHIP)
    async def ship(cmd: ShipOrder, ctx: Context) -> None:
        outcomes["shipped", cmd.order_id] += 1

    @svc.command(CANCEL)
    async def cancel(cmd: CancelOrder, ctx: Context) -> None:
        outcomes["cancelled", cmd.order_id] += 1
        details[cmd.order_id] = f"refund={cmd.refund_cents} release={cmd.release_sku}"

    return svc


async def test_the_example_saga_runs_on_memory_with_duplicates_and_a_timeout(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sagaapp, "TIMEOUT", 1.0)
    shipping, fulfilment = sagaapp.declare()
    outcomes: Counter[tuple[str, str]] = Counter()
    details: dict[str, str] = {}
    ids: dict[tuple[str, str], str] = {}

    async with ServiceHarness([shipping, recorder(outcomes, details)], url=url) as h:

        async def payment(order: str) -> None:
            mid = ids.setdefault((order, "pay"), new_id())
            await h.client.publish(PAYMENTS, PaymentCaptured(order, 1000), key=order, message_id=mid)

        async def reserve(order: str) -> None:
            mid = ids.setdefault((order, "stock"), new_id())
            await h.client.publish(STOCK, StockReserved(order, f"sku-{order}"), key=order, message_id=mid)

        await payment("pay-first")
        await reserve("stock-first")
        await payment("dup")
        await payment("only-pay")
        await h.run_until_idle()
        await payment("dup")  # the same message again: dropped by the forwarding handler's inbox
        # and a copy straight on the saga's queue, twice under one id: its step runs once
        forwarded = new_id()
        for _ in range(2):
            await h.client.send(
                fulfilment.queue,
                StockReserved("dup", "sku-dup"),
                key="dup",
                headers={SAGA_INPUT: STOCK.name},
                message_id=forwarded,
            )
        await reserve("pay-first")
        await payment("stock-first")
        await h.run_until_idle()
        assert outcomes == {("shipped", "pay-first"): 1, ("shipped", "stock-first"): 1, ("shipped", "dup"): 1}

        with anyio.fail_after(15):  # only-pay's timeout fires: cancelled, with its compensation
            while ("cancelled", "only-pay") not in outcomes:
                await anyio.sleep(0.05)
                await h.run_until_idle()
        await reserve("only-pay")  # after its timeout completed it: ignored, starts nothing
        await payment("dup")  # a late duplicate of a completed instance: ignored
        await anyio.sleep(1.5)  # the shipped orders' timeouts fire too, and are ignored
        await h.run_until_idle()
        assert outcomes == {
            ("shipped", "pay-first"): 1,
            ("shipped", "stock-first"): 1,
            ("shipped", "dup"): 1,
            ("cancelled", "only-pay"): 1,
        }
        assert details == {"only-pay": "refund=1000 release=None"}

        stats = h.stats()
        assert stats["shipping.saga_fulfilment_payment_captured"]["duplicates"] >= 1  # the input's copy
        step = stats["shipping.saga_fulfilment"]
        assert step["duplicates"] >= 1 and step["dead_lettered"] == 0, step  # the saga queue's copy
        assert not await h.dead_letters()

        store = as_state(h.broker)  # completed instances leave a tombstone, no state
        for order in ("pay-first", "stock-first", "dup", "only-pay"):
            partition = fulfilment.queue.spec().partition_for(order, "")
            key = store.state_key(fulfilment.queue.name, partition, order)
            assert await store.read_state(key, ("done", "s")) == [b"1", None], order

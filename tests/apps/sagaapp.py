"""The saga example of docs/sagas.md, run as real worker processes by tests/test_sagas.py.

Shipping waits for ``payments.captured`` and ``stock.reserved`` of one order, in either order,
ships it once (a ``warehouse.ship`` command), and cancels it with a compensating command
(``orders.cancel``: refund the payment / release the stock it saw) when the timeout fires first.

With ``$SAGA_DATABASE_URL`` set (worker processes), or :func:`declare` given an engine (tests in
one process), the saga keeps its state in that database instead of the transport's state store
(Redis, or ``memory://`` in tests/test_saga_memory.py).

A ``recorder`` service handles both commands and counts them per order in Redis, exactly once
per message (its counts commit with its inbox mark), so the test can see an order shipped or
cancelled twice, by two different messages, or both.
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from framework import Context, Queue, Service, Topic
from framework.saga import Saga, SagaContext

TIMEOUT = float(os.environ.get("SAGA_TIMEOUT", "3"))  # seconds an order may wait for both messages

PAYMENTS = Topic("payments.captured", partitions=2)
STOCK = Topic("stock.reserved", partitions=2)
SHIP = Queue("warehouse.ship")
CANCEL = Queue("orders.cancel")


@attrs.frozen
class PaymentCaptured:
    order_id: str
    amount_cents: int


@attrs.frozen
class StockReserved:
    order_id: str
    sku: str


@attrs.frozen
class ShipOrder:
    order_id: str
    sku: str


@attrs.frozen
class CancelOrder:
    order_id: str
    refund_cents: int  # compensation: give the captured payment back (0: none was captured)
    release_sku: str | None  # compensation: release the reserved stock (None: none was reserved)


@attrs.frozen
class FulfilmentTimeout:
    order_id: str


@attrs.define
class Fulfilment:
    """The saga's state: what has arrived for one order."""

    paid_cents: int | None = None
    sku: str | None = None


def declare(sql: Any = None) -> tuple[Service, Saga[Fulfilment]]:
    """The shipping service and its saga; ``sql``: keep the state in that database (else in the
    transport's state store)."""
    shipping = Service("shipping")
    fulfilment = shipping.saga("fulfilment", state=Fulfilment, sql=sql)

    @fulfilment.event(PAYMENTS, correlate=lambda e: e.order_id)
    async def payment_captured(event: PaymentCaptured, ctx: SagaContext[Fulfilment]) -> None:
        ctx.state.paid_cents = event.amount_cents
        progress(ctx)

    @fulfilment.event(STOCK, correlate=lambda e: e.order_id)
    async def stock_reserved(event: StockReserved, ctx: SagaContext[Fulfilment]) -> None:
        ctx.state.sku = event.sku
        progress(ctx)

    @fulfilment.timeout
    async def timed_out(timeout: FulfilmentTimeout, ctx: SagaContext[Fulfilment]) -> None:
        state = ctx.state
        ctx.send(CANCEL, CancelOrder(timeout.order_id, state.paid_cents or 0, state.sku))
        ctx.complete()

    return shipping, fulfilment


def progress(ctx: SagaContext[Fulfilment]) -> None:
    """Start the clock on the first message; ship once both have arrived."""
    if ctx.is_new:
        ctx.request_timeout(TIMEOUT, FulfilmentTimeout(ctx.correlation))
    state = ctx.state
    if state.paid_cents is not None and state.sku is not None:
        ctx.send(SHIP, ShipOrder(ctx.correlation, state.sku))
        ctx.complete()


def _engine() -> Any:
    from framework import outbox

    return outbox.create_engine(os.environ["SAGA_DATABASE_URL"])


# Worker processes keep the state in SQL when $SAGA_DATABASE_URL is set (run them with --outbox-relay).
shipping, fulfilment = declare(_engine if os.environ.get("SAGA_DATABASE_URL") else None)


recorder = Service("recorder")


def record_key(namespace: str, what: str) -> str:
    """Where the recorder counts ``what`` (shipped, cancelled, ...): under its queue's hash tag."""
    queue = SHIP.name if what.startswith("shipped") else CANCEL.name
    return f"{namespace}:{{{queue}:0}}:test:{what}"


def _record(ctx: Context, what: str, order_id: str, detail: str = "") -> None:
    # Under the message's hash tag (Cluster-safe), committed with the inbox mark: once per message id.
    namespace = ctx._broker.keyspace.namespace
    tx = ctx.redis_transaction()
    tx.hincrby(record_key(namespace, what), order_id, 1)
    tx.sadd(record_key(namespace, f"{what}-ids"), f"{order_id}|{ctx.message_id}")
    if detail:
        tx.hset(record_key(namespace, f"{what}-detail"), order_id, detail)


@recorder.command(SHIP)
async def ship(cmd: ShipOrder, ctx: Context) -> None:
    _record(ctx, "shipped", cmd.order_id, cmd.sku)


@recorder.command(CANCEL)
async def cancel(cmd: CancelOrder, ctx: Context) -> None:
    _record(ctx, "cancelled", cmd.order_id, f"refund={cmd.refund_cents} release={cmd.release_sku}")

"""shipping: a saga per order that ships it once payment and stock are both confirmed.

Whichever of ``payments.captured`` and ``stock.reserved`` arrives first starts the order's saga and
its timeout; when both are in, it publishes ``orders.shipped`` and asks for the confirmation
e-mail. A decline (``payments.failed``), a shortage (``stock.short``) or the timeout cancels it with
compensating commands (``inventory.release``, ``billing.refund``; both are safe to send when there is
nothing to undo) and ``orders.cancelled`` with the reason. The state, the timeout and the outgoing
messages commit with the inbox mark and the ack, so an order ends shipped once or cancelled once,
never both. ``$SHOP_FULFILMENT_TIMEOUT`` (seconds, default an hour) bounds how long it waits.
"""

from __future__ import annotations

import os
from datetime import timedelta

import attrs

from example_services.shop.messages import (
    ORDERS_CANCELLED,
    ORDERS_SHIPPED,
    PAYMENTS_CAPTURED,
    PAYMENTS_FAILED,
    REFUND_PAYMENT,
    RELEASE_STOCK,
    SEND_EMAIL,
    STOCK_RESERVED,
    STOCK_SHORT,
    CancelKind,
    OrderCancelled,
    OrderShipped,
    PaymentCaptured,
    PaymentFailed,
    RefundPayment,
    ReleaseStock,
    SendEmail,
    StockReserved,
    StockShort,
)
from framework import SagaContext, Service


@attrs.define
class Fulfilment:
    """What the saga knows about one order."""

    paid_cents: int | None = None
    sku: str | None = None
    qty: int = 0
    reserved: bool = False


@attrs.frozen
class FulfilmentTimeout:
    order_id: str


def fulfilment_timeout() -> timedelta:
    """How long an order may wait for payment and stock (``$SHOP_FULFILMENT_TIMEOUT`` seconds)."""
    return timedelta(seconds=float(os.environ.get("SHOP_FULFILMENT_TIMEOUT", "3600")))


shipping = Service("shipping")
fulfilment = shipping.saga("fulfilment", state=Fulfilment)


def _customer_email(order_id: str) -> str:
    return f"customer+{order_id}@example.com"


def _progress(ctx: SagaContext[Fulfilment]) -> None:
    if ctx.is_new:  # the first message of this order starts the clock
        ctx.request_timeout(fulfilment_timeout(), FulfilmentTimeout(ctx.correlation))
    state = ctx.state
    if state.paid_cents is not None and state.reserved and state.sku is not None:
        ctx.publish(ORDERS_SHIPPED, OrderShipped(ctx.correlation, state.sku, state.qty), key=ctx.correlation)
        ctx.send(SEND_EMAIL, SendEmail(_customer_email(ctx.correlation), "Your order is on its way", ctx.correlation))
        ctx.complete()


def _cancel(ctx: SagaContext[Fulfilment], kind: CancelKind, reason: str, sku: str | None) -> None:
    """Compensate whatever may have happened, announce the cancellation, end the saga."""
    oid = ctx.correlation
    if kind != "declined":  # a declined card took no money; anything else may have
        ctx.send(REFUND_PAYMENT, RefundPayment(oid, reason), key=oid)
    if kind != "out_of_stock" and sku is not None:  # a shortage reserved nothing
        ctx.send(RELEASE_STOCK, ReleaseStock(oid, sku), key=sku)
    ctx.publish(ORDERS_CANCELLED, OrderCancelled(oid, kind, reason), key=oid)
    ctx.send(SEND_EMAIL, SendEmail(_customer_email(oid), f"Your order was cancelled: {reason}", oid))
    ctx.complete()


@fulfilment.event(PAYMENTS_CAPTURED, correlate=lambda e: e.order_id)
async def payment_captured(event: PaymentCaptured, ctx: SagaContext[Fulfilment]) -> None:
    """The money is in."""
    ctx.state.paid_cents, ctx.state.sku = event.amount_cents, event.sku
    _progress(ctx)


@fulfilment.event(STOCK_RESERVED, correlate=lambda e: e.order_id)
async def stock_reserved(event: StockReserved, ctx: SagaContext[Fulfilment]) -> None:
    """The goods are set aside."""
    ctx.state.sku, ctx.state.qty, ctx.state.reserved = event.sku, event.qty, True
    _progress(ctx)


@fulfilment.event(PAYMENTS_FAILED, correlate=lambda e: e.order_id)
async def payment_failed(event: PaymentFailed, ctx: SagaContext[Fulfilment]) -> None:
    """The card was declined: release the stock (reserved or not yet), cancel."""
    _cancel(ctx, "declined", event.reason, event.sku)


@fulfilment.event(STOCK_SHORT, correlate=lambda e: e.order_id)
async def stock_short(event: StockShort, ctx: SagaContext[Fulfilment]) -> None:
    """Not enough stock: refund (or void) the payment, cancel."""
    _cancel(ctx, "out_of_stock", f"only {event.available} {event.sku} left, {event.qty} ordered", event.sku)


@fulfilment.timeout
async def timed_out(timeout: FulfilmentTimeout, ctx: SagaContext[Fulfilment]) -> None:
    """Payment or stock never came: undo both, cancel."""
    missing = "payment" if ctx.state.paid_cents is None else "stock"  # the saga exists: one of them came
    seconds = fulfilment_timeout().total_seconds()
    _cancel(ctx, "timeout", f"{missing} not confirmed within {seconds:g} s", ctx.state.sku)

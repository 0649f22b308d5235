"""The shop's contract: its destinations and the payload of every message, shared by all services.

Events (topics) say what happened; commands (queues) ask one service to do something. Payloads are
attrs classes: typed, validated on decode, described in the AsyncAPI export. ``orders.placed`` is
keyed by SKU over four partitions, so each SKU's orders reach inventory in order, whichever worker
owns the partition.
"""

from __future__ import annotations

from typing import Literal

import attrs

from framework import Queue, Topic

ORDERS_PLACED = Topic("orders.placed", partitions=4)
PAYMENTS_CAPTURED = Topic("payments.captured", partitions=2)
PAYMENTS_FAILED = Topic("payments.failed", partitions=2)
PAYMENTS_REFUNDED = Topic("payments.refunded")
STOCK_RESERVED = Topic("stock.reserved", partitions=2)
STOCK_SHORT = Topic("stock.short", partitions=2)
ORDERS_SHIPPED = Topic("orders.shipped", partitions=2)
ORDERS_CANCELLED = Topic("orders.cancelled", partitions=2)

REFUND_PAYMENT = Queue("billing.refund")
RELEASE_STOCK = Queue("inventory.release", partitions=2)
SEND_EMAIL = Queue("notifications.email", partitions=2)

CancelKind = Literal["declined", "out_of_stock", "timeout"]


@attrs.frozen
class OrderPlaced:
    """An order was accepted (its row committed with this event, through the outbox)."""

    order_id: str
    customer: str
    sku: str
    qty: int
    amount_cents: int
    card: str


@attrs.frozen
class PaymentCaptured:
    order_id: str
    amount_cents: int
    sku: str


@attrs.frozen
class PaymentFailed:
    """The gateway declined the card: a business outcome, not an error."""

    order_id: str
    reason: str
    sku: str


@attrs.frozen
class PaymentRefunded:
    order_id: str
    amount_cents: int


@attrs.frozen
class StockReserved:
    order_id: str
    sku: str
    qty: int


@attrs.frozen
class StockShort:
    order_id: str
    sku: str
    qty: int
    available: int


@attrs.frozen
class OrderShipped:
    order_id: str
    sku: str
    qty: int


@attrs.frozen
class OrderCancelled:
    order_id: str
    kind: CancelKind
    reason: str


@attrs.frozen
class RefundPayment:
    """Compensation: give the money back if it was taken; never take it afterwards."""

    order_id: str
    reason: str


@attrs.frozen
class ReleaseStock:
    """Compensation: put reserved stock back; never reserve it afterwards."""

    order_id: str
    sku: str


@attrs.frozen
class SendEmail:
    to: str
    subject: str
    order_id: str | None = None

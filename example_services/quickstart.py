"""Two services of a shop in one module: the smallest complete example (the Kubernetes manifests run it).

The full example shop, one module per service, is ``example_services/shop/`` (``make demo``).

``orders`` takes ``PlaceOrder`` commands and publishes ``OrderPlaced`` events; ``billing`` charges
each order exactly once (its write commits with the inbox mark and the ack) and publishes
``PaymentCaptured``. A declined card is a fatal error: the order goes to billing's dead-letter
queue with the reason, at once, without retries.

Run them: ``framework run example_services.quickstart:orders example_services.quickstart:billing``.
"""

from __future__ import annotations

import os

import attrs

from framework import Context, Queue, RetryPolicy, Service, Topic

PLACE_ORDER = Queue("orders.place", partitions=2)
ORDERS_PLACED = Topic("orders.placed", partitions=2)
PAYMENTS_CAPTURED = Topic("payments.captured")
# The demo's own business data, kept under the deployment's namespace so runs never collide.
_NS = os.environ.get("FRAMEWORK_NAMESPACE") or "fw"
REVENUE_KEY = f"{_NS}:shop-demo:revenue"
CHARGES_KEY = f"{_NS}:shop-demo:charges"


@attrs.frozen
class PlaceOrder:
    order_id: str
    customer: str
    total_cents: int
    card: str


@attrs.frozen
class OrderPlaced:
    order_id: str
    customer: str
    total_cents: int
    card: str


@attrs.frozen
class PaymentCaptured:
    order_id: str
    amount_cents: int


class PaymentDeclined(Exception):
    """The card was refused: retrying cannot help."""


orders = Service("orders")


@orders.command(PLACE_ORDER, key=lambda c: c.customer)
async def place_order(cmd: PlaceOrder, ctx: Context) -> None:
    """Accept an order and announce it."""
    if cmd.total_cents <= 0:
        raise ValueError(f"order {cmd.order_id} has a non-positive total")
    ctx.publish(ORDERS_PLACED, OrderPlaced(cmd.order_id, cmd.customer, cmd.total_cents, cmd.card), key=cmd.order_id)


billing = Service("billing", retry=RetryPolicy(max_attempts=5, backoff=0.2, fatal=(PaymentDeclined,)))


@billing.event(ORDERS_PLACED)
async def charge(event: OrderPlaced, ctx: Context) -> None:
    """Charge the customer once, however often the event is delivered."""
    if event.card.endswith("0002"):
        raise PaymentDeclined(f"card ending {event.card[-4:]} declined for order {event.order_id}")
    tx = ctx.redis_transaction()  # applied with the inbox mark and the ack, or not at all
    tx.hincrby(REVENUE_KEY, event.customer, event.total_cents)
    tx.hincrby(CHARGES_KEY, event.order_id, 1)
    ctx.publish(PAYMENTS_CAPTURED, PaymentCaptured(event.order_id, event.total_cents))

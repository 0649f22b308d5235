"""billing: charges each order exactly once and refunds cancelled ones.

* ``orders.placed`` -> the charge. Its rows commit with this message's inbox record in one
  database transaction (``ctx.sql_transaction``), and the ``payments.*`` event it publishes goes
  to the outbox in that same transaction: a redelivered or duplicated event charges nothing twice.
* The simulated gateway fails now and then with :class:`GatewayUnavailable`, a transient error the
  service's :class:`~framework.RetryPolicy` retries with exponential backoff and full jitter.
* A declined card is a business outcome: ``payments.failed`` with the gateway's reason.
* A card number that fails the Luhn check is a bug upstream, not something a retry can fix:
  :class:`InvalidCard` is fatal, and the order goes to billing's dead-letter queue at once, with
  the reason (``framework dlq list``). Nothing is published for it; shipping cancels the order when
  its fulfilment times out.
* ``billing.refund`` (a compensation shipping sends) refunds a charge, or voids the order first so
  a charge arriving later is never taken.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator

from sqlalchemy import insert, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from example_services.shop import db
from example_services.shop.messages import (
    ORDERS_PLACED,
    PAYMENTS_CAPTURED,
    PAYMENTS_FAILED,
    PAYMENTS_REFUNDED,
    REFUND_PAYMENT,
    OrderPlaced,
    PaymentCaptured,
    PaymentFailed,
    PaymentRefunded,
    RefundPayment,
)
from framework import Context, RetryPolicy, Service


class GatewayUnavailable(Exception):
    """The payment gateway timed out or answered 503: try again later."""


class InvalidCard(Exception):
    """The card number is malformed: no retry can help (fatal, dead-lettered with this reason)."""


DECLINES = {"0002": "insufficient funds", "0119": "card reported stolen", "0127": "expired card"}
"""Card endings the simulated gateway declines, with its reason (as test cards at real gateways)."""


def luhn_ok(card: str) -> bool:
    """Whether ``card`` (digits, dashes and spaces allowed) passes the Luhn checksum."""
    digits = [int(c) for c in card if c.isdigit()]
    if len(digits) < 12 or len(digits) != sum(c.isalnum() for c in card):
        return False
    total = 0
    for i, d in enumerate(reversed(digits)):
        total += d if i % 2 == 0 else (d * 2 - 9 if d * 2 > 9 else d * 2)
    return total % 10 == 0


def flaky(seed: str, attempt: int, rate: float) -> bool:
    """Deterministic "random" failure: the same message and attempt always fail or pass alike.

    Only the first two attempts can fail, so every message gets through within the retry budget.
    """
    if attempt > 2 or rate <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(f"{seed}:{attempt}".encode(), digest_size=4).digest(), "big")
    return h / 2**32 < rate


def gateway_charge(order: OrderPlaced, attempt: int) -> str | None:
    """The simulated gateway: None when captured, else the decline reason; may raise GatewayUnavailable."""
    if flaky(order.order_id, attempt, float(os.environ.get("SHOP_GATEWAY_FLAKINESS", "0.05"))):
        raise GatewayUnavailable(f"payment gateway timed out charging order {order.order_id}")
    return DECLINES.get(order.card[-4:])


billing = Service(
    "billing",
    # 5 attempts: one immediate retry, then 0.05 s, 0.1 s, 0.2 s backoff caps with full jitter
    retry=RetryPolicy(max_attempts=5, backoff=0.05, max_delay=2.0, jitter=True, fatal=(InvalidCard,)),
)


@billing.resource
async def database() -> AsyncIterator[AsyncEngine]:
    """The billing database engine, one per worker process."""
    async for engine in db.database_resource():
        yield engine


async def _claim(conn: AsyncConnection, order_id: str, state: str, amount: int) -> bool:
    """Insert the order's payment row; False when one exists (a refund voided it first)."""
    row = await conn.execute(
        text(
            "INSERT INTO billing_payments (order_id, state, amount_cents) VALUES (:o, :s, :a) "
            "ON CONFLICT (order_id) DO NOTHING RETURNING order_id"
        ),
        {"o": order_id, "s": state, "a": amount},
    )
    return row.first() is not None


@billing.event(ORDERS_PLACED)
async def charge(order: OrderPlaced, ctx: Context) -> None:
    """Charge the order once, however often its event is delivered."""
    if not luhn_ok(order.card):
        raise InvalidCard(f"card number of order {order.order_id} fails the Luhn check")
    # The gateway call cannot join the transaction: a real one takes the order id as its idempotency
    # key (Stripe's Idempotency-Key, say), so a retried or redelivered message is never charged twice
    # there; the charge row below commits with this message's inbox record.
    declined = gateway_charge(order, ctx.attempt)  # raises GatewayUnavailable: retried with backoff
    async with ctx.sql_transaction(ctx.resources[database]) as conn:
        if not await _claim(conn, order.order_id, "declined" if declined else "charged", order.amount_cents):
            return  # voided by a refund that overtook this event: never charge it
        if declined:
            await conn.execute(
                text("UPDATE billing_payments SET reason = :r WHERE order_id = :o"),
                {"r": declined, "o": order.order_id},
            )
            ctx.publish(
                PAYMENTS_FAILED,
                PaymentFailed(order.order_id, f"card declined: {declined}", order.sku),
                key=order.order_id,
            )
            return
        await conn.execute(
            insert(db.charges).values(
                order_id=order.order_id, amount_cents=order.amount_cents, card_last4=order.card[-4:]
            )
        )
        ctx.publish(
            PAYMENTS_CAPTURED, PaymentCaptured(order.order_id, order.amount_cents, order.sku), key=order.order_id
        )


@billing.command(REFUND_PAYMENT)
async def refund(cmd: RefundPayment, ctx: Context) -> None:
    """Give a charge back, or void the order so that it is never charged."""
    async with ctx.sql_transaction(ctx.resources[database]) as conn:
        if await _claim(conn, cmd.order_id, "voided", 0):
            return
        row = (
            await conn.execute(
                text(
                    "UPDATE billing_payments SET state = 'refunded', reason = :r "
                    "WHERE order_id = :o AND state = 'charged' RETURNING amount_cents"
                ),
                {"o": cmd.order_id, "r": cmd.reason},
            )
        ).first()
        if row is not None:
            await conn.execute(insert(db.refunds).values(order_id=cmd.order_id, amount_cents=row[0]))
            ctx.publish(PAYMENTS_REFUNDED, PaymentRefunded(cmd.order_id, row[0]), key=cmd.order_id)

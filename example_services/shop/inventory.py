"""inventory: reserves stock for each order, per SKU in order, never below zero.

``orders.placed`` is keyed by SKU over four partitions; with partition ownership each partition is
handled by one worker at a time (leases, fencing), so one SKU's orders are reserved in the order
they were placed even with several inventory workers, through kills and pauses. A reservation
commits with the message's inbox record (``ctx.sql_transaction``); the stock column has a CHECK
constraint and the decrement is conditional, so stock can never go negative. ``inventory.release``
(a compensation shipping sends) puts a reservation back, or marks the order released first so a
reservation arriving later is never made.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from example_services.shop import db
from example_services.shop.messages import (
    ORDERS_PLACED,
    RELEASE_STOCK,
    STOCK_RESERVED,
    STOCK_SHORT,
    OrderPlaced,
    ReleaseStock,
    StockReserved,
    StockShort,
)
from framework import Context, RetryPolicy, Service

inventory = Service("inventory", retry=RetryPolicy(max_attempts=5, backoff=0.05, max_delay=1.0))


@inventory.resource
async def database() -> AsyncIterator[AsyncEngine]:
    """The inventory database engine, one per worker process."""
    async for engine in db.database_resource():
        yield engine


_CLAIM = text(
    "INSERT INTO inventory_reservations (order_id, sku, qty, state) VALUES (:o, :s, :q, :state) "
    "ON CONFLICT (order_id) DO NOTHING RETURNING order_id"
)


@inventory.event(ORDERS_PLACED, key=lambda order: order.sku)
async def reserve(order: OrderPlaced, ctx: Context) -> None:
    """Reserve the order's items if there are enough; say which happened."""
    async with ctx.sql_transaction(ctx.resources[database]) as conn:
        params = {"o": order.order_id, "s": order.sku, "q": order.qty}
        if (await conn.execute(_CLAIM, {**params, "state": "reserved"})).first() is None:
            return  # released before it arrived: the order is cancelled already
        taken = await conn.execute(
            text("UPDATE inventory_stock SET available = available - :q WHERE sku = :s AND available >= :q"), params
        )
        if taken.rowcount == 1:
            ctx.publish(STOCK_RESERVED, StockReserved(order.order_id, order.sku, order.qty), key=order.order_id)
            return
        await conn.execute(text("UPDATE inventory_reservations SET state = 'short' WHERE order_id = :o"), params)
        left = (await conn.execute(text("SELECT available FROM inventory_stock WHERE sku = :s"), params)).scalar()
        ctx.publish(STOCK_SHORT, StockShort(order.order_id, order.sku, order.qty, int(left or 0)), key=order.order_id)


@inventory.command(RELEASE_STOCK, key=lambda cmd: cmd.sku)
async def release(cmd: ReleaseStock, ctx: Context) -> None:
    """Put the order's reservation back, or block a reservation that has not arrived yet."""
    async with ctx.sql_transaction(ctx.resources[database]) as conn:
        params = {"o": cmd.order_id, "s": cmd.sku, "q": 0}
        if (await conn.execute(_CLAIM, {**params, "state": "released"})).first() is not None:
            return
        row = (
            await conn.execute(
                text(
                    "UPDATE inventory_reservations SET state = 'released' "
                    "WHERE order_id = :o AND state = 'reserved' RETURNING sku, qty"
                ),
                params,
            )
        ).first()
        if row is not None:
            await conn.execute(
                text("UPDATE inventory_stock SET available = available + :q WHERE sku = :s"), {"q": row[1], "s": row[0]}
            )

"""The shop's tables (one database, each service owning its own tables) and how services open it.

A real deployment would give each service its own schema or database; one database keeps the demo
small, and no service reads another's tables (the demo's ledger does, to check them). Every table
is created by :func:`prepare` with the outbox's (use migrations in a real service).
``$DATABASE_URL`` picks the database (PostgreSQL, else the SQLite default of :mod:`framework.outbox`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Identity,
    Integer,
    MetaData,
    String,
    Table,
    func,
    insert,
    text,
)
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from framework import outbox

metadata = MetaData()

# orders: the row the API writes, moved along by the events the other services publish
orders = Table(
    "shop_orders",
    metadata,
    Column("id", String, primary_key=True),
    Column("customer", String, nullable=False),
    Column("sku", String, nullable=False),
    Column("qty", Integer, nullable=False),
    Column("amount_cents", BigInteger, nullable=False),
    Column("status", String, nullable=False, default="placed"),  # placed, shipped, declined, cancelled
    Column("reason", String),
    Column("paid", Boolean, nullable=False, default=False),
    Column("reserved", Boolean, nullable=False, default=False),
    Column("created_at", DateTime(timezone=True), server_default=func.now()),
)

# billing: one row per order (charged, declined, voided, refunded) and the gateway's append-only log
payments = Table(
    "billing_payments",
    metadata,
    Column("order_id", String, primary_key=True),
    Column("state", String, nullable=False),
    Column("amount_cents", BigInteger, nullable=False),
    Column("reason", String),
)
charges = Table(  # deliberately no unique constraint: the ledger proves the inbox kept it to one per order
    "billing_charges",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), Identity(), primary_key=True),
    Column("order_id", String, nullable=False),
    Column("amount_cents", BigInteger, nullable=False),
    Column("card_last4", String, nullable=False),
    Column("charged_at", DateTime(timezone=True), server_default=func.now()),
)
refunds = Table(
    "billing_refunds",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), Identity(), primary_key=True),
    Column("order_id", String, nullable=False),
    Column("amount_cents", BigInteger, nullable=False),
)

# inventory: stock that can never go below zero, and one reservation row per order
stock = Table(
    "inventory_stock",
    metadata,
    Column("sku", String, primary_key=True),
    Column("available", Integer, nullable=False),
    CheckConstraint("available >= 0", name="stock_never_negative"),
)
reservations = Table(
    "inventory_reservations",
    metadata,
    Column("order_id", String, primary_key=True),
    Column("sku", String, nullable=False),
    Column("qty", Integer, nullable=False),
    Column("state", String, nullable=False),  # reserved, short, released
)

# notifications: every e-mail sent (exactly once per command) and the daily digests
emails = Table(
    "notifications_emails",
    metadata,
    Column("message_id", String, primary_key=True),
    Column("recipient", String, nullable=False),
    Column("subject", String, nullable=False),
    Column("order_id", String),
)
digests = Table(
    "notifications_digests",
    metadata,
    Column("day", String, primary_key=True),
    Column("orders", Integer, nullable=False),
    Column("shipped", Integer, nullable=False),
)

CATALOGUE: dict[str, int] = {  # SKU -> price in cents
    "mug": 1_250,
    "tee": 2_400,
    "cap": 1_800,
    "hoodie": 5_900,
    "socks": 900,
    "poster": 1_500,
    "sticker": 300,
    "bottle": 2_100,
}


def open_engine(url: str | None = None) -> AsyncEngine:
    """The shop's engine: ``url``, else ``$DATABASE_URL``, else the SQLite default."""
    return outbox.create_engine(url)


async def prepare(engine: AsyncEngine) -> None:
    """Create the shop's tables and the framework's (outbox, SQL inbox, saga state); idempotent."""
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
    await outbox.create_tables(engine)


async def database_resource(url: str | None = None) -> AsyncIterator[AsyncEngine]:
    """Body of each service's ``@svc.resource``: one engine per worker process, disposed after the drain.

    It runs no DDL: create the tables once before starting workers (:func:`prepare`, or
    ``python -m example_services.shop.db``); DDL racing with live workers can deadlock them."""
    engine = open_engine(url)
    try:
        yield engine
    finally:
        await engine.dispose()


async def set_stock(conn: AsyncConnection, levels: dict[str, int]) -> None:
    """Set the stock of each SKU (inserting missing SKUs): what a warehouse feed would do."""
    for sku, available in levels.items():
        changed = await conn.execute(
            text("UPDATE inventory_stock SET available = :a WHERE sku = :s"), {"a": available, "s": sku}
        )
        if changed.rowcount == 0:
            await conn.execute(insert(stock).values(sku=sku, available=available))


def main() -> None:
    """``python -m example_services.shop.db``: create the tables on ``$DATABASE_URL`` (idempotent)."""
    import anyio

    async def go() -> None:
        engine = open_engine()
        try:
            await prepare(engine)
        finally:
            await engine.dispose()

    anyio.run(go)
    print("the shop's tables are ready")


if __name__ == "__main__":
    main()

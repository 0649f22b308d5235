"""A web producer and its consumer: a FastAPI app that takes orders, and the service that ships them.

The app (``create_app``) opens a database engine and a framework :class:`~framework.Client` once,
in its lifespan, and closes them on exit. ``POST /orders`` writes the order row, reserves stock and
adds the ``OrderPlaced`` event to the outbox in *one* database transaction, the request's: the
event exists if and only if the order committed. A relay publishes it after the commit
(``framework outbox relay``, or ``framework run ... --outbox-relay``). ``POST /orders/{id}/reminders``
needs no row: it publishes straight through the lifespan's client, with the request's
``Idempotency-Key`` so a retried request is published once.

``fulfilment`` consumes the events; its database engine is a service resource, opened once per
worker process and closed after the drain, and its shipment rows commit with its inbox record
(``ctx.sql_transaction``). Payloads are Pydantic models, as the request bodies are.

Run it (PostgreSQL or the SQLite default; needs ``pip install 'framework[sql,web]' uvicorn``)::

    framework outbox migrate
    uvicorn example_services.web_orders:app &
    framework run example_services.web_orders:fulfilment --outbox-relay &
    curl -X PUT localhost:8000/stock/A -H 'content-type: application/json' -d '{"available": 5}'
    curl -X POST localhost:8000/orders -H 'content-type: application/json' \\
         -d '{"order_id": "o-1", "sku": "A", "qty": 2}'
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, Header, HTTPException, Request
from pydantic import BaseModel, Field
from sqlalchemy import Column, Integer, MetaData, String, Table, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from framework import Client, Context, Queue, Service, Topic, outbox

ORDERS_PLACED = Topic("web.orders.placed", partitions=2)
REMINDERS = Queue("web.reminders")

metadata = MetaData()
orders = Table(
    "web_orders",
    metadata,
    Column("id", String, primary_key=True),
    Column("sku", String, nullable=False),
    Column("qty", Integer, nullable=False),
)
stock = Table("web_stock", metadata, Column("sku", String, primary_key=True), Column("available", Integer))
shipments = Table("web_shipments", metadata, Column("order_id", String, primary_key=True), Column("sku", String))


class PlaceOrder(BaseModel):
    """The body of ``POST /orders``."""

    order_id: str = Field(min_length=1)
    sku: str
    qty: int = Field(gt=0)


class Restock(BaseModel):
    """The body of ``PUT /stock/{sku}``."""

    available: int = Field(ge=0)


class OrderPlaced(BaseModel):
    """The event the outbox carries to ``web.orders.placed``."""

    order_id: str
    sku: str
    qty: int


class Remind(BaseModel):
    """The command ``POST /orders/{id}/reminders`` sends."""

    order_id: str


async def _prepare(engine: AsyncEngine) -> None:
    """Create the example's tables and the outbox's (use migrations in a real app)."""
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
    await outbox.create_tables(engine)


def create_app(database_url: str | None = None, broker_url: str | None = None, namespace: str | None = None) -> FastAPI:
    """The web app; ``None`` arguments mean ``$DATABASE_URL`` (else SQLite), ``$REDIS_URL`` and the namespace."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        engine = outbox.create_engine(database_url)  # one pool per process, not one per request
        await _prepare(engine)
        try:
            async with Client(broker_url, namespace=namespace) as client:  # connected once, closed on exit
                yield {"engine": engine, "client": client}  # request.state.engine, request.state.client
        finally:
            await engine.dispose()

    app = FastAPI(title="web orders", lifespan=lifespan)

    @app.put("/stock/{sku}")
    async def restock(sku: str, body: Restock, request: Request) -> dict[str, int]:
        engine: AsyncEngine = request.state.engine
        async with engine.begin() as conn:
            changed = await conn.execute(update(stock).where(stock.c.sku == sku).values(available=body.available))
            if changed.rowcount == 0:
                await conn.execute(insert(stock).values(sku=sku, available=body.available))
        return {"available": body.available}

    @app.post("/orders", status_code=201)
    async def place_order(body: PlaceOrder, request: Request) -> dict[str, str]:
        engine: AsyncEngine = request.state.engine
        try:
            # The request's transaction: committed before the response is sent, or rolled back whole.
            async with engine.begin() as conn:
                await conn.execute(insert(orders).values(id=body.order_id, sku=body.sku, qty=body.qty))
                event = OrderPlaced(order_id=body.order_id, sku=body.sku, qty=body.qty)
                message_id = await outbox.add_event(conn, ORDERS_PLACED, event, key=body.order_id)
                reserved = await conn.execute(
                    update(stock)
                    .where(stock.c.sku == body.sku, stock.c.available >= body.qty)
                    .values(available=stock.c.available - body.qty)
                )
                if reserved.rowcount == 0:  # raising inside the block rolls back the order and its event
                    raise HTTPException(409, f"not enough {body.sku} in stock for {body.qty}")
        except IntegrityError:
            raise HTTPException(409, f"order {body.order_id} exists already") from None
        return {"order_id": body.order_id, "message_id": message_id}

    @app.post("/orders/{order_id}/reminders", status_code=202)
    async def remind(
        order_id: str, request: Request, idempotency_key: Annotated[str | None, Header()] = None
    ) -> dict[str, str | None]:
        client: Client = request.state.client
        async with request.state.engine.connect() as conn:
            if (await conn.execute(select(orders.c.id).where(orders.c.id == order_id))).first() is None:
                raise HTTPException(404, f"no order {order_id}")
        # No row to commit with: publish directly. A retried request with the same key is a no-op (None).
        message_id = await client.send(REMINDERS, Remind(order_id=order_id), idempotency_key=idempotency_key)
        return {"message_id": message_id}

    return app


app = create_app()
"""The app for ``uvicorn example_services.web_orders:app`` (configured by the environment)."""


fulfilment = Service("web-fulfilment")


@fulfilment.resource
async def database() -> AsyncIterator[AsyncEngine]:
    """The service's engine: opened once per worker process, disposed after the drain."""
    engine = outbox.create_engine()  # $DATABASE_URL, else the SQLite default
    await _prepare(engine)
    yield engine
    await engine.dispose()


@fulfilment.event(ORDERS_PLACED, key=lambda e: e.order_id)
async def ship(event: OrderPlaced, ctx: Context) -> None:
    """Record the shipment exactly once: the row commits with this message's inbox record."""
    async with ctx.sql_transaction(ctx.resources[database]) as conn:
        await conn.execute(insert(shipments).values(order_id=event.order_id, sku=event.sku))


@fulfilment.command(REMINDERS)
async def remind_customer(cmd: Remind, ctx: Context) -> None:
    """Stands for an e-mail to the customer."""
    ctx.publish("web.reminders.sent", cmd)

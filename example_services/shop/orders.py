"""orders: the shop's HTTP API (Starlette on uvicorn) and the service that keeps each order's state.

``POST /orders`` writes the order row and its ``orders.placed`` event in *one* database
transaction through the outbox (:func:`framework.outbox.add_event`): the event exists if and only
if the order committed, and a relay (``framework outbox relay``) publishes it. ``GET /orders/{id}``
shows the order as the other services move it; ``GET /orders`` counts orders per status.

The ``orders`` service follows the outcome events (payment, stock, shipped, cancelled) and updates
the row, each update committed with its inbox record. Run::

    python -m example_services.shop.db      # the tables, once (the shop's and the outbox's)
    uvicorn example_services.shop.orders:app --port 8000 &
    framework run example_services.shop.orders:orders &
    curl -X POST localhost:8000/orders -H 'content-type: application/json' \\
         -d '{"customer": "ada", "sku": "mug", "qty": 1, "card": "4242-4242-4242-4242"}'
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from example_services.shop import db
from example_services.shop.messages import (
    ORDERS_CANCELLED,
    ORDERS_PLACED,
    ORDERS_SHIPPED,
    PAYMENTS_CAPTURED,
    STOCK_RESERVED,
    OrderCancelled,
    OrderPlaced,
    OrderShipped,
    PaymentCaptured,
    StockReserved,
)
from framework import Context, Service, outbox

FINAL = ("shipped", "declined", "cancelled")


class BadOrder(ValueError):
    """The request body is not a valid order (the message says which field)."""


def parse_order(body: Any) -> dict[str, Any]:
    """Validate a ``POST /orders`` body: ``customer``, ``sku`` (in the catalogue), ``qty`` > 0, ``card``."""
    if not isinstance(body, dict):
        raise BadOrder("the body must be a JSON object")
    for name in ("customer", "sku", "card"):
        if not isinstance(body.get(name), str) or not body[name]:
            raise BadOrder(f"field {name!r} must be a non-empty string")
    if body["sku"] not in db.CATALOGUE:
        raise BadOrder(f"unknown sku {body['sku']!r}; known: {', '.join(sorted(db.CATALOGUE))}")
    qty = body.get("qty")
    if not isinstance(qty, int) or isinstance(qty, bool) or not 0 < qty <= 100:
        raise BadOrder("field 'qty' must be an integer from 1 to 100")
    order_id = body.get("order_id") or f"{body['sku']}-{uuid.uuid4().hex[:12]}"
    return {**body, "order_id": str(order_id), "amount_cents": db.CATALOGUE[body["sku"]] * qty}


def create_app(database_url: str | None = None, *, create_tables: bool = False) -> Starlette:
    """The API; ``database_url`` defaults to ``$DATABASE_URL`` (else SQLite). The broker is not needed:
    events leave through the outbox. ``create_tables`` creates the tables at start (tests; in
    production run ``python -m example_services.shop.db`` once, before the workers)."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        engine = db.open_engine(database_url)  # one pool per process, not one per request
        if create_tables:
            await db.prepare(engine)
        try:
            yield {"engine": engine}  # request.state.engine
        finally:
            await engine.dispose()

    async def place(request: Request) -> JSONResponse:
        try:
            order = parse_order(await request.json())
        except ValueError as exc:  # BadOrder, or a body that is not JSON
            return JSONResponse({"error": str(exc)}, status_code=422)
        engine: AsyncEngine = request.state.engine
        event = OrderPlaced(
            order["order_id"], order["customer"], order["sku"], order["qty"], order["amount_cents"], order["card"]
        )
        try:
            async with engine.begin() as conn:  # the row and its event: both or neither
                await conn.execute(
                    insert(db.orders).values(
                        id=event.order_id,
                        customer=event.customer,
                        sku=event.sku,
                        qty=event.qty,
                        amount_cents=event.amount_cents,
                        status="placed",
                    )
                )
                await outbox.add_event(conn, ORDERS_PLACED, event, key=event.sku)  # keyed by SKU: inventory's order
        except IntegrityError:
            return JSONResponse({"error": f"order {event.order_id} exists already"}, status_code=409)
        return JSONResponse({"order_id": event.order_id, "amount_cents": event.amount_cents}, status_code=201)

    async def show(request: Request) -> JSONResponse:
        async with request.state.engine.connect() as conn:
            row = (
                await conn.execute(select(db.orders).where(db.orders.c.id == request.path_params["order_id"]))
            ).first()
        if row is None:
            return JSONResponse({"error": f"no order {request.path_params['order_id']}"}, status_code=404)
        found = dict(row._mapping)
        found["created_at"] = found["created_at"].isoformat() if found["created_at"] else None
        return JSONResponse(found)

    async def summary(request: Request) -> JSONResponse:
        async with request.state.engine.connect() as conn:
            rows = await conn.execute(select(db.orders.c.status, func.count()).group_by(db.orders.c.status))
            return JSONResponse({status: n for status, n in rows})

    routes = [
        Route("/orders", place, methods=["POST"]),
        Route("/orders", summary, methods=["GET"]),
        Route("/orders/{order_id}", show, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


app = create_app()
"""The app for ``uvicorn example_services.shop.orders:app`` (configured by ``$DATABASE_URL``)."""


orders = Service("orders")


@orders.resource
async def database() -> AsyncIterator[AsyncEngine]:
    """The orders database engine, one per worker process."""
    async for engine in db.database_resource():
        yield engine


async def _set(ctx: Context, order_id: str, *, final: bool = False, **values: Any) -> None:
    """Update the order's row with this message's inbox record. Events on different topics arrive in
    any order: a flag (paid, reserved) is always recorded, a final status never overwrites another."""
    where = [db.orders.c.id == order_id]
    if final:
        where.append(db.orders.c.status.not_in(FINAL))
    async with ctx.sql_transaction(ctx.resources[database]) as conn:
        await conn.execute(update(db.orders).where(*where).values(**values))


@orders.event(PAYMENTS_CAPTURED)
async def paid(event: PaymentCaptured, ctx: Context) -> None:
    """The payment went through."""
    await _set(ctx, event.order_id, paid=True)


@orders.event(STOCK_RESERVED)
async def reserved(event: StockReserved, ctx: Context) -> None:
    """The goods are reserved."""
    await _set(ctx, event.order_id, reserved=True)


@orders.event(ORDERS_SHIPPED)
async def shipped(event: OrderShipped, ctx: Context) -> None:
    """Final: shipped."""
    await _set(ctx, event.order_id, final=True, status="shipped", reason=None)


@orders.event(ORDERS_CANCELLED)
async def cancelled(event: OrderCancelled, ctx: Context) -> None:
    """Final: declined or cancelled, with the reason."""
    status = "declined" if event.kind == "declined" else "cancelled"
    await _set(ctx, event.order_id, final=True, status=status, reason=event.reason)

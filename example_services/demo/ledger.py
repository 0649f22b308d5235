"""The demo's ledger: every number read back from the shop's tables, the broker and Spark, and checked."""

from __future__ import annotations

from typing import Any

import attrs
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from broker import connect
from framework.dead_letters import DeadLetters


@attrs.frozen
class Check:
    name: str
    value: str
    ok: bool


async def _one(conn: AsyncConnection, sql: str) -> Any:
    return (await conn.execute(text(sql))).one()


async def progress(conn: AsyncConnection) -> dict[str, int]:
    """Counts for the live view: orders per status, charges, reservations, the outbox backlog."""
    found = {
        status: n for status, n in await conn.execute(text("SELECT status, count(*) FROM shop_orders GROUP BY status"))
    }
    found["charged"] = (await _one(conn, "SELECT count(*) FROM billing_charges"))[0]
    found["stock_decided"] = (
        await _one(conn, "SELECT count(*) FROM inventory_reservations WHERE state != 'released' OR qty > 0")
    )[0]
    found["outbox"] = (await _one(conn, "SELECT count(*) FROM framework_outbox"))[0]
    found["emails"] = (await _one(conn, "SELECT count(*) FROM notifications_emails"))[0]
    return found


async def dead_letters(broker_url: str, namespace: str) -> dict[str, list[Any]]:
    """The dead letters per consumer group."""
    broker = await connect(broker_url, namespace=namespace)
    try:
        found: dict[str, list[Any]] = {}
        for d in await DeadLetters(broker).list():
            found.setdefault(d.group, []).append(d)
        return found
    finally:
        await broker.close()


async def checks(
    conn: AsyncConnection,
    *,
    accepted: int,
    invalid_cards: int,
    malformed: int,
    stock: dict[str, int],
    dead: dict[str, list[Any]],
    spark_revenue: int | None,
) -> tuple[list[Check], dict[str, Any]]:
    """The checks the demo asserts, and the figures behind them."""
    by_status: dict[str, int] = dict(
        list(await conn.execute(text("SELECT status, count(*) FROM shop_orders GROUP BY status")))
    )
    kinds: dict[str, int] = dict(
        list(
            await conn.execute(
                text(
                    "SELECT CASE WHEN reason LIKE 'card declined%' THEN 'declined' WHEN reason LIKE 'only %' "
                    "THEN 'out of stock' WHEN reason LIKE '%within%' THEN 'timeout' ELSE coalesce(reason, '-') END, "
                    "count(*) FROM shop_orders WHERE status != 'shipped' GROUP BY 1"
                )
            )
        )
    )
    rows, final, no_reason = await _one(
        conn,
        "SELECT count(*), count(*) FILTER (WHERE status IN ('shipped', 'declined', 'cancelled')), "
        "count(*) FILTER (WHERE status != 'shipped' AND reason IS NULL) FROM shop_orders",
    )
    twice = (
        await _one(
            conn, "SELECT count(*) FROM (SELECT order_id FROM billing_charges GROUP BY order_id HAVING count(*) > 1) t"
        )
    )[0]
    charged_cents = (await _one(conn, "SELECT coalesce(sum(amount_cents), 0) FROM billing_charges"))[0]
    refunded_cents = (await _one(conn, "SELECT coalesce(sum(amount_cents), 0) FROM billing_refunds"))[0]
    shipped_unpaid, cancelled_kept = await _one(
        conn,
        "SELECT count(*) FILTER (WHERE o.status = 'shipped' AND (c.n IS NULL OR r.n IS NOT NULL)), "
        "count(*) FILTER (WHERE o.status != 'shipped' AND c.n IS NOT NULL AND r.n IS NULL) FROM shop_orders o "
        "LEFT JOIN (SELECT order_id, count(*) n FROM billing_charges GROUP BY order_id) c ON c.order_id = o.id "
        "LEFT JOIN (SELECT order_id, count(*) n FROM billing_refunds GROUP BY order_id) r ON r.order_id = o.id",
    )
    levels: dict[str, int] = dict(list(await conn.execute(text("SELECT sku, available FROM inventory_stock"))))
    shipped_qty: dict[str, int] = dict(
        list(await conn.execute(text("SELECT sku, sum(qty) FROM shop_orders WHERE status = 'shipped' GROUP BY sku")))
    )
    stock_ok = all(levels[s] == stock[s] - int(shipped_qty.get(s, 0)) for s in stock)
    emails, email_orders = await _one(conn, "SELECT count(*), count(DISTINCT order_id) FROM notifications_emails")
    # distinct message ids: the relay publishes at least once, and a copy of a dead-lettered message
    # (which no inbox recorded as processed) is dead-lettered again
    billing_dead = {d.message_id for d in dead.get("billing", []) if "InvalidCard" in d.error_type}
    mail_dead = {d.message_id for d in dead.get("notifications", [])}
    shipped = by_status.get("shipped", 0)
    result = [
        Check("orders accepted by the API = rows", f"{accepted} / {rows}", accepted == rows),
        Check("every order shipped, declined or cancelled", f"{final} / {rows}", final == rows),
        Check("every order not shipped has its reason", f"{no_reason} without", no_reason == 0),
        Check("no card charged twice", f"{twice} charged twice", twice == 0),
        Check("every shipped order paid, once", f"{shipped_unpaid} unpaid", shipped_unpaid == 0),
        Check("every cancelled charge refunded", f"{cancelled_kept} kept", cancelled_kept == 0),
        Check("stock never negative", f"lowest {min(levels.values())}", min(levels.values()) >= 0),
        Check("stock = initial - shipped, per SKU", "yes" if stock_ok else "no", stock_ok),
        Check("one e-mail per order", f"{emails} / {rows}", emails == email_orders == rows),
        Check(
            "invalid cards in billing's DLQ",
            f"{len(billing_dead)} / {invalid_cards}",
            len(billing_dead) == invalid_cards,
        ),
        Check(
            "malformed e-mails in notifications' DLQ", f"{len(mail_dead)} / {malformed}", len(mail_dead) == malformed
        ),
    ]
    if spark_revenue is not None:
        result.append(
            Check(
                "Spark's revenue = captured payments",
                f"{spark_revenue} / {charged_cents} cents",
                spark_revenue == charged_cents,
            )
        )
    figures = {
        "by_status": by_status,
        "reasons": kinds,
        "shipped": shipped,
        "charged_cents": charged_cents,
        "refunded_cents": refunded_cents,
        "stock": levels,
        "dead": {g: ds[:1] for g, ds in dead.items()},
    }
    return result, figures

"""The FastAPI producer example (example_services/web_orders.py) on real servers: the outbox row
commits with the request's transaction and is absent when it rolls back, the relay publishes it,
and the consumer (a service with a database resource) ships the order once."""

from __future__ import annotations

import psycopg
import pytest

pytest.importorskip("fastapi")
import anyio
from fastapi.testclient import TestClient

from framework.sql import libpq_url
from framework.testing import ServiceHarness

pytestmark = pytest.mark.postgres


def _rows(url: str, query: str) -> list[tuple[object, ...]]:
    with psycopg.connect(libpq_url(url)) as conn:
        return list(conn.execute(query).fetchall())


def test_the_outbox_commits_with_the_request_and_the_relay_delivers_it(
    pg_url: str, redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from example_services import web_orders

    app = web_orders.create_app(database_url=pg_url, broker_url=redis_url, namespace=namespace)
    with TestClient(app) as http:  # runs the app's lifespan: engine and Client opened once
        assert http.put("/stock/A", json={"available": 3}).status_code == 200
        placed = http.post("/orders", json={"order_id": "o-1", "sku": "A", "qty": 2})
        assert placed.status_code == 201, placed.text
        message_id = placed.json()["message_id"]
        # the order and its event were written; then the stock check failed: both rolled back
        refused = http.post("/orders", json={"order_id": "o-2", "sku": "A", "qty": 2})
        assert refused.status_code == 409 and "not enough A in stock" in refused.text
        again = http.post("/orders", json={"order_id": "o-1", "sku": "A", "qty": 1})
        assert again.status_code == 409 and "exists already" in again.text
        invalid = http.post("/orders", json={"order_id": "o-3", "sku": "A", "qty": 0})
        assert invalid.status_code == 422
        reminder = http.post("/orders/o-1/reminders", headers={"Idempotency-Key": "remind-o-1"})
        retried = http.post("/orders/o-1/reminders", headers={"Idempotency-Key": "remind-o-1"})
        assert reminder.status_code == retried.status_code == 202
        assert reminder.json()["message_id"] and retried.json()["message_id"] is None  # published once

    assert _rows(pg_url, "SELECT id, qty FROM web_orders") == [("o-1", 2)]
    assert _rows(pg_url, "SELECT available FROM web_stock") == [(1,)]
    waiting = _rows(pg_url, "SELECT message_id, destination, type, key FROM framework_outbox")
    assert waiting == [(message_id, "web.orders.placed", "OrderPlaced", "o-1")]  # nothing of o-2

    # The consumer's database resource reads DATABASE_URL; the harness runs the relay too.
    monkeypatch.setenv("DATABASE_URL", pg_url)
    received: list[str] = []

    async def consume() -> None:
        async with ServiceHarness(
            [web_orders.fulfilment], url=redis_url, namespace=namespace, outbox_database_url=pg_url
        ) as h:
            with anyio.fail_after(30):
                while not _rows(pg_url, "SELECT order_id FROM web_shipments"):
                    await anyio.sleep(0.05)
            await h.run_until_idle()
            received.extend(e.id for e in await h.messages("web.orders.placed"))
            received.extend(e.type for e in await h.messages("web.reminders.sent"))

    anyio.run(consume)
    assert received == [message_id, "Remind"]  # the outbox row's id, kept by the relay; one reminder
    assert _rows(pg_url, "SELECT order_id, sku FROM web_shipments") == [("o-1", "A")]
    assert _rows(pg_url, "SELECT count(*) FROM framework_outbox") == [(0,)]

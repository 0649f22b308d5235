"""billing under faults, as a team would test its own service with ``framework.testing.Chaos``: three
real worker processes, one SIGKILLed, one paused past its lease, every connection reset, and 50
orders delivered twice, while 300 orders flow; each order must be charged exactly once."""

from __future__ import annotations

import os
import time
from pathlib import Path

import anyio
import pytest
from sqlalchemy import text

from example_services.shop import db
from example_services.shop.messages import ORDERS_PLACED, OrderPlaced
from framework import SyncClient
from framework.testing import Chaos, exactly_once, wait_for


async def _prepare(url: str) -> None:
    engine = db.open_engine(url)
    await db.prepare(engine)
    await engine.dispose()


async def _charged(url: str) -> list[str]:
    engine = db.open_engine(url)
    try:
        async with engine.connect() as conn:
            return [r[0] for r in await conn.execute(text("SELECT order_id FROM billing_charges"))]
    finally:
        await engine.dispose()


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.postgres
def test_each_order_is_charged_once_through_kills_pauses_resets_and_duplicates(
    redis_url: str, namespace: str, pg_url: str, tmp_path: Path
) -> None:
    anyio.run(_prepare, pg_url)
    orders = [OrderPlaced(f"mug-{i}", f"c-{i % 7}", "mug", 1, 1_250, "4242-4242-4242-4242") for i in range(300)]
    env = {**os.environ, "DATABASE_URL": pg_url, "SHOP_GATEWAY_FLAKINESS": "0.05"}
    with Chaos(redis_url, namespace, tmp_path / "logs", env=env) as chaos:
        for name in ("billing-1", "billing-2", "billing-3"):
            chaos.start("example_services.shop.billing:billing", name, "--lease-ttl", "2", "--visibility-timeout", "5")
        wait_for(  # every worker owns partitions: each fault then hits a worker that holds work
            lambda: all('"acquired partitions"' in chaos.pool.log(n) for n in chaos.pool.procs), 60, "a balanced group"
        )
        with SyncClient(redis_url, namespace=namespace) as client:
            for start in range(0, 300, 30):
                client.publish_many(ORDERS_PLACED, orders[start : start + 30], key=lambda o: o.order_id)
                if start == 90:
                    chaos.kill("billing-1")  # mid-stream: what it held is taken over by the others
                if start == 150:
                    chaos.pause("billing-2", 5)  # past its 2 s lease: its partitions move, its late acks are refused
                if start == 210:
                    assert chaos.reset_connections() > 0  # every worker's broker connection, abruptly
                time.sleep(0.2)
        assert chaos.duplicate("orders.placed", 50) == 50  # 50 orders delivered again, same message ids
        wait_for(lambda: len(set(anyio.run(_charged, pg_url))) == 300, 120, "every order charged", poll=0.5)
        time.sleep(7)  # the paused worker is back and everything settled: a late double charge would show now
        result = exactly_once([o.order_id for o in orders], anyio.run(_charged, pg_url))
        result.check()
        recovery = chaos.pool.recovery()
        assert recovery.taken_over + recovery.reread + recovery.claimed > 0, (
            "the killed worker's entries were redelivered"
        )
        assert recovery.leases_lost > 0, "the paused worker found its leases gone"
        assert sum(c["duplicates"] for c in chaos.pool.counters().values()) >= 50


def test_exactly_once_names_what_was_lost_doubled_or_never_sent() -> None:
    result = exactly_once(["a", "b", "c"], ["a", "a", "c", "z"])
    assert (result.lost, result.doubled, result.unexpected, result.ok) == (("b",), ("a",), ("z",), False)
    with pytest.raises(AssertionError, match=r"1 lost \['b'\], 1 applied twice or more \['a'\], 1 never sent"):
        result.check()
    exactly_once(["a"], ["a"]).check()

"""notifications' tests: e-mails sent once through a flaky mail server, malformed commands
dead-lettered at once naming the field, the daily digest recorded once per day."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import insert, text
from sqlalchemy.ext.asyncio import AsyncEngine

from example_services.shop import db
from example_services.shop.messages import SEND_EMAIL, SendEmail
from example_services.shop.notifications import notifications
from framework.scheduling import Tick
from framework.testing import ServiceHarness


@pytest.mark.anyio
async def test_sends_each_email_once_through_a_flaky_server(
    framework_redis_url: str,
    framework_namespace: str,
    shop_engine: AsyncEngine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SHOP_MAIL_FLAKINESS", "0.5")
    async with ServiceHarness([notifications], url=framework_redis_url, namespace=framework_namespace) as h:
        for n in range(20):
            await h.client.send(SEND_EMAIL, SendEmail(f"c{n}@example.com", "hello", f"o-{n}"), message_id=f"m-{n}")
        await h.client.send(SEND_EMAIL, SendEmail("c3@example.com", "hello", "o-3"), message_id="m-3")  # a copy
        await h.run_until_idle()
        stats = h.stats()["notifications.send_email"]
        assert stats["retried"] > 0 and stats["dead_lettered"] == 0
    async with shop_engine.connect() as conn:
        assert (
            await conn.execute(text("SELECT count(*), count(DISTINCT recipient) FROM notifications_emails"))
        ).one() == (20, 20)


@pytest.mark.anyio
async def test_a_malformed_command_is_dead_lettered_without_retries(
    framework_redis_url: str, framework_namespace: str, shop_engine: AsyncEngine
) -> None:
    async with ServiceHarness([notifications], url=framework_redis_url, namespace=framework_namespace) as h:
        await h.client.send(SEND_EMAIL, {"to": 42, "subject": "hi"})
        await h.client.send(SEND_EMAIL, {"subject": "no recipient"})
        await h.run_until_idle()
        dead = await h.dead_letters()
        assert len(dead) == 2 and all(d.attempts <= 1 for d in dead)
        assert any("to" in (d.reason + d.error_message) for d in dead)


@pytest.mark.anyio
async def test_the_daily_digest_counts_yesterday_once(
    framework_redis_url: str, framework_namespace: str, shop_engine: AsyncEngine
) -> None:
    async with shop_engine.begin() as conn:
        for n, (day, status) in enumerate([(25, "shipped"), (25, "cancelled"), (26, "shipped")]):
            await conn.execute(
                insert(db.orders).values(
                    id=f"o-{n}",
                    customer="ada",
                    sku="mug",
                    qty=1,
                    amount_cents=100,
                    status=status,
                    created_at=datetime(2026, 11, day, 12, tzinfo=UTC),
                )
            )
    tick = Tick("daily_digest", datetime(2026, 11, 26, 7, tzinfo=UTC))
    async with ServiceHarness([notifications], url=framework_redis_url, namespace=framework_namespace) as h:
        await h.client.send("notifications.job.daily_digest", tick)  # what the cron ticker sends at 07:00
        await h.client.send("notifications.job.daily_digest", tick)  # a second instance's tick: no second row
        await h.run_until_idle()
    async with shop_engine.connect() as conn:
        assert list(await conn.execute(text("SELECT day, orders, shipped FROM notifications_digests"))) == [
            ("2026-11-25", 2, 1)
        ]

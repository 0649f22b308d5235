"""notifications: sends e-mails from a command queue, exactly once, and a daily digest.

* ``notifications.email`` is a command queue: any service asks for an e-mail with a ``SendEmail``.
  The mail server is flaky (:class:`MailServerBusy`, retried with backoff); the sent e-mail is
  recorded with the message's inbox record, so a redelivered command sends nothing twice.
* A malformed command (a missing field, a wrong type) cannot be decoded into ``SendEmail``: the
  framework dead-letters it at once with the field it could not read, without running the handler.
* ``daily_digest`` is a recurring job (``@notifications.cron``): at 07:00 UTC every day, once across
  all instances, it counts yesterday's orders and records the digest (here: a row; in real life an
  e-mail to the team).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from datetime import timedelta

from sqlalchemy import insert, text
from sqlalchemy.ext.asyncio import AsyncEngine

from example_services.shop import db
from example_services.shop.billing import flaky
from example_services.shop.messages import SEND_EMAIL, SendEmail
from framework import Context, RetryPolicy, Service
from framework.scheduling import Tick


class MailServerBusy(Exception):
    """The SMTP server answered 421 (try again later)."""


notifications = Service("notifications", retry=RetryPolicy(max_attempts=6, backoff=0.05, max_delay=1.0))


@notifications.resource
async def database() -> AsyncIterator[AsyncEngine]:
    """The notifications database engine, one per worker process."""
    async for engine in db.database_resource():
        yield engine


def mail_server_send(email: SendEmail, message_id: str, attempt: int) -> None:
    """The simulated SMTP call: busy now and then (``$SHOP_MAIL_FLAKINESS``, default 0.1)."""
    if flaky(message_id, attempt, float(os.environ.get("SHOP_MAIL_FLAKINESS", "0.1"))):
        raise MailServerBusy(f"421 mail server busy sending to {email.to}")


@notifications.command(SEND_EMAIL)
async def send_email(email: SendEmail, ctx: Context) -> None:
    """Send one e-mail; recorded with the inbox, so a copy of the command sends nothing."""
    async with ctx.sql_transaction(ctx.resources[database]) as conn:
        mail_server_send(email, ctx.message_id, ctx.attempt)  # raising rolls the block back: retried
        await conn.execute(
            insert(db.emails).values(
                message_id=ctx.message_id, recipient=email.to, subject=email.subject, order_id=email.order_id
            )
        )


@notifications.cron("0 7 * * *")
async def daily_digest(tick: Tick, ctx: Context) -> None:
    """Yesterday's orders and shipments, once per day across every instance."""
    end = tick.at.replace(hour=0, minute=0, second=0, microsecond=0)
    start = end - timedelta(days=1)
    async with ctx.sql_transaction(ctx.resources[database]) as conn:
        counts = (
            await conn.execute(
                text(
                    "SELECT count(*), coalesce(sum(CASE WHEN status = 'shipped' THEN 1 ELSE 0 END), 0) "
                    "FROM shop_orders WHERE created_at >= :start AND created_at < :end"
                ),
                {"start": start, "end": end},
            )
        ).one()
        await conn.execute(
            text(
                "INSERT INTO notifications_digests (day, orders, shipped) VALUES (:d, :o, :s) "
                "ON CONFLICT (day) DO NOTHING"
            ),
            {"d": start.date().isoformat(), "o": counts[0], "s": counts[1]},
        )

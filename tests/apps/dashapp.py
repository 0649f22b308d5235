"""A service for the dashboard's browser tests (tests/test_web_dashboard.py).

``payments.charge`` refuses every message while ``$DASH_FIXED`` is unset (a fatal error: straight
to the dead-letter queue, with the reason); with ``DASH_FIXED=1`` it appends the order id to
``$DASH_DONE`` (the fixed handler).
"""

from __future__ import annotations

import os

import attrs

from framework import Context, Queue, RetryPolicy, Service


class CardDeclined(Exception):
    """The poison: never retried."""


@attrs.frozen
class Charge:
    order_id: str
    card_number: str
    amount_cents: int


CHARGES = Queue("dash.charges", partitions=2)  # owned partitions: the overview shows their owner
payments = Service("payments")


@payments.command(CHARGES, retry=RetryPolicy(max_attempts=1, fatal=(CardDeclined,)))
def charge(cmd: Charge, ctx: Context) -> None:  # sync: runs in a worker thread
    if not os.environ.get("DASH_FIXED"):
        raise CardDeclined(f"card declined for order {cmd.order_id}")
    with open(os.environ["DASH_DONE"], "a") as f:
        f.write(cmd.order_id + "\n")

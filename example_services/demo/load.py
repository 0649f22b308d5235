"""The demo's workload: orders placed through the HTTP API, and a few malformed e-mail commands."""

from __future__ import annotations

import random
from collections.abc import Callable

import anyio
import attrs
import httpx

from example_services.shop.db import CATALOGUE
from framework import Client

GOOD_CARDS = ("4242-4242-4242-4242", "5555-5555-5555-4444", "4000-0566-5566-5556")
DECLINED_CARDS = ("4000-0000-0000-0002", "4000-0000-0000-0119", "4000-0000-0000-0127")
INVALID_CARD = "4242-4242-4242-4241"  # fails the Luhn check: billing dead-letters it
SCARCE = ("hoodie", "poster")  # stocked below demand: some of their orders are short


@attrs.frozen
class Order:
    customer: str
    sku: str
    qty: int
    card: str


def orders(n: int, seed: int = 38) -> list[Order]:
    """``n`` orders: about 4% declined cards, 1% invalid card numbers, the rest good."""
    rng = random.Random(seed)
    skus = sorted(CATALOGUE)
    made = []
    for _ in range(n):
        roll = rng.random()
        card = rng.choice(DECLINED_CARDS) if roll < 0.04 else INVALID_CARD if roll < 0.05 else rng.choice(GOOD_CARDS)
        made.append(Order(f"customer-{rng.randrange(200):03d}", rng.choice(skus), rng.randint(1, 3), card))
    if n >= 3:  # at least one of each outcome, whatever the seed
        made[0] = attrs.evolve(made[0], card=DECLINED_CARDS[0])
        made[1] = attrs.evolve(made[1], card=INVALID_CARD)
    return made


def stock_for(placed: list[Order]) -> dict[str, int]:
    """Enough stock for every SKU's demand, except the scarce ones (about 70% of theirs)."""
    demand = {sku: 0 for sku in CATALOGUE}
    for o in placed:
        demand[o.sku] += o.qty
    return {sku: int(d * 0.7) if sku in SCARCE else d + 10 for sku, d in demand.items()}


async def place_all(
    api: str, placed: list[Order], seconds: float, on_placed: Callable[[str, Order], None], concurrency: int = 8
) -> list[str]:
    """POST every order, spread over about ``seconds``; return the errors (one line each)."""
    errors: list[str] = []
    pace = seconds / max(len(placed), 1)
    limiter = anyio.CapacityLimiter(concurrency)
    async with httpx.AsyncClient(base_url=api, timeout=30) as http:

        async def post(o: Order) -> None:
            async with limiter:
                try:
                    r = await http.post("/orders", json=attrs.asdict(o))
                except httpx.HTTPError as exc:
                    errors.append(f"POST /orders: {type(exc).__name__}: {exc}")
                    return
                if r.status_code == 201:
                    on_placed(r.json()["order_id"], o)
                else:
                    errors.append(f"POST /orders: {r.status_code} {r.text[:200]}")

        async with anyio.create_task_group() as tg:
            for o in placed:
                tg.start_soon(post, o)
                await anyio.sleep(pace)
    return errors


MALFORMED = ({"to": 42, "subject": "wrong type"}, {"subject": "no recipient"}, {"to": "x@example.com"})


async def send_malformed(broker_url: str, namespace: str) -> int:
    """Send e-mail commands that cannot be decoded: notifications dead-letters them at once."""
    async with Client(broker_url, namespace=namespace) as client:
        for body in MALFORMED:
            await client.send("notifications.email", body)
    return len(MALFORMED)

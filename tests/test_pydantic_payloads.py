"""Pydantic v2 models as payload types: validated on decode, bad ones dead-lettered naming the field,
and the framework working where Pydantic is not installed."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime

import pytest
from pydantic import BaseModel, ConfigDict, Field

from framework import Context, PayloadError, Service
from framework._payloads import decoder_for, encode_payload
from framework.testing import ServiceHarness

pytestmark = pytest.mark.anyio


class Line(BaseModel):
    sku: str
    qty: int = Field(gt=0)


class OrderPlaced(BaseModel):
    model_config = ConfigDict(strict=True, populate_by_name=True)

    order_id: str = Field(alias="orderId")
    placed_at: datetime
    lines: list[Line]


def test_a_model_encodes_by_alias_and_decodes_validated() -> None:
    event = OrderPlaced(order_id="o-1", placed_at=datetime(2026, 1, 2, 3, 4, 5), lines=[Line(sku="A", qty=2)])
    body, content_type = encode_payload(event)
    assert content_type == "application/json" and b'"orderId":"o-1"' in body
    assert decoder_for(OrderPlaced)(body) == event
    with pytest.raises(PayloadError, match=r"payload does not match OrderPlaced: .* @ payload\.lines\[0\]\.qty"):
        decoder_for(OrderPlaced)(b'{"orderId": "o-2", "placed_at": "2026-01-02T03:04:05", "lines": [{"sku": "A"}]}')
    with pytest.raises(PayloadError, match="body is not JSON"):
        decoder_for(OrderPlaced)(b"\xff not json")


async def test_pydantic_payloads_round_trip_and_a_bad_one_is_dead_lettered_naming_the_field(
    redis_url: str, namespace: str
) -> None:
    received: list[OrderPlaced] = []
    forwarded: list[Line] = []
    shop = Service("shop")

    @shop.event("orders.placed")
    async def on_placed(event: OrderPlaced, ctx: Context) -> None:
        received.append(event)
        for line in event.lines:
            ctx.send("stock.reserve", line)  # a model staged by a handler goes out the same way

    @shop.command("stock.reserve")
    def reserve(line: Line) -> None:  # a sync handler too
        forwarded.append(line)

    good = OrderPlaced(order_id="o-1", placed_at=datetime(2026, 1, 2), lines=[Line(sku="A", qty=2)])
    async with ServiceHarness([shop], url=redis_url, namespace=namespace) as h:
        await h.client.publish("orders.placed", good)
        # strict model: a number where a string belongs, and a missing field
        await h.client.publish("orders.placed", {"orderId": 7, "placed_at": "2026-01-02T00:00:00", "lines": []})
        await h.client.publish("orders.placed", {"orderId": "o-3", "lines": []})
        await h.client.send("stock.reserve", {"sku": "B", "qty": 0})
        await h.run_until_idle()
        dead = await h.dead_letters()
    assert received == [good]
    assert forwarded == [Line(sku="A", qty=2)]
    reasons = sorted(d.reason for d in dead)
    assert len(reasons) == 3, reasons
    assert any("payload does not match OrderPlaced" in r and "@ payload.orderId" in r for r in reasons), reasons
    assert any("Field required @ payload.placed_at" in r for r in reasons), reasons
    assert any("payload does not match Line" in r and "greater than 0 @ payload.qty" in r for r in reasons), reasons
    assert all(d.attempts == 1 for d in dead)  # invalid: dead-lettered at once, never retried


_WITHOUT_PYDANTIC = """
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "pydantic" or name.startswith(("pydantic.", "pydantic_core")):
            raise ImportError(f"{name} is blocked: as on an install without pydantic")

sys.meta_path.insert(0, Block())
import attrs, anyio
from framework import Service
from framework.testing import ServiceHarness

@attrs.frozen
class Ping:
    n: int

svc = Service("nopyd")
seen = []

@svc.command("nopyd.ping")
async def ping(p: Ping) -> None:
    seen.append(p.n)

async def main():
    async with ServiceHarness([svc], url=sys.argv[1], namespace=sys.argv[2]) as h:
        await h.client.send("nopyd.ping", Ping(5))
        await h.run_until_idle()

anyio.run(main)
assert seen == [5], seen
assert not any(m.startswith("pydantic") for m in sys.modules), [m for m in sys.modules if "pydantic" in m]
print("ok")
"""


def test_the_framework_runs_without_pydantic_installed(redis_url: str, namespace: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _WITHOUT_PYDANTIC, redis_url, namespace],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "ok", out.stdout[-2000:]

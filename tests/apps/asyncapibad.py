"""A service whose payload holds a type `framework asyncapi` cannot describe (tests/test_asyncapi.py):
``Money`` is decoded through hooks registered on the converter, which say nothing of its JSON shape."""

from __future__ import annotations

import attrs

from framework import Service
from framework._payloads import converter


class Money:
    def __init__(self, cents: int) -> None:
        self.cents = cents


converter.register_structure_hook(Money, lambda value, _: Money(int(value)))
converter.register_unstructure_hook(Money, lambda money: money.cents)


@attrs.frozen
class Payment:
    order_id: str
    amount: Money


bad = Service("bad")


@bad.command("bad.pay")
async def pay(payment: Payment) -> None: ...

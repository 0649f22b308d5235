"""Services declaring every payload shape `framework asyncapi` describes (tests/test_asyncapi.py).

``shapes`` handles a queue of records holding each supported field type, a partitioned topic with
retention, raw bytes, plain JSON, a list, a union, a recurring job and a saga; ``listener``
subscribes to the same topic with another payload type, so that channel has two groups.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import typing
from datetime import timedelta
from typing import Annotated, Any, Literal, NewType, NotRequired, TypedDict

import attrs

from framework import Context, Queue, RetryPolicy, Service, Topic
from framework.saga import SagaContext
from framework.scheduling import Tick

RECORDS = Queue("shapes.record", partitions=3)
EVENTS = Topic("shapes.events", partitions=4, retention=timedelta(hours=1), max_length=1000)

OrderId = NewType("OrderId", str)

print("asyncapiapp: imported")  # output at import must not end up in the document on stdout


class Colour(enum.Enum):
    RED = "red"
    GREEN = "green"


class Priority(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Address(TypedDict):
    street: str
    zip: NotRequired[str]


@dataclasses.dataclass
class Line:
    """One line of an order."""

    sku: str
    quantity: int = 1
    note: str | None = None


@attrs.frozen
class Everything:
    """A record with one field of each supported shape."""

    order_id: OrderId
    text: str
    count: int
    ratio: float
    flag: bool
    at: dt.datetime
    day: dt.date
    blob: bytes
    colour: Colour
    priority: Priority
    mode: Literal["fast", "slow"]
    lines: list[Line]
    tags: frozenset[str]
    pair: tuple[int, str]
    many: tuple[int, ...]
    scores: dict[str, float]
    address: Address
    anything: Any
    weight: Annotated[float, "kg"]
    maybe: int | None
    either: int | Line
    parent: Everything | None = None
    label: str = "none"


@dataclasses.dataclass
class Happened:
    __message_type__ = "shapes.happened"

    order_id: str
    at: dt.datetime


@attrs.frozen
class Paid:
    order_id: str


@attrs.frozen
class PaymentLate:
    order_id: str


shapes = Service("shapes", retry=RetryPolicy(max_attempts=3))


@shapes.command(RECORDS, key=lambda r: r.order_id)
async def record(message: Everything, ctx: Context) -> None:
    """Store a record."""


@shapes.event(EVENTS, start="latest")
async def happened(event: Happened, ctx: Context) -> None: ...


@shapes.command("shapes.raw")
async def raw(body: bytes, ctx: Context) -> None: ...


@shapes.command("shapes.json")
async def json_in(body: dict[str, Any], ctx: Context) -> None: ...


@shapes.command("shapes.lines")
async def lines(body: list[Line], ctx: Context) -> None: ...


@shapes.command("shapes.union")
async def union(body: int | str, ctx: Context) -> None: ...


@shapes.every(timedelta(minutes=5))
async def sweep(tick: Tick, ctx: Context) -> None: ...


payments = shapes.saga("payments", state=dict, partitions=2)


@payments.event("shapes.paid", correlate=lambda e: e.order_id)
async def paid(event: Paid, ctx: SagaContext[dict[str, typing.Any]]) -> None: ...


@payments.timeout
async def late(timeout: PaymentLate, ctx: SagaContext[dict[str, typing.Any]]) -> None: ...


listener = Service("listener")


@listener.event(EVENTS)
def log_event(event: dict[str, Any]) -> None:
    """Log every event."""


shapes.command("shapes.anon")(lambda body: None)  # a handler whose name is no identifier: <lambda>

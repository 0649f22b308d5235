"""Helpers the checks share: opening and closing brokers, unique names, test messages, expected errors."""

from __future__ import annotations

import re
import secrets
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from types import TracebackType
from typing import Any

import orjson

from broker.conformance.features import BrokerFactory
from broker.envelope import Envelope
from broker.protocol import Broker, Delivery, GroupPartition

__all__ = [
    "Brokers",
    "Names",
    "Raised",
    "close_channel",
    "command",
    "event",
    "numbers",
    "one_broker",
    "raises",
    "read_all",
]


class Brokers:
    """Makes brokers with a factory (``await brokers()``) and closes every one it made on exit."""

    def __init__(self, make: BrokerFactory) -> None:
        self._make = make
        self._made: list[Broker] = []

    async def __call__(self) -> Broker:
        broker = await self._make()
        self._made.append(broker)
        return broker

    async def __aenter__(self) -> Brokers:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        while self._made:
            await self._made.pop().close()


@asynccontextmanager
async def one_broker(make: BrokerFactory) -> AsyncIterator[Broker]:
    """A broker from ``make``, closed on exit."""
    async with Brokers(make) as brokers:
        yield await brokers()


class Names:
    """Destination names unique to one run of a check: ``names("orders.placed")`` is the same name
    on every call in the run, never one another run (or check) used."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(4)

    def __call__(self, base: str) -> str:
        return f"{base}.{self.tag}"


def event(topic: str, n: int, key: str | None = None) -> Envelope:
    """An event whose body is ``{"n": n}``."""
    return Envelope(destination=topic, kind="event", type="T", body=orjson.dumps({"n": n}), key=key)


def command(queue: str, n: int, key: str | None = None) -> Envelope:
    """A command whose body is ``{"n": n}``."""
    return Envelope(destination=queue, kind="command", type="C", body=orjson.dumps({"n": n}), key=key)


def numbers(deliveries: Sequence[Delivery]) -> list[int]:
    """The ``n`` of each delivery's body, in order (an undecodable delivery fails the check)."""
    out: list[int] = []
    for d in deliveries:
        assert d.envelope is not None, f"entry {d.entry_id} was not decoded: {d.error}"
        out.append(int(orjson.loads(d.envelope.body)["n"]))
    return out


async def read_all(broker: Broker, views: Sequence[GroupPartition], consumer: str, count: int = 1000) -> list[Delivery]:
    """Every new entry of every view for ``consumer`` (reads until a read comes back empty)."""
    out: list[Delivery] = []
    for view in views:
        while got := await broker.read(view, consumer, count, 10):
            out += got
    return out


async def close_channel(channel: Any) -> None:
    """Release a channel from :meth:`~broker.protocol.GroupReader.channel` (the contract names no way:
    ``aclose`` or ``close`` when it has one)."""
    for name in ("aclose", "close"):
        closer = getattr(channel, name, None)
        if closer is not None:
            result = closer()
            if hasattr(result, "__await__"):
                await result
            return


class Raised:
    """The exception a :func:`raises` block raised (``value``), once the block is left."""

    value: BaseException | None = None


@contextmanager
def raises(kind: type[BaseException], match: str | None = None, *, doing: str = "the call") -> Iterator[Raised]:
    """Expect ``kind`` (its message matching the regex ``match``, searched case-insensitively) from the
    block; AssertionError saying ``doing`` otherwise. No pytest needed."""
    raised = Raised()
    try:
        yield raised
    except kind as exc:
        if match is not None and not re.search(match, str(exc), re.IGNORECASE):
            raise AssertionError(f"{doing} raised {type(exc).__name__}({exc!s}), not matching {match!r}") from exc
        raised.value = exc
        return
    raise AssertionError(f"{doing} did not raise {kind.__name__}")

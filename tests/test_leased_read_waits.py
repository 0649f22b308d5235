"""The leased read's waits (``broker/redis/intake.py``, issue #33): a consumer that waits stays seen,
and a steady stream of small reads does not pay for marking it seen on every wait.

Marking a consumer seen (``XINFO CONSUMERS``: what ``framework status`` and the live-consumer checks
read) took one extra command before every wait; each leased read already marks it, so the extra
read now goes along only when no wait sent one for ``TOUCH_EVERY_S``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import attrs
import orjson
import pytest
import redis.asyncio as aredis

from broker import connect
from broker.capabilities import as_inbox
from broker.conformance.support import Names, command
from broker.protocol import Delivery
from broker.redis.intake import TOUCH_EVERY_S
from broker.redis.wire import Channel
from broker.topology import DestinationSpec

pytestmark = pytest.mark.anyio


@attrs.define
class _Partition:
    """One command queue's partition, read by consumer ``w`` on a connection of its own."""

    broker: Any
    spec: Any
    view: Any
    channel: Any

    async def read(self, block_ms: int) -> list[Delivery]:
        inbox = as_inbox(self.broker)
        return await inbox.read_leased(self.view, "w", 100, block_ms, lease_ms=60_000, channel=self.channel)

    async def publish(self, n: int) -> None:
        await self.broker.publish([command(self.spec.name, n)])


@contextlib.asynccontextmanager
async def _partition(url: str, namespace: str, name: str) -> AsyncIterator[_Partition]:
    broker = await connect(url, namespace=namespace)
    try:
        spec = await broker.declare(DestinationSpec(Names()(name), "command"))
        [view] = await broker.subscribe(spec, "waits")
        channel = broker.channel()  # type: ignore[attr-defined]
        try:
            yield _Partition(broker, spec, view, channel)
        finally:
            await channel.aclose()
    finally:
        await broker.close()


async def _idle_ms(url: str, p: _Partition) -> int:
    """How long ago the server last saw consumer ``w`` (``XINFO CONSUMERS``)."""
    client = aredis.Redis.from_url(url, protocol=2)
    try:
        rows = await client.xinfo_consumers(p.view.stream, p.view.group)
    finally:
        await client.aclose()
    return next(int(r["idle"]) for r in rows if r["name"] in ("w", b"w"))


async def test_a_wait_after_a_pause_marks_the_consumer_seen(redis_url: str, namespace: str) -> None:
    """A fetcher that paused between reads (its handlers had every slot: it waited for capacity)
    is seen again as its next wait starts, not only once that wait ends."""
    got: list[Delivery] = []
    idles = []
    async with _partition(redis_url, namespace, "seen.jobs") as p:

        async def read() -> None:
            got.extend(await p.read(3000))

        assert await p.read(0) == []
        for n in range(2):  # a wait ended by a message, then (after the pause) another
            async with anyio.create_task_group() as tg:
                tg.start_soon(read)
                await anyio.sleep(0.5)  # the wait runs now
                idles.append(await _idle_ms(redis_url, p))
                await p.publish(n)  # ends the wait
            assert len(got) == n + 1
            await p.broker.ack(p.view, got[-1:], inbox=True)
            await anyio.sleep(2 * TOUCH_EVERY_S)  # the pause
    assert max(idles) < 1500, f"idle {idles} ms during waits that began 0.5 s before"


async def test_a_message_published_during_a_pause_is_read_by_the_wait_after_it(redis_url: str, namespace: str) -> None:
    """The wait that marks the consumer seen again reads what arrived meanwhile: its mark takes
    nothing (a read of the consumer's own pending entries past the last id there can be)."""
    async with _partition(redis_url, namespace, "paused.jobs") as p:
        assert await p.read(0) == []
        await p.publish(7)  # arrives before the next read's wait starts
        with anyio.fail_after(10):
            got = await p.read(3000)
    assert [(d.envelope and orjson.loads(d.envelope.body)["n"], d.inbox_status) for d in got] == [(7, 0)]


async def test_steady_small_reads_mark_the_consumer_seen_once_a_second_not_per_wait(
    redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[list[str]] = []
    original = Channel.execute_many

    async def recorded(self: Channel, commands: list[list[Any]], **kwargs: Any) -> Any:
        sent.append([str(c[0]) for c in commands])
        return await original(self, commands, **kwargs)

    monkeypatch.setattr(Channel, "execute_many", recorded)
    got: list[int] = []
    async with _partition(redis_url, namespace, "steady.jobs") as p:

        async def publish() -> None:
            for n in range(30):
                await anyio.sleep(0.02)
                await p.publish(n)

        began = time.monotonic()
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(publish)
                while len(got) < 30:
                    for d in await p.read(2000):
                        assert d.envelope is not None and d.inbox_status == 0  # read and leased: run it
                        got.append(orjson.loads(d.envelope.body)["n"])
                        await p.broker.ack(p.view, [d], inbox=True)
        seconds = time.monotonic() - began
    assert got == list(range(30))  # every message read, leased, once and in order
    waits = [c for c in sent if "XREAD" in c]
    touches = [c for c in waits if c[0] == "XREADGROUP"]
    assert len(waits) >= 20  # the reads waited for most messages (one wait each)
    assert 1 <= len(touches) <= seconds / TOUCH_EVERY_S + 1, (len(touches), len(waits))

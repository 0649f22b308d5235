"""The RabbitMQ broker's reading role: one AMQP consumer per queue read here, and the entries it holds.

RabbitMQ pushes messages to a consumer (up to ``prefetch`` unacknowledged per queue); :meth:`read`
hands out what arrived. What the stream contract calls *pending* is what this broker holds
delivered and unacknowledged: ``read_own_pending``, ``claim_idle``, ``extend`` and
``release_own_pending`` work on it within this connection. Across processes RabbitMQ does the
same by itself: when a connection or channel closes (a worker killed, a network cut), every
message it held goes back to its queue and is delivered again, its ``x-delivery-count`` raised;
there is no claim by idle time and no lease to extend (a handler running longer than the
server's ``consumer_timeout``, 30 minutes on 3.10, has its channel closed and its messages requeued).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import aio_pika.abc
import attrs

from broker.protocol import Delivery, Extension, GroupPartition
from broker.rabbitmq.topology import Topology

__all__ = ["Held", "Reading"]

_LINGER_S = 0.005  # after the first message, wait this long for each further one (a burst in flight)
_FIRST_S = 1.0  # a fresh consumer of a queue holding messages waits this long for the first delivery


def _mono_ms() -> float:
    return time.monotonic() * 1000


@attrs.define
class Held:
    """A message delivered here and not yet settled: its consumer, since when, how often delivered."""

    message: aio_pika.abc.AbstractIncomingMessage
    consumer: str
    since: float
    count: int
    feed: Feed


@attrs.define(eq=False)
class Feed:
    """One AMQP consumer of a queue: its channel and the messages it received that nobody read yet."""

    channel: aio_pika.abc.AbstractChannel
    buffer: deque[aio_pika.abc.AbstractIncomingMessage] = attrs.Factory(deque)
    arrived: asyncio.Event = attrs.Factory(asyncio.Event)
    consumers: Any = None  # the AMQP channel's consumers by tag (the server's cancel removes ours)
    tag: str = ""

    @property
    def alive(self) -> bool:
        """Its channel is open and the server has not cancelled its consumer (its queue deleted)."""
        return not self.channel.is_closed and (self.consumers is None or self.tag in self.consumers)


class Reading(Topology):
    """Delivers messages of a group's queue to its consumers, and keeps what they hold."""

    _feeds: dict[str, Feed]
    _held: dict[str, dict[str, Held]]  # queue -> entry id -> held, in delivery order
    _seen: dict[str, dict[str, float]]  # queue -> consumer name -> last read (monotonic ms)
    _starting: dict[str, asyncio.Lock]

    def channel(self) -> Any:
        """None: reads come from this broker's consumer of each queue (nothing per task to hold)."""
        return None

    async def _feed(self, source: GroupPartition) -> Feed:
        """The consumer of ``source``'s queue, started on first use (again after its channel closed:
        what it held was requeued by the server, so it is forgotten here)."""
        queue_name = source.keys.queue
        feed = self._feeds.get(queue_name)
        if feed is not None and feed.alive:
            return feed
        lock = self._starting.setdefault(queue_name, asyncio.Lock())
        async with lock:  # concurrent first reads start one consumer
            return await self._start_feed(source)

    async def _start_feed(self, source: GroupPartition) -> Feed:
        queue_name = source.keys.queue
        feed = self._feeds.get(queue_name)
        if feed is not None and feed.alive:
            return feed
        if feed is not None:
            held = self._held.get(queue_name, {})
            for entry in [e for e, h in held.items() if h.feed is feed]:
                del held[entry]
            if not feed.channel.is_closed:  # its consumer was cancelled: what it held goes back
                await feed.channel.close()
        channel = await (await self.live()).channel()
        await channel.set_qos(prefetch_count=self.prefetch, timeout=self.timeout)
        try:
            queue = await channel.declare_queue(queue_name, passive=True, timeout=self.timeout)
        except aio_pika.exceptions.ChannelNotFoundEntity:  # deleted behind our back: declared again
            self._ready.discard(queue_name)
            await self._declare_view(source)
            channel = await (await self.live()).channel()
            await channel.set_qos(prefetch_count=self.prefetch, timeout=self.timeout)
            queue = await channel.declare_queue(queue_name, passive=True, timeout=self.timeout)
        feed = Feed(channel)

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            feed.buffer.append(message)
            feed.arrived.set()

        feed.tag = await queue.consume(on_message, timeout=self.timeout)
        underlay: Any = await channel.get_underlay_channel()  # aiormq.Channel: its consumers by tag
        feed.consumers = underlay.consumers
        self._feeds[queue_name] = feed
        ready = queue.declaration_result.message_count or 0
        if ready and not feed.buffer:  # the queue holds messages: let the first ones arrive
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(feed.arrived.wait(), _FIRST_S)
        return feed

    def _entry_id(self, held: dict[str, Held], message: aio_pika.abc.AbstractIncomingMessage) -> str:
        """The entry id of a delivered message: its message id (what ``publish`` returned), made
        unique among the held ones by its delivery tag when a copy of it is held already."""
        entry = message.message_id or f"tag-{message.delivery_tag}"
        return entry if entry not in held else f"{entry}#{message.delivery_tag}"

    async def read(
        self,
        source: GroupPartition,
        consumer: str,
        count: int,
        block_ms: int,
        *,
        channel: Any = None,
        token: int | None = None,
    ) -> list[Delivery]:
        """Hand ``consumer`` up to ``count`` messages delivered to this broker, waiting up to ``block_ms``
        for the first; held until settled. ``token`` is not checked (no fencing on RabbitMQ)."""
        feed = await self._feed(source)
        now = _mono_ms()
        self._seen.setdefault(source.keys.queue, {})[consumer] = now
        held = self._held.setdefault(source.keys.queue, {})
        out: list[Delivery] = []
        deadline = time.monotonic() + max(block_ms, 0) / 1000
        while len(out) < count and feed.alive:  # a lost channel's messages went back to the queue
            if feed.buffer:
                message = feed.buffer.popleft()
                entry = self._entry_id(held, message)
                delivery = self._delivery(source, message, entry)
                held[entry] = Held(message, consumer, now, delivery.delivery_count, feed)
                out.append(delivery)
                continue
            feed.arrived.clear()
            wait = _LINGER_S if out else deadline - time.monotonic()
            if wait <= 0 or not feed.alive:
                break
            try:
                await asyncio.wait_for(feed.arrived.wait(), wait)
            except TimeoutError:
                break
        return out

    def _redeliver(self, source: GroupPartition, entry: str, item: Held, consumer: str) -> Delivery:
        """A held message delivered again (to ``consumer``), its delivery count raised."""
        item.count += 1
        item.consumer = consumer
        item.since = _mono_ms()
        delivery = self._delivery(source, item.message, entry)
        delivery.delivery_count = item.count
        return delivery

    async def read_own_pending(
        self, source: GroupPartition, consumer: str, count: int, after: dict[str, str] | None = None
    ) -> list[Delivery]:
        """Deliver again the messages this broker holds for ``consumer``, oldest first, after the entry
        in ``after`` (this connection's only: a new process starts with nothing held, the server having
        requeued what the old one held)."""
        held = self._held.get(source.keys.queue, {})
        start = (after or {}).get(source.keys.queue)
        out: list[Delivery] = []
        passed = start is None
        for entry, item in list(held.items()):
            if not passed:
                passed = entry == start
                continue
            if item.consumer == consumer and item.feed.alive:
                out.append(self._redeliver(source, entry, item, consumer))
                if len(out) >= count:
                    break
        return out

    async def claim_idle(
        self, source: GroupPartition, consumer: str, min_idle_ms: int, count: int, *, token: int | None = None
    ) -> list[Delivery]:
        """Take over messages held here by any consumer idle ``min_idle_ms`` or longer (delivery counts
        raised). Messages a dead process held are requeued by the server instead."""
        now = _mono_ms()
        out: list[Delivery] = []
        for entry, item in list(self._held.get(source.keys.queue, {}).items()):
            if now - item.since >= min_idle_ms and item.feed.alive:
                out.append(self._redeliver(source, entry, item, consumer))
                if len(out) >= count:
                    break
        return out

    async def release_own_pending(
        self, source: GroupPartition, consumer: str, idle_ms: int, *, keep: Iterable[str] = ()
    ) -> int:
        """Make ``consumer``'s held messages (except ``keep``) claimable here at once; closing the
        broker then requeues them for every consumer of the queue."""
        kept = set(keep)
        released = 0
        for entry, item in self._held.get(source.keys.queue, {}).items():
            if item.consumer == consumer and entry not in kept:
                item.since = _mono_ms() - idle_ms
                released += 1
        return released

    async def prune_consumers(self, source: GroupPartition, min_idle_ms: int, *, keep: str = "") -> int:
        """Forget consumer names that hold nothing here and read nothing for ``min_idle_ms`` (never ``keep``)."""
        seen = self._seen.get(source.keys.queue, {})
        holding = {h.consumer for h in self._held.get(source.keys.queue, {}).values()}
        now = _mono_ms()
        gone = [c for c, at in seen.items() if c != keep and c not in holding and now - at >= min_idle_ms]
        for name in gone:
            del seen[name]
        return len(gone)

    async def extend(
        self, source: GroupPartition, consumer: str, deliveries: Sequence[Delivery], *, lease_ms: int = 60_000
    ) -> Extension:
        """Reset the idle time of the deliveries ``consumer`` still holds here (there is no lease on the
        server: a message stays delivered to this connection until settled or the channel closes)."""
        held = self._held.get(source.keys.queue, {})
        owned: list[str] = []
        taken: list[str] = []
        now = _mono_ms()
        for d in deliveries:
            item = held.get(d.entry_id)
            if item is None or not item.feed.alive:
                continue
            if item.consumer != consumer:
                taken.append(d.entry_id)
                continue
            item.since = now
            owned.append(d.entry_id)
        return Extension(owned, taken)

    async def _stop_feed(self, queue: str) -> None:
        """Stop consuming ``queue`` here; what was held or buffered goes back to the queue."""
        feed = self._feeds.pop(queue, None)
        self._held.pop(queue, None)
        if feed is not None and feed.alive:
            await feed.channel.close()

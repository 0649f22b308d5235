"""The RabbitMQ broker's settlement role: acks, retries through the delay chain, dead letters, attempt counts.

A retry or a dead letter is a copy the broker publishes (confirmed) and then the original's ack:
two steps, not one. A crash or a lost channel between them leaves both the copy and the original
(requeued by the server): the message runs once more, never is lost (duplicates, which an inbox
absorbs). A retry's copy goes to its group's own queue (through the delay chain when not due yet:
never back through the topic, so other groups do not see it); its ``x-death`` headers are not
copied (RabbitMQ before 4.0.1 drops a message whose ``x-death`` shows a dead-letter cycle).
A dead letter goes to the group's DLQ with the reason as headers. ``move_due`` and ``trim`` have
nothing to do: the server moves due retries and deletes acknowledged messages itself.

Redelivered runs are counted in the run journal (``{ns}/runs``, a stream any process reads), not
by the server's ``x-delivery-count``, which also rises for messages a dying worker had only
prefetched: counting runs that started keeps those innocent messages from being dead-lettered as
crash loops. Only redeliveries are counted (after a crash), so the hot path writes nothing there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from broker.envelope import now_ms
from broker.headers import FIRST_FAILED_AT
from broker.ids import new_id
from broker.protocol import Delivery, GroupPartition, GuardedWrite
from broker.rabbitmq.core import message_of_fields
from broker.rabbitmq.names import DELAY_LEVELS
from broker.rabbitmq.publishing import Publishing
from broker.rabbitmq.reading import Held
from broker.topology import DestinationSpec

__all__ = ["DLQ_ID_HEADER", "Settlement"]

_RUNS_KEPT = "1D"  # the run journal's retention: a crash loop is counted within a day

DLQ_ID_HEADER = "fw-dlq-id"
"""The header naming a dead letter (its id in the DLQ: what ``dead_letter`` returns)."""


def _pairs(raw: Sequence[bytes]) -> list[tuple[bytes, bytes]]:
    return list(zip(raw[::2], raw[1::2], strict=False))


class Settlement(Publishing):
    """Settles deliveries: success (ack), failure (retry later, dead letter)."""

    _attempts: dict[tuple[str, str], int]

    def _pending(self, delivery: Delivery) -> Held | None:
        """What this broker holds of ``delivery`` (None: settled, or its channel closed meanwhile)."""
        item = self._held.get(delivery.source.keys.queue, {}).get(delivery.entry_id)
        return item if item is not None and item.feed.alive else None

    async def _settled(self, delivery: Delivery, item: Held) -> None:
        """Acknowledge ``item`` on its channel and forget it; a message whose runs were counted has its
        count reset in the run journal (a redrive of it starts again from none)."""
        self._held.get(delivery.source.keys.queue, {}).pop(delivery.entry_id, None)
        await item.message.ack()
        key = (delivery.source.keys.queue, delivery.message_id)
        if delivery.message_id and self._attempts.pop(key, None) is not None:
            await self._append(self.layout.runs, [{"q": key[0], "id": key[1], "reset": True}])

    async def ack(
        self,
        source: GroupPartition,
        deliveries: Sequence[Delivery],
        *,
        inbox: bool = False,
        channel: Any = None,
        token: int | None = None,
    ) -> int:
        """Acknowledge deliveries; return how many were held here (acknowledged now). With ``inbox``
        their ids are recorded in the inbox's store first (a crash before the AMQP ack: the message
        comes back and is found processed). ``token`` changes nothing (no fencing in this transport);
        a ``settle_write`` is refused (``FAILED``: no state store), its delivery left held."""
        if inbox:
            await self._inbox_record(source, deliveries)
        taken: list[tuple[Delivery, Held]] = []
        held = self._held.get(source.keys.queue, {})
        for d in deliveries:
            if d.settle_write is not None:
                d.settle_write.outcome = GuardedWrite.FAILED
                d.settle_write.error = "the rabbitmq transport has no state store"
                continue
            item = self._pending(d)
            if item is not None and held.pop(d.entry_id, None) is not None:
                taken.append((d, item))
        by_feed: dict[int, list[Held]] = {}
        for _, item in taken:
            by_feed.setdefault(id(item.feed), []).append(item)
        for items in by_feed.values():
            await self._ack_on_feed(items, held)
        for d, _ in taken:
            key = (source.keys.queue, d.message_id)
            if d.message_id and self._attempts.pop(key, None) is not None:
                await self._append(self.layout.runs, [{"q": key[0], "id": key[1], "reset": True}])
        return len(taken)

    @staticmethod
    async def _ack_on_feed(items: list[Held], held: dict[str, Held]) -> None:
        """Acknowledge ``items`` (all of one channel, already taken out of ``held``): every one below the
        channel's lowest tag still unacknowledged (held or not read yet) with one ``multiple`` ack (one
        settlement in the quorum queue's log instead of one each), the others one by one."""
        feed = items[0].feed
        floor = min((h.message.delivery_tag or 0 for h in held.values() if h.feed is feed), default=None)
        if feed.buffer:
            first = feed.buffer[0].delivery_tag or 0
            floor = first if floor is None else min(floor, first)
        items.sort(key=lambda h: h.message.delivery_tag or 0)
        below = [h for h in items if floor is None or (h.message.delivery_tag or 0) < floor]
        if len(below) > 1:
            await below[-1].message.ack(multiple=True)
            rest = items[len(below) :]
        else:
            rest = items
        for item in rest:
            await item.message.ack()

    async def _runs(self, keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], int]:
        """How many redelivered runs the run journal holds for each (queue, message id) since its last reset."""
        await self._declare_journal(self.layout.runs, max_age=_RUNS_KEPT)
        wanted = set(keys)
        counts = dict.fromkeys(wanted, 0)
        for record in await self._read_journal(self.layout.runs):
            key = (record.get("q", ""), record.get("id", ""))
            if key in wanted:
                counts[key] = 0 if record.get("reset") else counts[key] + 1
        return counts

    async def count_attempt(self, delivery: Delivery) -> int:
        """Record in the run journal that a redelivered message is about to run; return how many such
        runs it had (across processes: a message killing one worker after another is counted by each)."""
        key = (delivery.source.keys.queue, delivery.message_id)
        runs = (await self._runs([key]))[key] + 1
        await self._append(self.layout.runs, [{"q": key[0], "id": key[1]}])
        self._attempts[key] = runs
        return runs

    async def count_first_redeliveries(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """Record the first redelivered run of each message that had none in the run journal (True); False
        marks a suspect: an earlier redelivered run started and did not complete (in any process)."""
        if not deliveries:
            return []
        keys = [(d.source.keys.queue, d.message_id) for d in deliveries]
        counts = await self._runs(keys)
        firsts = {key for key in keys if counts[key] == 0}
        await self._append(self.layout.runs, [{"q": q, "id": i} for q, i in sorted(firsts)])
        for key in keys:
            self._attempts[key] = max(self._attempts.get(key, 0), counts[key] or 1)
        return [key in firsts for key in keys]

    async def dead_letter(self, delivery: Delivery, reason: dict[str, str], *, token: int | None = None) -> str | None:
        """Publish the message with ``reason`` to its group's DLQ (confirmed), then ack it; the dead
        letter's id, or None when it was no longer held (nothing written). Its inbox lease is
        released first."""
        item = self._pending(delivery)
        if item is None:
            return None
        await self._inbox_release(delivery)
        dead_id = new_id()
        message = message_of_fields(_pairs(delivery.raw), extra={**reason, DLQ_ID_HEADER: dead_id})
        channel = await self._channel("publish", confirms=True)
        await self._send(channel, [("", delivery.source.keys.dlq, message, False)])
        await self._settled(delivery, item)
        return dead_id

    async def retry_later(
        self, delivery: Delivery, due_ms: int, *, attempt: int | None = None, token: int | None = None
    ) -> bool:
        """Publish a copy (``attempt + 1``, its first failure's time) to the group's queue at ``due_ms``
        (through the delay chain), then ack the original, its inbox lease released first. False when
        it was no longer held."""
        if delivery.envelope is None:
            raise ValueError("an undecodable delivery cannot be retried; dead-letter it")
        item = self._pending(delivery)
        if item is None:
            return False
        await self._inbox_release(delivery)  # first: the copy may be read (and leased) at once
        fields = _pairs(delivery.raw)
        extra: dict[str, Any] = {"fw-attempt": (attempt if attempt is not None else delivery.attempt) + 1}
        if not any(name == FIRST_FAILED_AT.encode() for name, _ in fields):
            extra[FIRST_FAILED_AT] = str(now_ms())
        message = message_of_fields(fields, drop=(b"attempt",), extra=extra)
        queue = delivery.source.keys.queue
        delay = due_ms - now_ms()
        if delay > 0:
            await self._ensure_delay_chain()
            route = (self.layout.delay_exchange(DELAY_LEVELS - 1), self.layout.delay_key(delay, queue))
        else:
            route = ("", queue)
        channel = await self._channel("publish", confirms=True)
        await self._send(channel, [(route[0], route[1], message, False)])
        await self._settled(delivery, item)
        return True

    async def move_due(self, source: GroupPartition, now_ms: int, limit: int = 500) -> int:
        """Nothing to move: the delay chain's queues deliver due retries themselves. Returns 0."""
        return 0

    async def trim(self, spec: DestinationSpec, partition: int, now_ms: int) -> int:
        """Nothing to trim: queues delete what is acknowledged and topics keep no log. Returns 0."""
        return 0

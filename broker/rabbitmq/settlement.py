"""The RabbitMQ broker's settlement role: acks, retries through the delay chain, dead letters, attempt counts.

A retry or a dead letter is a copy the broker publishes (confirmed) and then the original's ack:
two steps, not one. A crash or a lost channel between them leaves both the copy and the original
(requeued by the server): the message runs once more, never is lost (duplicates, which an inbox
absorbs). A retry's copy goes to its group's own queue (through the delay chain when not due yet:
never back through the topic, so other groups do not see it); its ``x-death`` headers are not
copied (RabbitMQ before 4.0.1 drops a message whose ``x-death`` shows a dead-letter cycle).
A dead letter goes to the group's DLQ with the reason as headers. ``move_due`` and ``trim`` have
nothing to do: the server moves due retries and deletes acknowledged messages itself.
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
        """Acknowledge ``item`` on its channel and forget it."""
        self._held.get(delivery.source.keys.queue, {}).pop(delivery.entry_id, None)
        await item.message.ack()
        if delivery.message_id:
            self._attempts.pop((delivery.source.keys.queue, delivery.message_id), None)

    async def ack(
        self,
        source: GroupPartition,
        deliveries: Sequence[Delivery],
        *,
        inbox: bool = False,
        channel: Any = None,
        token: int | None = None,
    ) -> int:
        """Acknowledge deliveries; return how many were held here (acknowledged now). ``inbox`` and
        ``token`` change nothing (no inbox or fencing in this transport); a ``settle_write`` is
        refused (``FAILED``: no state store), its delivery left held."""
        acked = 0
        for d in deliveries:
            if d.settle_write is not None:
                d.settle_write.outcome = GuardedWrite.FAILED
                d.settle_write.error = "the rabbitmq transport has no state store"
                continue
            item = self._pending(d)
            if item is not None:
                await self._settled(d, item)
                acked += 1
        return acked

    async def count_attempt(self, delivery: Delivery) -> int:
        """Count a redelivered run of the message in this process; return how many it had here."""
        key = (delivery.source.keys.queue, delivery.message_id)
        self._attempts[key] = self._attempts.get(key, 0) + 1
        return self._attempts[key]

    async def count_first_redeliveries(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """Count the first redelivered run of each message (in this process); False for one that had one."""
        out: list[bool] = []
        for d in deliveries:
            key = (d.source.keys.queue, d.message_id)
            out.append(key not in self._attempts)
            self._attempts.setdefault(key, 1)
        return out

    async def dead_letter(self, delivery: Delivery, reason: dict[str, str], *, token: int | None = None) -> str | None:
        """Publish the message with ``reason`` to its group's DLQ (confirmed), then ack it; the dead
        letter's id, or None when it was no longer held (nothing written)."""
        item = self._pending(delivery)
        if item is None:
            return None
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
        (through the delay chain), then ack the original. False when it was no longer held."""
        if delivery.envelope is None:
            raise ValueError("an undecodable delivery cannot be retried; dead-letter it")
        item = self._pending(delivery)
        if item is None:
            return False
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

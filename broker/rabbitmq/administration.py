"""The RabbitMQ broker's administration role: dead letters (list, redrive, purge), unsubscribe, delete a destination.

A DLQ is a classic durable queue (``{queue}/dlq``), so reading it without consuming is possible:
the broker takes its messages on a channel of its own without acknowledging them and closes that
channel, which puts every one back in its place (a classic queue keeps no delivery limit, so
looking does not wear a dead letter out). Redrive and purge acknowledge the ones they move or
delete on that channel; a redriven copy is published (confirmed) before its dead letter is acked.
Only one operator's look at a DLQ at a time sees it whole: messages another look holds are hidden.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import aio_pika.abc

from broker.errors import ConfigurationError
from broker.protocol import GroupPartition
from broker.rabbitmq.core import fields_of_message, message_of_fields
from broker.rabbitmq.settlement import DLQ_ID_HEADER, Settlement, _pairs
from broker.topology import DestinationSpec

__all__ = ["Administration"]

_DROPPED_ON_REDRIVE = (b"attempt", b"first-failed-at")


class Administration(Settlement):
    """Inspects and repairs a group's dead letters; removes groups and destinations."""

    @asynccontextmanager
    async def _look(
        self, queue: str, count: int | None = None
    ) -> AsyncIterator[list[aio_pika.abc.AbstractIncomingMessage]]:
        """The messages of ``queue`` (up to ``count``), taken unacknowledged on a channel of their own;
        those not acknowledged inside the block go back in place when it ends."""
        channel = await (await self.live()).channel()
        taken: list[aio_pika.abc.AbstractIncomingMessage] = []
        try:
            try:
                found = await channel.declare_queue(queue, passive=True, timeout=self.timeout)
            except aio_pika.exceptions.ChannelNotFoundEntity:
                found = None
            while found is not None and (count is None or len(taken) < count):
                message = await found.get(no_ack=False, fail=False, timeout=self.timeout)
                if message is None:
                    break
                taken.append(message)
            yield taken
        finally:
            if not channel.is_closed:
                await channel.close()

    async def dead_letter_entries(
        self, view: GroupPartition, count: int | None = None
    ) -> list[tuple[str, dict[bytes, bytes]]]:
        """The group's dead letters on this partition, oldest first: (dead letter id, fields)."""
        async with self._look(view.keys.dlq, count) as taken:
            out = []
            for message in taken:
                dead_id = str((message.headers or {}).get(DLQ_ID_HEADER, message.message_id or ""))
                out.append((dead_id, dict(_pairs(fields_of_message(message)))))
            return out

    async def redrive(self, view: GroupPartition, dlq_entry_id: str) -> str | None:
        """Publish one dead letter back to its group's queue only, as a first attempt (without the
        ``dlq-*`` fields, ``attempt`` and ``first-failed-at``), then remove it; None if it is gone."""
        async with self._look(view.keys.dlq) as taken:
            for message in taken:
                if str((message.headers or {}).get(DLQ_ID_HEADER, "")) != dlq_entry_id:
                    continue
                fields = [
                    (name, value)
                    for name, value in _pairs(fields_of_message(message))
                    if not name.startswith(b"dlq-") and name not in _DROPPED_ON_REDRIVE
                ]
                if not fields:
                    return None
                channel = await self._channel("publish", confirms=True)
                await self._send(channel, [("", view.keys.queue, message_of_fields(fields), False)])
                await message.ack()
                return message.message_id or dlq_entry_id
        return None

    async def purge_dead_letters(self, view: GroupPartition, dlq_entry_ids: Sequence[str]) -> int:
        """Delete dead letters for good; return how many existed."""
        if not dlq_entry_ids:
            return 0
        wanted = set(dlq_entry_ids)
        purged = 0
        async with self._look(view.keys.dlq) as taken:
            for message in taken:
                if str((message.headers or {}).get(DLQ_ID_HEADER, "")) in wanted:
                    await message.ack()
                    purged += 1
        return purged

    async def _delete_queue(self, name: str) -> int:
        """Delete a queue (with what it holds); 1 when it existed."""
        await self._stop_feed(name)
        self._ready.discard(name)
        if await self.queue_counts(name) is None:
            return 0
        channel = await self._channel()
        await channel.queue_delete(name, timeout=self.timeout)
        return 1

    async def unsubscribe(self, spec: DestinationSpec, group: str) -> None:
        """Remove ``group`` from every partition of ``spec``: its queues (a topic's), dead letters and inbox.

        A queue destination keeps its partition queues and what they hold for its next owner. The
        group's inbox records go first (an unreachable inbox store stops it before anything is deleted).
        """
        for p in range(spec.partitions):
            await self._inbox_forget(self.group_partition(spec, p, group))
        for p in range(spec.partitions):
            view = self.group_partition(spec, p, group)
            await self._delete_queue(view.keys.dlq)
            if spec.is_topic:
                await self._delete_queue(view.keys.queue)
            else:
                await self._stop_feed(view.keys.queue)
        await self._record({"op": "unsubscribe", "destination": spec.name, "group": group})

    async def delete_destination(self, spec: DestinationSpec, *, force: bool = False) -> int:
        """Delete ``spec`` with its queues and every group's queues, dead letters and inbox records; return
        how many queues went. Refuses with ``ConfigurationError`` while a group is subscribed or messages are
        stored, unless ``force``."""
        registry = await self.read_registry()
        groups = sorted({g for d, g in registry.subscriptions if d == spec.name})
        entries = 0
        if not spec.is_topic:
            for p in range(spec.partitions):
                entries += await self._ready_count(self.layout.queue(spec.name, p))
        if (groups or entries) and not force:
            raise ConfigurationError(
                f"{spec.name!r} still has {len(groups)} consumer group(s) ({', '.join(groups) or 'none'}) "
                f"and {entries} stored entr{'y' if entries == 1 else 'ies'}: unsubscribe the groups and let them "
                "drain first, or force the delete"
            )
        deleted = 0
        for p in range(spec.partitions):
            for group in groups:
                await self._inbox_forget(self.group_partition(spec, p, group))
        for p in range(spec.partitions):
            for group in groups:
                view = self.group_partition(spec, p, group)
                deleted += await self._delete_queue(view.keys.dlq)
                if spec.is_topic:
                    deleted += await self._delete_queue(view.keys.queue)
            if not spec.is_topic:
                queue = self.layout.queue(spec.name, p)
                deleted += await self._delete_queue(self.layout.dlq(queue)) + await self._delete_queue(queue)
        await self._record({"op": "delete", "name": spec.name})
        self._specs.pop(spec.name, None)
        return deleted

    async def _ready_count(self, queue: str) -> int:
        """Messages ready in ``queue`` (a passive declare's count; 0 when it does not exist)."""
        counts = await self.queue_counts(queue)
        return counts[0] if counts is not None else 0

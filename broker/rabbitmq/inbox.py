"""The RabbitMQ broker's inbox role: the ``inbox`` capability, kept in a store beside the server.

RabbitMQ keeps no record of what a group processed, so the inbox lives in a :class:`SideInbox`
given to the broker when it is built (:func:`broker.connect` gives it the Redis inbox,
``broker.redis.side_inbox.RedisInbox``: the same keys, scripts and layout as on the Redis
transport). The broker then declares ``inbox``; built without one (``?inbox=none``) it does not,
and services with the default inbox are refused at start.

How it keeps "no effect twice" with RabbitMQ's acks:

* :meth:`read_leased` reads as :meth:`~broker.rabbitmq.reading.Reading.read` does, then leases the
  read messages' ids in one call to the store (each delivery's ``inbox_status`` set). A redelivered
  message (``x-delivery-count``: its earlier holder's channel closed, or it was claimed here after
  the visibility timeout) takes a stale lease over, as on Redis.
* ``ack(..., inbox=True)`` records the processed ids in the store **before** the AMQP ack: a crash
  between the two leaves the message to be delivered again and then found processed (a duplicate
  dropped, never an effect twice).
* A retry or a dead letter releases the message's lease before its copy is published, so the
  copy runs at once instead of waiting for the lease to expire.
* ``extend`` pushes out the leases of what the consumer still holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from broker.introspection import InboxMemory
from broker.protocol import Delivery, Extension, GroupPartition
from broker.rabbitmq.reading import Reading

__all__ = ["Inboxes", "SideInbox"]


class SideInbox(Protocol):
    """An inbox store kept beside a transport, per group partition (``source``: the transport's view)."""

    def describe(self) -> str:
        """Where it lives (no password), for messages."""
        ...

    async def ready(self) -> None:
        """Connect (if not yet); ``BrokerUnavailable`` in one line when the store cannot be reached."""
        ...

    async def claim(
        self, source: GroupPartition, deliveries: Sequence[Delivery], lease_ms: int, *, window_ms: int = 0
    ) -> list[int]:
        """Check and lease, as :meth:`broker.capabilities.InboxStore.inbox_claim`."""
        ...

    async def record(self, source: GroupPartition, message_ids: Sequence[str]) -> None:
        """Record ``message_ids`` as processed for good (their leases dropped)."""
        ...

    async def extend(self, source: GroupPartition, message_ids: Sequence[str], lease_ms: int) -> None:
        """Push the live leases of ``message_ids`` out to ``lease_ms`` from now."""
        ...

    async def release(self, source: GroupPartition, message_ids: Sequence[str]) -> None:
        """End the leases of ``message_ids`` now (records stay)."""
        ...

    async def trim(self, source: GroupPartition, older_than_ms: int) -> int:
        """Forget records older than ``older_than_ms`` and expired leases."""
        ...

    async def memory(self, source: GroupPartition) -> InboxMemory:
        """What the group partition's inbox holds."""
        ...

    async def forget(self, source: GroupPartition) -> int:
        """Delete the group partition's inbox (records and leases): the group is going away."""
        ...

    async def close(self) -> None:
        """Close its connection."""
        ...


class Inboxes(Reading):
    """The inbox capability over a :class:`SideInbox` (see the module's docstring)."""

    side_inbox: SideInbox | None = None

    def _store(self) -> SideInbox:
        if self.side_inbox is None:
            raise TypeError("the rabbitmq transport has no 'inbox' capability here (the broker URL says ?inbox=none)")
        return self.side_inbox

    async def inbox_ready(self) -> None:
        """Connect the inbox's store now (the runtime's start): one line saying what to do when it cannot."""
        await self._store().ready()

    async def inbox_claim(
        self,
        source: GroupPartition,
        deliveries: Sequence[Delivery],
        lease_ms: int,
        *,
        channel: Any = None,
        window_ms: int = 0,
    ) -> list[int]:
        """Per delivery: 0 leased to the caller (run it), 1 already processed (ack it), 2 leased elsewhere
        (leave it held); redeliveries take stale leases over. One call to the store."""
        return await self._store().claim(source, deliveries, lease_ms, window_ms=window_ms)

    async def read_leased(
        self,
        source: GroupPartition,
        consumer: str,
        count: int,
        block_ms: int,
        *,
        lease_ms: int,
        window_ms: int = 0,
        channel: Any = None,
        token: int | None = None,
    ) -> list[Delivery]:
        """:meth:`read`, then the read messages' leases in one call to the store (``inbox_status`` set).

        When the store fails the error propagates; what was read stays held here and is delivered
        again by ``claim_idle`` after the visibility timeout (or by the server if the process ends)."""
        out = await self.read(source, consumer, count, block_ms, channel=channel, token=token)
        ided = [d for d in out if d.message_id]
        if ided:
            statuses = await self._store().claim(source, ided, lease_ms, window_ms=window_ms)
            for d, status in zip(ided, statuses, strict=True):
                d.inbox_status = status
        for d in out:
            if not d.message_id:  # undecodable: no id to lease (it is dead-lettered), as on Redis
                d.inbox_status = 0
        return out

    async def trim_inbox(self, source: GroupPartition, older_than_ms: int) -> int:
        """Forget processed ids recorded before ``older_than_ms`` and leases that expired."""
        return await self._store().trim(source, older_than_ms)

    async def extend(
        self, source: GroupPartition, consumer: str, deliveries: Sequence[Delivery], *, lease_ms: int = 60_000
    ) -> Extension:
        """:meth:`Reading.extend`, and the inbox leases of the deliveries still held pushed out by ``lease_ms``."""
        found = await super().extend(source, consumer, deliveries, lease_ms=lease_ms)
        if self.side_inbox is not None and found:
            owned = set(found)
            ids = [d.message_id for d in deliveries if d.entry_id in owned and d.message_id]
            await self.side_inbox.extend(source, ids, lease_ms)
        return found

    async def _inbox_record(self, source: GroupPartition, deliveries: Sequence[Delivery]) -> None:
        """Record the processed deliveries' ids (before their AMQP ack)."""
        if self.side_inbox is not None:
            ids = [d.envelope.id for d in deliveries if d.envelope is not None and d.settle_write is None]
            await self.side_inbox.record(source, ids)

    async def _inbox_release(self, delivery: Delivery) -> None:
        """End the delivery's lease (a retry or a dead letter, before its copy is published)."""
        if self.side_inbox is not None and delivery.message_id:
            await self.side_inbox.release(delivery.source, [delivery.message_id])

    async def _inbox_forget(self, view: GroupPartition) -> None:
        """Delete the group partition's inbox (unsubscribe, delete a destination)."""
        if self.side_inbox is not None:
            await self.side_inbox.forget(view)

    async def _inbox_memory(self, view: GroupPartition) -> InboxMemory:
        return InboxMemory() if self.side_inbox is None else await self.side_inbox.memory(view)

    async def close(self) -> None:
        """Close the AMQP connection, then the inbox store's."""
        try:
            await super().close()
        finally:
            if self.side_inbox is not None:
                await self.side_inbox.close()

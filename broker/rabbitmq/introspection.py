"""The RabbitMQ broker's introspection role: depth, consumers, dead letters, from passive queue declares.

No management plugin: every figure comes from a passive ``queue.declare`` (messages ready, consumers)
and from what this broker itself holds. So ``pending`` counts what this connection holds
unacknowledged (another process's unacknowledged messages are not visible), ``lag`` counts messages
ready in the group's queue plus those delivered here and not yet read, ``delayed`` is 0 (a retry
waiting in the namespace's delay chain is not told apart by group) and a topic's ``depth`` is its
fullest group queue's (nothing is stored for a topic but its groups' copies). Inbox memory is read
from the inbox's store (:mod:`broker.rabbitmq.inbox`).
"""

from __future__ import annotations

from collections.abc import Sequence

from broker.codec import decode_flat
from broker.envelope import Envelope
from broker.errors import BrokerError, connection_errors
from broker.introspection import (
    ConsumerSeen,
    DestinationState,
    DestinationUsage,
    GroupState,
    GroupUsage,
    InboxMemory,
    PartitionState,
    select_destinations,
)
from broker.protocol import GroupPartition
from broker.rabbitmq.administration import Administration
from broker.rabbitmq.core import fields_of_message
from broker.topology import DestinationSpec

__all__ = ["Inspection"]


class Inspection(Administration):
    """Read-only views of destinations and groups (``framework status``, run until idle)."""

    async def _counts(self, queue: str) -> tuple[int, int]:
        """(messages ready, consumers) of ``queue``; (0, 0) when it does not exist."""
        return await self.queue_counts(queue) or (0, 0)

    def _here(self, queue: str) -> tuple[int, int]:
        """(held unacknowledged, received and not yet read) of ``queue`` in this broker."""
        feed = self._feeds.get(queue)
        buffered = len(feed.buffer) if feed is not None and feed.alive else 0
        return len(self._held.get(queue, {})), buffered

    async def group_state(self, view: GroupPartition) -> GroupState:
        """Depth figures of ``view``'s group on its partition (see the module's docstring for their limits)."""
        ready, consumers = await self._counts(view.keys.queue)
        dead, _ = await self._counts(view.keys.dlq)
        held, buffered = self._here(view.keys.queue)
        away: tuple[type[BaseException], ...] = (BrokerError, *connection_errors())
        try:
            inbox = await self._inbox_memory(view)
        except away:  # the inbox's server is away: the queue's figures still count
            inbox = InboxMemory()
        return GroupState(view.group, consumers, held, ready + buffered, 0, dead, inbox)

    async def dead_letter_count(self, view: GroupPartition) -> int:
        """Dead letters of ``view``'s group on its partition."""
        return (await self._counts(view.keys.dlq))[0]

    async def inbox_memory(self, view: GroupPartition, *, now: int | None = None) -> InboxMemory:
        """What the group partition's inbox holds in its store (nothing without one)."""
        return await self._inbox_memory(view)

    async def _groups(self, spec: DestinationSpec) -> list[str]:
        return sorted({g for d, g in (await self.read_registry()).subscriptions if d == spec.name})

    async def _length(self, spec: DestinationSpec, partition: int, groups: Sequence[str]) -> int:
        """Messages stored for a partition: its queue's, or a topic's fullest group queue's."""
        queues = (
            [self.group_partition(spec, partition, g).keys.queue for g in groups]
            if spec.is_topic
            else [self.layout.queue(spec.name, partition)]
        )
        lengths = [0]
        for queue in queues:
            ready, _ = await self._counts(queue)
            lengths.append(ready + sum(self._here(queue)))
        return max(lengths)

    async def describe(self, names: Sequence[str] | None = None) -> list[DestinationState]:
        """State of every declared destination (or of ``names``), with every subscribed group."""
        registry = await self.read_registry()
        specs = select_destinations(sorted(registry.destinations.values(), key=lambda s: s.name), names)
        out = []
        for spec in specs:
            groups = sorted({g for d, g in registry.subscriptions if d == spec.name})
            parts = []
            waiting = await self.side_schedule.counts(spec.name) if self.side_schedule is not None else {}
            for p in range(spec.partitions):
                views = [await self.group_state(self.group_partition(spec, p, g)) for g in groups]
                parts.append(PartitionState(p, await self._length(spec, p, groups), views, waiting.get(p, 0)))
            out.append(DestinationState(spec, parts))
        return out

    async def group_usage(self, spec: DestinationSpec, group: str) -> GroupUsage:
        """Everything ``group`` holds on ``spec`` (what unsubscribing would remove)."""
        start = (await self.read_registry()).subscriptions.get((spec.name, group), "earliest")
        consumers = pending = dead = unread = 0
        for p in range(spec.partitions):
            state = await self.group_state(self.group_partition(spec, p, group))
            consumers = max(consumers, state.consumers)
            pending += state.pending
            dead += state.dead_letters
            unread += state.lag
        seen = [ConsumerSeen(f"{consumers} AMQP consumer(s)", 0, pending)] if consumers else []
        return GroupUsage(spec, group, start, seen, 0, 0, dead, pending, unread + pending, pending, unread, None)

    async def destination_usage(self, spec: DestinationSpec) -> DestinationUsage:
        """The subscribed groups, stored messages and dead letters of ``spec``."""
        groups = await self._groups(spec)
        entries = dead = 0
        for p in range(spec.partitions):
            entries += await self._length(spec, p, groups)
            for g in groups:
                dead += await self.dead_letter_count(self.group_partition(spec, p, g))
        return DestinationUsage(groups, entries, dead)

    async def stored_messages(self, spec: DestinationSpec) -> list[Envelope]:
        """Every message stored for ``spec`` (a topic's: in any group queue, once), decoded, in publication
        order: those held or received here, and the ready ones looked at without consuming them (for tests)."""
        groups = await self._groups(spec)
        found: dict[str, Envelope] = {}
        for p in range(spec.partitions):
            queues = (
                [self.group_partition(spec, p, g).keys.queue for g in groups]
                if spec.is_topic
                else [self.layout.queue(spec.name, p)]
            )
            for queue in queues:
                feed = self._feeds.get(queue)
                mine = [h.message for h in self._held.get(queue, {}).values()]
                mine += list(feed.buffer) if feed is not None else []
                async with self._look(queue) as taken:
                    for message in mine + taken:
                        env = decode_flat(fields_of_message(message), spec.name, spec.kind)
                        found.setdefault(env.id, env)
        return sorted(found.values(), key=lambda e: (e.published_at, e.id))
